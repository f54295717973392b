"""The README's path for a new user: the install line pins a commit that exists, and (``engine``) the
commands of its quick start and its Python example work verbatim in the environment the demo builds."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: every ``pip install ... git+<repository>@<ref>`` line of the docs
PIN = re.compile(r"git\+https://github\.com/speccompat/speccompat@([^\"'\s#]+)")
PINNED_DOCS = ("README.md", "CHANGELOG.md", "examples/kimi_k25/README.md")


def pins() -> list[tuple[str, str]]:
    return [(doc, ref) for doc in PINNED_DOCS for ref in PIN.findall((REPO / doc).read_text())]


def test_the_docs_pin_an_install_ref():
    found = pins()
    assert [doc for doc, _ in found].count("README.md") == 1, found
    assert {doc for doc, _ in found} == set(PINNED_DOCS), found


@pytest.mark.parametrize(("doc", "ref"), pins())
def test_the_install_pin_is_a_full_commit_of_this_repository(doc, ref):
    """The published repository has no tags (a tag made in a clone never reaches it): the pin is a
    full commit hash, and that commit is in this branch's history (so it was landed, not local)."""
    assert re.fullmatch(r"[0-9a-f]{40}", ref), f"{doc} pins {ref!r}, not a full commit hash"
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the commit cannot be looked up here")
    kind = subprocess.run(["git", "-C", str(REPO), "cat-file", "-t", ref], capture_output=True, text=True)
    assert kind.stdout.strip() == "commit", f"{doc} pins {ref}, which this repository does not have"
    ancestor = subprocess.run(["git", "-C", str(REPO), "merge-base", "--is-ancestor", ref, "HEAD"])
    assert ancestor.returncode == 0, f"{doc} pins {ref}, which is not in the history of HEAD"
