"""``speccompat doctor`` tells the truth with and without vLLM installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.engine_env import ENGINE_ENV
from support.fakes import release_facts, write_fake_speculators, write_fake_vllm

#: doctor looks for a scripts/mkenv.py environment description in sys.prefix; point it elsewhere.
NO_ENV = "import sys; sys.prefix = {prefix!r}; "


def test_doctor_without_vllm_says_so_and_fails(tmp_path, py):
    write_fake_speculators(tmp_path, "0.4.0.1")
    proc = py("import sys; from speccompat.cli import main; sys.exit(main(['doctor']))", path=[tmp_path], check=False)
    assert proc.returncode == 1
    assert "vLLM        not installed" in proc.stdout
    assert "vLLM is not installed" in proc.stdout
    assert "worker plugin (vllm.general_plugins): registered -> speccompat.plugin:register" in proc.stdout
    assert "verdict: NOT supported" in proc.stdout


def test_doctor_and_version_print_the_version(tmp_path, py):
    """The version a bug report needs: doctor's first line and JSON, and ``--version`` alone; the
    value is the package's ``__version__`` (the one the package metadata is built from), and it has
    a section in CHANGELOG.md."""
    import re
    from pathlib import Path

    import speccompat

    version = speccompat.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    write_fake_speculators(tmp_path, "0.4.0.1")
    proc = py("import sys; from speccompat.cli import main; sys.exit(main(['doctor']))", path=[tmp_path], check=False)
    assert proc.stdout.splitlines()[0].startswith(f"speccompat {version}  (python "), proc.stdout
    proc = py(NO_ENV.format(prefix=str(tmp_path)) + "from speccompat.cli import main; sys.exit(main(['doctor', '--json']))",
              path=[tmp_path], check=False)
    assert json.loads(proc.stdout)["speccompat"] == version
    proc = py("import sys; from speccompat.cli import main; sys.exit(main(['--version']))", check=False)
    assert (proc.returncode, proc.stdout) == (0, f"speccompat {version}\n")
    changelog = (Path(__file__).resolve().parent.parent / "CHANGELOG.md").read_text()
    assert f"## [{version}] - " in changelog


@pytest.mark.parametrize(("cpuinfo", "expected"), [
    ("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n", False),
    ("flags\t\t: avx2 avx512f avx512bw avx512vl\n", False),  # AVX-512 without its bf16 extension
    ("flags\t\t: avx2 avx512f avx512_bf16 amx_tile\n", True),
    ("flags\t\t: avx2 amx_bf16 amx_tile\n", True),
    ("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n", True),  # Arm
    ("processor\t: 0\nFeatures\t: fp asimd\n", False),
    ("model name\t: something without flags\n", None),
])
def test_cpu_bf16_is_read_from_the_cpu_flags(cpuinfo, expected):
    from speccompat.cli import cpu_has_bf16

    assert cpu_has_bf16(cpuinfo) is expected


def test_doctor_says_when_a_cpu_has_no_bf16_instructions(tmp_path, py):
    """This machine's own flags decide the line (the doctor reads /proc/cpuinfo)."""
    from speccompat.cli import cpu_has_bf16

    write_fake_speculators(tmp_path, "0.4.0.1")
    proc = py("import sys; from speccompat.cli import main; sys.exit(main(['doctor']))", path=[tmp_path], check=False)
    here = cpu_has_bf16()
    assert ("this CPU has no bfloat16 instructions" in proc.stdout) is (here is False), proc.stdout
    proc = py(NO_ENV.format(prefix=str(tmp_path)) + "from speccompat.cli import main; sys.exit(main(['doctor', '--json']))",
              path=[tmp_path], check=False)
    platform = json.loads(proc.stdout)["platform"]
    assert platform.get("device") == "cuda" or platform["cpu_bf16"] is here


def test_doctor_json_without_anything(tmp_path, py):
    proc = py(NO_ENV.format(prefix=str(tmp_path)) + "from speccompat.cli import main; sys.exit(main(['doctor', '--json']))",
              path=[tmp_path], check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["supported"] is False
    assert report["packages"]["vllm"] is None and report["status"]["state"] == "unsupported"
    assert report["status"]["warnings"] == ["speculators is not installed; speccompat applied nothing"]


@pytest.mark.engine
def test_doctor_on_a_real_vllm_is_supported_and_lists_patches():
    env = {**os.environ, "PYTHONPATH": ENGINE_ENV["speculators"]["0.4.0.1"]}
    proc = subprocess.run([sys.executable, "-m", "speccompat", "doctor", "--json", "--import"], capture_output=True,
                          text=True, env=env, timeout=600)
    report = json.loads(proc.stdout)
    st = report["status"]
    assert proc.returncode == proven(report), proc.stdout + proc.stderr
    assert st["state"] == "active" and st["probe"] == "matched"
    assert st["vllm"]["raw"] == ENGINE_ENV["vllm"] and st["speculators"]["raw"] == "0.4.0.1"
    assert st["matrix_row"]["vllm"] == ENGINE_ENV["vllm"]
    states = {p["id"]: p["state"] for p in st["patches"]}
    assert states["generator.generate"] == "applied" and states["worker._speccompat_info"] == "applied"
    assert report["fingerprints"][st["adapter"]] == []
    assert sum(1 for mm in report["fingerprints"].values() if not mm) == 1, "fingerprint not unique"
    assert report["plugin"]["registered"] is True


def proven(report) -> int:
    """doctor's exit code for a cell run end to end: 0 when that run is of this capture code, 3 when
    the capture code changed since (a stale cell, until the cell is re-run); the verdict says which."""
    status = report["status"]["matrix_row"]["status"]
    assert status in ("supported", "stale") and report["verdict"].startswith(status), report["verdict"]
    return 0 if status == "supported" else 3


def _doctor(py, path, *args, prefix, env=None):
    code = NO_ENV.format(prefix=str(prefix)) + (
        f"from speccompat.cli import main; sys.exit(main(['doctor', '--json', *{list(args)!r}]))")
    proc = py(code, path=path, check=False, env=env)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize("args", [[], ["--no-import"], ["--import"]])
def test_doctor_verdict_rests_on_the_probe_and_a_drifted_vllm_fails(tmp_path, py, args):
    good, bad = tmp_path / "good", tmp_path / "bad"
    for root, drop in ((good, ()), (bad, ("vllm.v1.request:Request",))):
        root.mkdir()
        write_fake_vllm(root, [s for s in release_facts("0.32.0") if s.path not in drop], version="0.32.0")
        write_fake_speculators(root, "0.4.0.1")
    no_import = args != ["--import"]  # the static check is the default
    code, report = _doctor(py, [good], *args, prefix=tmp_path)
    assert code == proven(report) and report["adapter_probed"] == "vllm_0_29_0"
    assert ("note" in report) == no_import and report["probe"] == ("static" if no_import else "live")
    assert report["fingerprints"]["vllm_0_29_0"] == [] and len(report["fingerprints"]) == len(report["adapters"])
    code, report = _doctor(py, [bad], *args, prefix=tmp_path)
    assert code == 1 and report["supported"] is False
    if no_import:  # speculators not imported: only the fingerprint probe can tell, and it does
        assert "drifted from adapter vllm_0_29_0: vllm.v1.request:Request: not found" in report["verdict"]
        assert report["status"]["state"] == "armed"
    else:
        assert "DriftError" in report["verdict"] and "vllm.v1.request:Request" in report["verdict"]


def test_doctor_uses_the_speculators_of_a_mkenv_environment(tmp_path, py):
    write_fake_vllm(tmp_path, release_facts("0.32.0"), version="0.32.0")
    folders = {}
    for v in ("0.4.0", "0.4.0.1"):
        folders[v] = str(tmp_path / f"speculators-{v}")
        os.makedirs(folders[v])
        write_fake_speculators(tmp_path / f"speculators-{v}", v)
    prefix = tmp_path / "env"
    prefix.mkdir()
    (prefix / "speccompat-env.json").write_text(json.dumps({"vllm": "0.32.0", "speculators": folders}))
    code, report = _doctor(py, [tmp_path], prefix=prefix)
    assert code == proven(report), report["verdict"]
    assert report["speculators_from_environment"] == "0.4.0.1" and report["status"]["speculators"]["raw"] == "0.4.0.1"
    code, report = _doctor(py, [tmp_path], "--speculators", "0.4.0", prefix=prefix)
    assert report["speculators_from_environment"] == "0.4.0" and report["status"]["speculators"]["raw"] == "0.4.0"
    proc = py(NO_ENV.format(prefix=str(prefix)) + "from speccompat.cli import main; main(['doctor', '--speculators', '0.9'])",
              path=[tmp_path], check=False)
    assert proc.returncode != 0 and "speculators 0.9 is not in this environment (have ['0.4.0', '0.4.0.1'])" in proc.stderr
    # the environment's default (its .pth file puts the newest folder on the path) or a folder that
    # PYTHONPATH names: the report names the environment's version it is imported from
    code, report = _doctor(py, [tmp_path / "speculators-0.4.0", tmp_path], prefix=prefix)
    assert report["speculators_from_environment"] == "0.4.0" and report["status"]["speculators"]["raw"] == "0.4.0"
    code, report = _doctor(py, [tmp_path / "speculators-0.4.0.1", tmp_path], prefix=prefix)
    assert report["speculators_from_environment"] == "0.4.0.1"
    # speculators importable otherwise: the environment's folders are not consulted
    write_fake_speculators(tmp_path, "0.4.0")
    code, report = _doctor(py, [tmp_path], prefix=prefix)
    assert report["speculators_from_environment"] is None and report["status"]["speculators"]["raw"] == "0.4.0"


@pytest.mark.engine
def test_doctor_in_a_mkenv_environment_needs_no_pythonpath():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "speccompat", "doctor", "--json", "--import"], capture_output=True,
                          text=True, env=env, timeout=600)
    report = json.loads(proc.stdout)
    assert proc.returncode == proven(report), proc.stdout[-2000:] + proc.stderr[-2000:]
    newest = max(ENGINE_ENV["speculators"], key=lambda v: tuple(map(int, v.split("."))))
    assert report["speculators_from_environment"] == newest
    assert report["status"]["state"] == "active" and report["status"]["speculators"]["raw"] == newest


def test_the_default_doctor_imports_neither_vllm_nor_speculators(tmp_path, py):
    write_fake_vllm(tmp_path, release_facts("0.32.0"), version="0.32.0")
    write_fake_speculators(tmp_path, "0.4.0.1")
    code = (NO_ENV.format(prefix=str(tmp_path)) + "from speccompat.cli import main; c = main(['doctor', '--json']); "
            "print('imported:', sorted(m for m in ('vllm', 'speculators') if m in sys.modules), file=sys.stderr); "
            "sys.exit(c)")
    proc = py(code, path=[tmp_path], check=False)
    assert "imported: []" in proc.stderr
    report = json.loads(proc.stdout)
    assert proc.returncode == proven(report) and report["vllm_sources"] == str(tmp_path)
    proc = py(code.replace("'--json'", "'--json', '--import'"), path=[tmp_path], check=False)
    assert "imported: ['speculators', 'vllm']" in proc.stderr


def test_doctor_prints_the_release_s_adapter_and_the_others_under_verbose(tmp_path, py):
    write_fake_vllm(tmp_path, release_facts("0.32.0"), version="0.32.0")
    write_fake_speculators(tmp_path, "0.4.0.1")
    run = NO_ENV.format(prefix=str(tmp_path)) + "from speccompat.cli import main; sys.exit(main(['doctor'{}]))"
    text = py(run.format(""), path=[tmp_path], check=False).stdout
    code, report = _doctor(py, [tmp_path], prefix=tmp_path)
    others = [name for name in report["fingerprints"] if name != "vllm_0_29_0"]
    assert len(others) >= 5 and all(report["fingerprints"][name] for name in others)  # they do not match 0.32.0
    assert "  vllm_0_29_0  matches" in text
    assert [name for name in others if f"  {name} " in text] == []
    verbose = py(run.format(", '--verbose'"), path=[tmp_path], check=False).stdout
    assert "  vllm_0_29_0  matches" in verbose
    assert [name for name in others if f"  {name:<12} {len(report['fingerprints'][name])} mismatch(es):" not in verbose] == []


def test_doctor_shows_the_stale_marks_of_the_matrix_row(tmp_path, py):
    write_fake_vllm(tmp_path, release_facts("0.32.0"), version="0.32.0")
    write_fake_speculators(tmp_path, "0.4.0.1")
    code, report = _doctor(py, [tmp_path], prefix=tmp_path)
    evidence = report["status"]["matrix_row"]["evidence"]
    text = py(NO_ENV.format(prefix=str(tmp_path)) + "from speccompat.cli import main; sys.exit(main(['doctor']))",
              path=[tmp_path], check=False).stdout
    row = next(line for line in text.splitlines() if line.startswith("  matrix row"))
    items = row.split("[", 1)[1].rstrip("]").split(", ")
    assert items == [f"{e['kind']} {e['date']}" + (" stale" if e.get("stale") == "true" else "") for e in evidence]
    assert (report["status"]["matrix_row"]["status"] == "stale") == all(i.endswith(" stale") for i in items
                                                                       if "e2e" in i)


def test_doctor_s_exit_codes_are_the_documented_ones():
    from speccompat import cli

    assert (cli.EXIT_SUPPORTED, cli.EXIT_NOT_SUPPORTED, cli.EXIT_USAGE, cli.EXIT_UNVERIFIED) == (0, 1, 2, 3)
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    line = " ".join(readme.split("**In a training repository's CI**", 1)[1].split("\n\n", 1)[0].split())
    for said in ("exits 0 when the installed combination is supported", "1 when it is not",
                 "3 when it matches an adapter but no end-to-end run of this capture code is on record"):
        assert said in line, line


def test_doctor_bad_usage_is_exit_2(py):
    proc = py("import sys; from speccompat.cli import main; sys.exit(main(['doctor', '--import', '--no-import']))",
              check=False)
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


@pytest.mark.parametrize("damage, says", [("missing", "is missing"), ("empty", "is empty"),
                                          ("truncated", "is truncated")])
def test_doctor_names_a_damaged_packaged_matrix_in_one_line(tmp_path, py, damage, says):
    whole = (Path(__file__).resolve().parent.parent / "compat_matrix.yaml").read_text()
    path = tmp_path / "compat_matrix.yaml"
    if damage != "missing":
        path.write_text("" if damage == "empty" else whole[: len(whole) // 3])
    run = ("import sys; import speccompat.matrix as m; m.packaged_path = lambda: {path!r}; "
           "from speccompat.cli import main; sys.exit(main(['doctor'{json}]))")
    proc = py(run.format(path=str(path), json=""), check=False)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"speccompat doctor: {path} {says}"), proc.stderr
    assert lines[0].endswith(": reinstall speccompat")
    proc = py(run.format(path=str(path), json=", '--json'"), check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["supported"] is False and says in report["matrix_error"]
