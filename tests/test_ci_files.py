"""The CI workflow, the CI entry point and the README's commands are well-formed and call what exists.

Each ``run:`` step is split into shell words: the scripts it calls exist, the pytest markers it
selects are declared, environment assignments come before the command (``VAR=x cmd``, never
``cmd VAR=x``, which hands the assignment to the command as an argument), and the README's
command lines obey the same rules.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
ASSIGNMENT = re.compile(r"^[A-Z][A-Z0-9_]*=")


def _separated(script: str) -> str:
    """``script`` with comments dropped and unquoted line ends made ``;`` (continuations joined)."""
    out, quote, i = [], None, 0
    text = script.replace("\\\n", " ")
    while i < len(text):
        ch = text[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t\n"):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif ch == "\n":
            ch = ";"
        out.append(ch)
        i += 1
    return "".join(out)


def _commands(script: str) -> list[list[str]]:
    """Shell words of each simple command in ``script`` (split at line ends, ; && || |)."""
    lex = shlex.shlex(_separated(script), posix=True, punctuation_chars=True)
    out, words = [], []
    for tok in lex:
        if tok in (";", "&&", "||", "|", "&", ";;"):
            if words:
                out.append(words)
            words = []
        else:
            words.append(tok)
    if words:
        out.append(words)
    return out


def _program(words: list[str]) -> tuple[list[str], list[str]]:
    """(leading VAR=value assignments, the command and its arguments)."""
    i = 0
    while i < len(words) and ASSIGNMENT.match(words[i]):
        i += 1
    return words[:i], words[i:]


def _workflow_commands() -> list[list[str]]:
    wf = yaml.safe_load((REPO / ".github" / "workflows" / "ci.yml").read_text())
    runs = [step["run"] for job in wf["jobs"].values() for step in job["steps"] if "run" in step]
    return [c for run in runs for c in _commands(re.sub(r"\$\{\{[^}]*\}\}", "X", run))]


def _markers(pytestconfig) -> set[str]:
    return {m.split(":", 1)[0].strip() for m in pytestconfig.getini("markers")}


def test_workflow_jobs_and_their_commands_exist():
    wf = yaml.safe_load((REPO / ".github" / "workflows" / "ci.yml").read_text())
    assert {"unit", "static", "cpu-e2e", "nightly-canary"} <= set(wf["jobs"])
    assert wf["jobs"]["nightly-canary"]["continue-on-error"] is True
    commands = _workflow_commands()
    called = {w for c in commands for w in c if re.fullmatch(r"(?:scripts|tests)/[\w./-]+\.py", w)}
    assert called, "the workflow calls no repository script"
    for p in called:
        assert (REPO / p).is_file(), f"workflow calls {p}, which does not exist"
    programs = [_program(c)[1] for c in commands]
    assert ["python", "-m", "speccompat.matrix"] in programs
    assert any(p[-3:] == ["speccompat", "doctor", "--json"] or p[1:4] == ["doctor", "--json"] or
               (p and p[0].endswith("/speccompat") and p[1:3] == ["doctor", "--json"]) for p in programs)


def test_workflow_selects_only_declared_pytest_markers(pytestconfig):
    declared = _markers(pytestconfig)
    used = set()
    for c in _workflow_commands():
        _, prog = _program(c)
        if "pytest" in prog and "-m" in prog[prog.index("pytest"):]:
            args = prog[prog.index("pytest"):]
            expr = args[args.index("-m") + 1]
            used |= set(re.findall(r"\b(?!and\b|or\b|not\b)\w+", expr))
    assert used, "no pytest -m selection in the workflow"
    assert used <= declared, f"markers {sorted(used - declared)} are not declared in pyproject.toml"


@pytest.mark.parametrize("where", ["workflow", "README"])
def test_environment_assignments_precede_the_command(where):
    if where == "workflow":
        commands = _workflow_commands()
    else:
        blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
        assert blocks
        commands = [c for b in blocks for c in _commands(b)]
    for c in commands:
        _, prog = _program(c)
        late = [w for w in prog[1:] if ASSIGNMENT.match(w)]
        assert not late, f"{where}: {' '.join(c)!r} passes {late} to {prog[0]} as arguments"


def test_ci_entry_point_runs_the_readme_test_command():
    run = REPO / ".ci" / "run"
    assert os.access(run, os.X_OK), ".ci/run is not executable"
    last = _commands(run.read_text())[-1]
    assert _program(last)[1][0] == "scripts/test", f".ci/run ends with {last}, not scripts/test"
    assert os.access(REPO / "scripts" / "test", os.X_OK)
    readme_blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert any(_program(c)[1][:1] == ["scripts/test"] for b in readme_blocks for c in _commands(b)), \
        "the README shows no scripts/test command line"
