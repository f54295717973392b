"""The CI workflow is valid YAML and calls only commands that exist in this repository."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def test_workflow_is_valid_and_references_existing_scripts():
    wf = yaml.safe_load((REPO / ".github" / "workflows" / "ci.yml").read_text())
    assert {"unit", "static", "cpu-e2e", "nightly-canary"} <= set(wf["jobs"])
    assert wf["jobs"]["nightly-canary"]["continue-on-error"] is True
    runs = [step["run"] for job in wf["jobs"].values() for step in job["steps"] if "run" in step]
    paths = {m for run in runs for m in re.findall(r"(?:scripts|tests)/[\w./-]+\.py", run)}
    assert paths, "the workflow calls no repository script"
    for p in paths:
        assert (REPO / p).exists(), f"workflow calls {p}, which does not exist"
    assert any("python -m speccompat.matrix" in r for r in runs)
    assert any("speccompat doctor --json" in r for r in runs)


def test_ci_entry_point_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    assert "scripts/test" in readme
    assert "scripts/test" in (REPO / ".ci" / "run").read_text()
