"""The command line refuses bad values when it parses them (exit 2, one line naming the option), before
any engine starts: numbers, paths, ``SPECCOMPAT_DISABLE``; and its help says what each option does."""

from __future__ import annotations

import argparse
import importlib.util
import math
import types

import pytest
from support.dataset_fakes import jsonl, model_dir, random_records

from speccompat import cli
from speccompat.dataset import export
from speccompat.dataset import extract as ex


def refused(capsys, argv, parse=ex.parse_args) -> str:
    """``parse(argv)`` exits 2; what it printed on stderr."""
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def args(tmp_path, *flags):
    return ["--model-path", str(tmp_path), "--prepared-data", "d.jsonl", "--output-dir", "o", *flags]


def test_extract_help_gives_each_option_a_meaning_and_no_switch_a_true_default(capsys):
    with pytest.raises(SystemExit):
        ex.parse_args(["--help"], prog="speccompat extract")
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: True)" not in text and "(default: False)" not in text
    assert "--no-progress no progress bar" in text
    assert "--log-level {DEBUG,INFO,WARNING,ERROR} the least severe log lines shown (on stderr) (default: INFO)" in text
    assert "--max-in-flight-gb MAX_IN_FLIGHT_GB memory for states in flight" in text


def test_demo_help_names_each_option(capsys):
    with pytest.raises(SystemExit):
        cli._main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--model {llama,deepseek_v3} the tiny", "--workdir WORKDIR folder for", "--sequences SEQUENCES random",
                   "--speculators SPECULATORS speculators version"):
        assert option in text, text


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "1e400", "x"])
def test_max_in_flight_gb_must_be_finite_and_positive(tmp_path, capsys, value):
    err = refused(capsys, args(tmp_path, "--max-in-flight-gb", value))
    last = err.strip().splitlines()[-1]  # after the usage, the one line naming the option
    assert "error: argument --max-in-flight-gb: " in last, err
    assert any(w in last for w in ("not a number", "finite", "expected one argument")), err
    assert ex.parse_args(args(tmp_path, "--max-in-flight-gb", "0.5")).max_in_flight_gb == 0.5


@pytest.mark.parametrize("value", ["0", "-5", "x", "1.5"])
def test_demo_sequences_must_be_a_positive_whole_number(capsys, value):
    err = refused(capsys, ["demo", "--sequences", value], parse=cli._main)
    assert "--sequences" in err


def test_an_empty_output_dir_or_workdir_is_refused(tmp_path, capsys):
    assert "--output-dir: empty" in refused(capsys, ["--model-path", str(tmp_path), "--prepared-data", "d",
                                                     "--output-dir", ""])
    assert "--output-dir: empty" in refused(capsys, ["--model-path", str(tmp_path), "--prepared-data", "d",
                                                     "--output-dir", "  "])
    assert "--workdir: empty" in refused(capsys, ["demo", "--workdir", ""], parse=cli._main)


@pytest.mark.parametrize("path", ["/no/such/model", "./missing", "~/no-such-model-here", "a/b/c"])
def test_a_missing_local_model_path_is_named(tmp_path, capsys, path):
    err = refused(capsys, ["--model-path", path, "--prepared-data", "d", "--output-dir", "o"])
    assert f"--model-path: {path} does not exist" in err and "Repo id" not in err


def test_a_hub_id_and_a_directory_are_accepted_a_file_is_not(tmp_path, capsys):
    assert ex.parse_args(["--model-path", "org/name", "--prepared-data", "d", "--output-dir", "o"]).model_path == \
        "org/name"
    assert ex.parse_args(args(tmp_path)).model_path == str(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    err = refused(capsys, ["--model-path", str(tmp_path / "config.json"), "--prepared-data", "d", "--output-dir", "o"])
    assert "is not a directory" in err


hypothesis = pytest.importorskip("hypothesis", reason="the fuzz test of the numeric options needs hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

NUMBERS = st.one_of(st.integers(-10**6, 10**6).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
                    st.sampled_from(["nan", "inf", "-inf", "1e999", "", " ", "0x10", "1_000", "+3", "٣"]),
                    st.text(max_size=6))
#: option -> what an accepted value must satisfy
NUMERIC = {
    "--max-in-flight-gb": lambda v: isinstance(v, float) and math.isfinite(v) and v > 0,
    "--gpu-memory-utilization": lambda v: isinstance(v, float) and 0 < v <= 1,
    "--max-seq-len": lambda v: isinstance(v, int) and v >= 1,
    "--tp-size": lambda v: isinstance(v, int) and v >= 1,
    "--limit": lambda v: isinstance(v, int) and v >= 1,
    "--writer-threads": lambda v: isinstance(v, int) and v >= 1,
    "--data-parallel-size": lambda v: isinstance(v, int) and v >= 1,
    "--engines-per-gpu": lambda v: isinstance(v, int) and v >= 1,
    "--num-shards": lambda v: v == "auto" or isinstance(v, int) and v >= 1,
}


@settings(max_examples=60, deadline=None)
@given(option=st.sampled_from(sorted(NUMERIC)), text=NUMBERS)
def test_numeric_options_parse_to_a_valid_value_or_exit_2(tmp_path_factory, option, text):
    """Whatever the text, parsing gives a value the run can use, or exits 2 naming the option."""
    import contextlib
    import io

    root = tmp_path_factory.getbasetemp()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = ex.parse_args(["--model-path", str(root), "--prepared-data", "d", "--output-dir", "o",
                                    f"{option}={text}"])
    except SystemExit as e:
        assert e.code == 2 and option in err.getvalue(), (option, text, err.getvalue())
        return
    value = getattr(parsed, option[2:].replace("-", "_"))
    assert NUMERIC[option](value), (option, text, value)


def test_a_misspelt_speccompat_disable_is_one_line_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SPECCOMPAT_DISABLE", "generator.genrate")
    monkeypatch.delenv("SPECCOMPAT_DEBUG", raising=False)
    assert cli.main(["doctor", "--no-import"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speccompat: SPECCOMPAT_DISABLE names 'generator.genrate', which is no patch id")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # the same from extract, whose settings are checked first
    model = model_dir(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", random_records(2))
    monkeypatch.setattr(ex, "start_generator", lambda *a: pytest.fail("the engine must not start"))
    assert cli.main(["extract", "--model-path", str(model), "--prepared-data", str(data), "--output-dir",
                     str(tmp_path / "o"), "--layer-ids", "1", "2", "4", "5"]) == 2
    assert "'generator.genrate', which is no patch id" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_missing_import_of_the_engine_is_one_line_exit_1(tmp_path, monkeypatch, caplog):
    """Without transformers (or another module speculators' generator or vLLM imports) the engine
    cannot start: one line naming the module, no traceback, exit 1."""
    pytest.importorskip("torch", reason="the data set is opened (its writer needs torch) before the engine starts")
    import speccompat

    model = model_dir(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", random_records(2))
    status = types.SimpleNamespace(state="armed", warnings=[], errors=[], speculators={"raw": "0.4.0.1"},
                                   as_dict=lambda: {"state": "armed", "vllm": {"raw": "0.32.0"}})
    monkeypatch.setattr(speccompat, "apply", lambda **kw: status)
    monkeypatch.setattr(ex, "use_spawn", lambda: None)

    def start(*a):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(ex, "start_generator", start)
    code = ex.main(["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(tmp_path / "o"),
                    "--layer-ids", "1", "2", "4", "5", "--no-progress"])
    assert code == 1
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in errors] == ["the engine did not start (nothing was written): ModuleNotFoundError: "
                                                "No module named 'transformers'; install it into this environment"]
    assert errors[0].exc_info is None


@pytest.mark.parametrize("to", ["speculators", "speculators-0.4"])
def test_export_to_speculators_without_speculators_is_refused_before_converting(tmp_path, capsys, monkeypatch, to):
    """The 0.3/0.4 layout is ``--to speculators`` (its name in ``extract --layout``); the old name
    ``speculators-0.4`` still works, with one deprecation line."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "speculators" else real(name, *a))
    monkeypatch.setattr(export, "export_dataset", lambda *a, **kw: pytest.fail("nothing may be converted"))
    out = tmp_path / "pt"
    assert cli.main(["export", str(tmp_path), "--to", to, str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    if to != "speculators":
        assert err.pop(0) == "speccompat: --to speculators-0.4 is deprecated, use --to speculators"
    assert err == [f"export {tmp_path}: --to speculators needs speculators 0.3 or 0.4 installed (its "
                   "data_config.json is written by speculators' own code), and it is not; nothing was exported"]
    assert not out.exists()


def test_extract_takes_the_old_format_flag_with_one_deprecation_line(capsys):
    from speccompat.dataset import extract as ex

    base = ["--model-path", "m", "--prepared-data", "d.jsonl", "--output-dir", "o"]
    assert ex.parse_args([*base, "--layout", "speculators"]).layout == "speculators"
    assert capsys.readouterr().err == ""
    assert ex.parse_args([*base, "--format", "speculators-arrow"]).layout == "speculators-arrow"
    assert capsys.readouterr().err == "speccompat: --format is deprecated, use --layout\n"
    ap = argparse.ArgumentParser()
    ex.add_arguments(ap)
    assert "--format" not in ap.format_help() and "--layout" in ap.format_help()
