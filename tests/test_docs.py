"""docs/patches.md is generated from the patches and adapters and kept current; docs/architecture.md's
picture is the layer declaration and its table names every module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_patch_docs_are_current():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_docs.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_patch_and_change_names_its_upstream(monkeypatch):
    import importlib.util

    from speccompat.adapter import upstream_problem
    from speccompat.patches import GROUPS
    from speccompat.registry import all_adapters

    records = [p.upstream for g in GROUPS.values() for p in g]
    records += [c.upstream for a in all_adapters() for c in vars(a).get("changes", ())]
    assert len(records) >= 18 + 20 and all(upstream_problem(u) is None for u in records)
    assert upstream_problem("") and upstream_problem("none") and upstream_problem("see PR 12")
    # The docs check refuses a record without one, naming it.
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    gen_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_docs)
    first = next(iter(GROUPS.values()))
    monkeypatch.setitem(GROUPS, next(iter(GROUPS)), [first[0]._replace(upstream=""), *first[1:]])
    assert gen_docs.missing_upstream() == [f"patch {first[0].id}: upstream '' is neither a GitHub PR/issue URL "
                                           "nor 'none: <why>'"]


# ------------------------------------------------------------------ the commands the docs show


def _doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").rglob("*.md"))]


def _command_lines(text: str) -> list[tuple[str, bool]]:
    """Each shell line of the text, and whether it is in a code block: the lines of its code blocks
    (not python ones; continuations joined) and its inline code spans."""
    import re

    lines = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang not in ("python", "json", "yaml", "toml"):
            lines += [(ln, True) for ln in block.replace("\\\n", " ").splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return lines + [(ln, False) for ln in re.findall(r"`([^`\n]+)`", prose)]


_SEPARATORS = {"|", "||", "&&", ";", ">", ">>", "2>", "&", "2>&1", "<"}


def _words(line: str) -> list[list[str]]:
    """The simple commands of a line, as words (comments dropped; quotes kept as the shell reads them)."""
    import shlex

    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an output line with an apostrophe: read it as words
        words = line.split()
    out, cur = [], []
    for w in words:
        if w in _SEPARATORS:
            out.append(cur)
            cur = []
        else:
            cur.append(w)
    return [c for c in out + [cur] if c]


def _flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]


def _cli_help(sub: str | None) -> str:
    import contextlib
    import io

    from speccompat.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([*([sub] if sub else []), "--help"])
        except SystemExit:
            pass
    return buf.getvalue()


def _nox_sessions() -> set[str]:
    import re

    src = (REPO / "noxfile.py").read_text()
    named = set(re.findall(r'@nox\.session\([^)]*name="([\w-]+)"', src))
    plain = set(re.findall(r"@nox\.session(?:\([^)]*\))?\n(?:@[^\n]*\n)*def (\w+)\(", src))
    return named | plain


def command_problems(text: str) -> list[str]:
    """What in ``text`` names a command, subcommand, session, script or flag that does not exist:
    ``speccompat SUB --flags`` (against the command line's own parsers), ``python -m speccompat...``,
    ``python PATH.py --flags`` and ``PATH.py`` of this repository (the flags must be in the script),
    ``scripts/gpu/device_run.sh MODE`` and ``nox -s SESSION``."""
    import re

    problems = []
    subcommands = set(re.search(r"^  \{([\w,-]+)\}$", _cli_help(None), re.M)[1].split(","))
    for line, block in _command_lines(text):
        for words in _words(line):
            while words and re.match(r"^[A-Z][A-Z0-9_]*=", words[0]):  # VAR=value before the command
                words = words[1:]
            if not words:
                continue
            head, rest = words[0], words[1:]
            pythonish = re.search(r"(^|/)python3?$", head) or head in ("$PY", "${PY}")
            if head == "speccompat" or head.endswith("/bin/speccompat") or (pythonish and rest[:2] == ["-m", "speccompat"]):
                if pythonish:
                    rest = rest[2:]
                sub = rest[0] if rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]) else None
                if rest and not rest[0].startswith("-") and sub is None:
                    continue  # not a command (an output line such as "speccompat 0.1.0: armed")
                if sub and sub not in subcommands:
                    problems.append(f"{line!r}: speccompat has no subcommand {sub!r}")
                    continue
                known = _cli_help(sub)
                problems += [f"{line!r}: `speccompat {sub or ''}` has no {f}" for f in _flags(rest)
                             if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", known)]
                continue
            if pythonish and rest[:1] == ["-m"] and len(rest) > 1 and rest[1].startswith("speccompat."):
                path = REPO / (rest[1].replace(".", "/") + ".py")
                script, args = path, rest[2:]
            elif pythonish and rest and "/" in rest[0] and rest[0].endswith(".py"):
                script, args = REPO / rest[0], rest[1:]
            elif block and re.match(r"^(scripts|benchmarks|examples)/[\w./-]+$", head):  # a path run as a command
                script, args = REPO / head, rest
            elif head == "nox" and "-s" in rest:
                session = rest[rest.index("-s") + 1].split("(")[0]
                if session not in _nox_sessions():
                    problems.append(f"{line!r}: no nox session {session!r}")
                continue
            else:
                continue
            if not script.is_file():
                problems.append(f"{line!r}: {script.relative_to(REPO)} does not exist")
                continue
            src = script.read_text()
            for entry in re.findall(r"^    from (speccompat\.[\w.]+) import main$", src, re.M):  # a __main__ that hands over
                src += (REPO / (entry.replace(".", "/") + ".py")).read_text()
            if "from speccompat.dataset.extract import main" in src or ("runpy" in src and "extract_hidden_states" in src):
                # an example driver: `speccompat extract` under another name
                src = _cli_help("extract")
            if script.name == "device_run.sh" and args and not args[0].startswith("-"):
                if not re.search(rf"^  {re.escape(args[0])}\)", src, re.M):
                    problems.append(f"{line!r}: device_run.sh has no mode {args[0]!r}")
            problems += [f"{line!r}: {script.relative_to(REPO)} takes no {f}" for f in _flags(args)
                         if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", src)]
    return problems


def test_every_command_the_docs_show_exists_with_its_flags():
    problems = [f"{p.relative_to(REPO)}: {x}" for p in _doc_files() for x in command_problems(p.read_text())]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("text", "expected"), [
    ("`speccompat extract --model-path m --no-such-flag`", "`speccompat extract` has no --no-such-flag"),
    ("```bash\nspeccompat frobnicate DIR\n```", "speccompat has no subcommand 'frobnicate'"),
    ("```bash\nspeccompat verify DIR --threads 4 --fast\n```", "`speccompat verify` has no --fast"),
    ("```bash\nPYTHONPATH=x .envs/v/bin/python benchmarks/throughput.py --sequences 8 --turbo\n```",
     "benchmarks/throughput.py takes no --turbo"),
    ("`python benchmarks/nowhere.py`", "benchmarks/nowhere.py does not exist"),
    ("`python -m speccompat.matrix --write --everything`", "speccompat/matrix.py takes no --everything"),
    ("`nox -s \"cpu_e2e(0.24.0)\"` and `nox -s warp`", "no nox session 'warp'"),
    ("```bash\nscripts/gpu/device_run.sh writer-disk\n```", "device_run.sh has no mode 'writer-disk'"),
    ("```bash\npython examples/kimi_k25/extract_hidden_states.py --model-path M --tp-size 8 --turbo\n```",
     "examples/kimi_k25/extract_hidden_states.py takes no --turbo"),
])
def test_a_command_or_flag_that_does_not_exist_is_named(text, expected):
    problems = command_problems(text)
    assert len(problems) == 1 and expected in problems[0], problems


def test_commands_the_docs_show_that_exist_pass():
    text = ("```bash\nspeccompat extract --model-path M --prepared-data d.jsonl --output-dir hs/ --tp-size 8\n"
            "speccompat 0.1.0: armed, adapter vllm_0_29_0\n"  # an output line, not a command
            "python scripts/static_check.py 0.33.0 --no-write\n```\n"
            "`speccompat --version`, `python -m speccompat.matrix --write`, `nox -s engine_full`")
    assert command_problems(text) == []


# --------------------------------------------------------------------- the performance page


def test_performance_page_and_readme_table_are_generated_from_the_results():
    """docs/benchmarks.md and the README's performance table are what benchmarks/report.py makes of
    the results files now: every figure there is read from a file in the tree."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "report.py"), "--check"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def _report():
    import importlib.util

    spec = importlib.util.spec_from_file_location("report", REPO / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    sys.modules["report"] = report  # its dataclass looks its module up
    spec.loader.exec_module(report)
    return report


def test_the_page_states_no_figure_of_its_own():
    """The page's own text (method, conclusions, how to re-run) carries no measured figure: every
    number on the page comes from a results file."""
    import re

    report = _report()
    for text in (report.METHOD, report.CONCLUSIONS, report.RERUN):
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        assert not re.findall(r"(?<![\w.])\d+\.\d+(?![\d.])|\d+(?:\.\d+)?\s?(?:%|x\b|GB/s|ms\b|s\b)", prose), prose


def test_every_results_file_is_read_by_the_page_or_cited_and_every_cited_one_exists():
    """Superseded results leave the tree: each file under benchmarks/results/ is a claim of the page or
    cited by a document or the code; each results file a document or the code cites exists."""
    import re

    report = _report()
    kept = {p.name for p in (REPO / "benchmarks" / "results").glob("*.json")}
    def cites(paths) -> set[str]:
        return {ref for p in paths if p.name != "test_docs.py"
                for ref in re.findall(r"results/([\w.{},-]+\.json)", p.read_text())}

    # documents, adapters, nox and tests state facts from results; the benchmark scripts' docstrings
    # also show where a new run may write (``--out benchmarks/results/NAME.json``)
    stated = cites([*_doc_files(), *(REPO / "adapters").glob("*.py"), REPO / "noxfile.py",
                    *(REPO / "tests").rglob("*.py")])
    cited = stated | cites((REPO / "benchmarks").glob("*.py"))
    read = set(report.files())
    assert read <= kept
    assert kept <= read | cited, f"not read by the page nor cited anywhere: {sorted(kept - read - cited)}"
    assert stated <= kept, f"cited but not in the tree: {sorted(stated - kept)}"


def test_the_architecture_picture_is_the_layer_declaration():
    from speccompat.testing import layering

    doc = (REPO / "docs" / "architecture.md").read_text()
    block = doc.split("<!-- layers:start -->", 1)[1].split("<!-- layers:end -->", 1)[0].strip()
    assert block == "```mermaid\n" + layering.mermaid() + "\n```", "run: python -c 'from speccompat.testing " \
        "import layering; print(layering.mermaid())' and put it between the layers markers"
    for wing, floors in layering.WINGS.items():  # every floor is a box of the picture
        assert all(f'{wing}{i}["{floor}: ' in block for i, (floor, _) in enumerate(floors)), wing


def test_the_architecture_table_names_every_module():
    from speccompat.testing import layering

    doc = (REPO / "docs" / "architecture.md").read_text()
    table = doc.split("## Modules", 1)[1]
    named = {cell.strip("`/") for row in table.splitlines() if row.startswith("| `")
             for cell in row.split("|")[1].replace(",", " ").split()}
    tops = set()
    for module in layering.import_graph(REPO):
        parts = module.split(".")
        tops.add("__init__" if len(parts) == 1 else parts[1])
    assert len(tops) > 25 and sorted(tops - named) == [] and sorted(named - tops) == []
    assert "(docs/architecture.md)" in (REPO / "README.md").read_text()
