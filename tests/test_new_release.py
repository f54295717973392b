"""Supporting a new vLLM release is one adapter module plus its evidence, and nothing else.

In a temporary copy of the repository a synthetic release, the minor release after the newest
adapter's (NEW), gets what the README's "Adding a vLLM release" asks for: ``adapters/vllm_X_Y_0.py``
(subclassing the newest adapter, one ``Change``, one symbol new in NEW) and its static evidence,
made by running ``scripts/static_check.py NEW`` on a source tree of that release. Then, with no other
file touched by hand: the registry serves NEW with the new adapter (and the old adapter stops
matching it), the regenerated matrix has its cells, ``speccompat doctor`` on an installation of it
picks the new adapter, and the nox sessions include it.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from packaging.version import Version
from support.fakes import release_facts, write_fake_speculators, write_fake_vllm
from support.release_tree import release_tree as _tree

from speccompat.probe import Symbol
from speccompat.registry import adapter_modules

REPO = Path(__file__).resolve().parent.parent
NEW_SYMBOL = Symbol("vllm.v1.request:Request.prefill_only", accepts=())

#: The synthetic release: the minor release after the newest adapter's first release.
LAST = str(adapter_modules()[-1][0])
LAST_MOD = adapter_modules()[-1][1]
NEW = f"{Version(LAST).major}.{Version(LAST).minor + 1}.0"
NEW_MOD = "vllm_" + NEW.replace(".", "_")

ADAPTER = '''"""vLLM NEW (synthetic, for tests/test_new_release.py): Request grows prefill_only()."""

from __future__ import annotations

from speccompat.adapter import Change
from speccompat.probe import Symbol, fingerprint

from . import LAST_MOD as prev


class Adapter(prev.Adapter):
    since = "NEW"
    changes = (
        Change(vllm="NEW", what="Request.prefill_only() appears", breaks="nothing (synthetic)",
               how="nothing to do", remove_when="n/a"),
    )
    requires = fingerprint(prev.Adapter.requires, [Symbol("vllm.v1.request:Request.prefill_only", new=True)])
'''.replace("LAST_MOD", LAST_MOD).replace("NEW", NEW)


def _run(tmp: Path, args: list[str], *, path: list[Path] = (), cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECCOMPAT_", "PYTHON"))}
    env["PYTHONPATH"] = os.pathsep.join(map(str, [*path, tmp / "site", tmp / "nox"]))
    proc = subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)
    assert proc.returncode in (0, 3), f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _fake_release(root: Path, version: str) -> None:
    """A vLLM tree shaped like the newest adapter's first release's recorded facts plus the new symbol,
    reporting ``version``."""
    write_fake_vllm(root, [*release_facts(LAST), NEW_SYMBOL], version=version)
    (root / "vllm" / "_version.py").write_text(f'__version__ = "{version}"\n')


def test_a_new_release_needs_one_adapter_module_and_its_evidence(tmp_path):
    repo = _tree(tmp_path)
    before = {p.relative_to(repo): p.read_bytes() for p in repo.rglob("*") if p.is_file()
              and "evidence/cpu" not in str(p) and "evidence/gpu" not in str(p)}

    # 1. the adapter module, 2. its evidence: the static check of the release's sources
    (repo / "adapters" / f"{NEW_MOD}.py").write_text(ADAPTER)
    sources = tmp_path / "sources"
    _fake_release(sources / NEW, NEW)
    out = _run(tmp_path, ["scripts/static_check.py", "--sources", str(sources), "--speculators", "--", NEW],
               cwd=repo).stdout
    assert "all ok" in out, out[-2000:]
    evidence = json.loads((repo / "evidence" / "static" / "releases.json").read_text())
    assert evidence["releases"][-2:] == [LAST, NEW]
    new = evidence["results"][NEW]
    assert (new["ok"], new["adapter"], new["other_matches"]) == (True, NEW_MOD, [])
    # the older adapter is told apart by the symbol the new one marks new - derived, not written in it
    assert new["distinguished_by"][LAST_MOD] == [NEW_SYMBOL.path]
    assert evidence["results"]["0.32.0"] == json.loads((REPO / "evidence/static/releases.json").read_text())[
        "results"]["0.32.0"]  # other releases kept as they were

    # 3. the generated files follow from the evidence
    _run(tmp_path, ["-m", "speccompat.matrix", "--write"], cwd=repo)
    rows = [json.loads(line.strip()[2:]) for line in (repo / "compat_matrix.yaml").read_text().splitlines()
            if line.strip().startswith("- {")]
    cells = {(r["speculators"], r["vllm"]): r for r in rows}
    for spec in evidence["speculators"]:
        assert cells[(spec, NEW)]["adapter"] == NEW_MOD and cells[(spec, NEW)]["status"] == "static"
    assert f"| {NEW} | {NEW_MOD} | static | static | static |" in (repo / "README.md").read_text()

    # the registry, from an installation of this tree
    code = textwrap.dedent("""
        import json
        from packaging.version import Version
        from speccompat import registry
        print(json.dumps([registry.by_version(Version("NEW")).name(), registry.by_version(Version("LAST")).name(),
                          registry.fingerprint(registry.by_name("LAST_MOD"))[PATH].absent,
                          PATH in registry.by_name("LAST_MOD").requires]))
    """).replace("PATH", repr(NEW_SYMBOL.path)).replace("LAST_MOD", LAST_MOD).replace("NEW", NEW).replace("LAST", LAST)
    got = json.loads(_run(tmp_path, ["-c", code], cwd=tmp_path).stdout.splitlines()[-1])
    assert got == [NEW_MOD, LAST_MOD, True, False]  # derived absence; the older adapter itself unchanged

    # doctor on an installation of the new release
    installed = tmp_path / "installed"
    _fake_release(installed, NEW)
    write_fake_speculators(installed, "0.4.0.1")
    proc = _run(tmp_path, ["-c", f"import sys; sys.prefix = {str(tmp_path)!r}; from speccompat.cli import main; "
                           "sys.exit(main(['doctor', '--json', '--import']))"], path=[installed], cwd=tmp_path)
    report = json.loads(proc.stdout)
    assert proc.returncode == 3 and report["verdict"].startswith("static only")
    assert report["status"]["adapter"] == NEW_MOD and report["status"]["state"] == "active"
    assert report["fingerprints"][NEW_MOD] == [] and report["fingerprints"][LAST_MOD]
    # the default, static check reads the same from the installed sources, importing neither
    proc = _run(tmp_path, ["-c", f"import sys; sys.prefix = {str(tmp_path)!r}; from speccompat.cli import main; "
                           "sys.exit(main(['doctor', '--json']))"], path=[installed], cwd=tmp_path)
    static = json.loads(proc.stdout)
    assert proc.returncode == 3 and static["probe"] == "static" and static["status"]["state"] == "armed"
    assert static["fingerprints"] == report["fingerprints"] and static["adapter_probed"] == NEW_MOD

    # the nox sessions
    code = "import runpy, json, nox; runpy.run_path('noxfile.py'); print(json.dumps(nox.SESSIONS))"
    sessions = json.loads(_run(tmp_path, ["-c", code], cwd=repo).stdout.splitlines()[-1])
    assert {f"static({NEW}, speculators {s})" for s in evidence["speculators"]} <= set(sessions)

    # nothing else changed: only the new module, its evidence and the files generated from it
    after = {p.relative_to(repo): p.read_bytes() for p in repo.rglob("*") if p.is_file()
             and "evidence/cpu" not in str(p) and "evidence/gpu" not in str(p) and "__pycache__" not in str(p)}
    assert (repo / "speccompat" / "compat_matrix.yaml").resolve() == (repo / "compat_matrix.yaml").resolve()
    changed = {str(p) for p in after.keys() | before.keys() if before.get(p) != after.get(p)}
    changed.discard("speccompat/compat_matrix.yaml")  # the packaged copy is the root file (a link)
    # a new adapter is new capture code: its record changes, and the runs of older code are stale
    assert changed == {f"adapters/{NEW_MOD}.py", "evidence/static/releases.json", "compat_matrix.yaml", "README.md",
                       "evidence/hot_path.json"}
    assert filecmp.cmp(repo / "noxfile.py", REPO / "noxfile.py", shallow=False)
