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


def readme_block(start: str, end: str) -> str:
    text = (REPO / "README.md").read_text()
    return text[text.index(start) + len(start):text.index(end, text.index(start))]


def fenced(text: str, lang: str, containing: str) -> str:
    """The first ```lang block of ``text`` that contains ``containing``."""
    for block in re.findall(rf"```{lang}\n(.*?)```", text, re.S):
        if containing in block:
            return block
    raise AssertionError(f"README.md has no ```{lang} block with {containing!r}")


@pytest.mark.engine
def test_the_readmes_commands_run_verbatim_in_the_demos_environment(tmp_path):
    """After ``scripts/demo`` (its environment, model and sequences, made here as it makes them): the
    README's shell commands (activate, doctor, extract, verify) and its Python example, as written, in
    a shell whose PYTHONPATH names only this checkout, from the checkout's root (here a folder whose
    ``.envs`` is this one)."""
    import json
    import os

    from support.engine_env import ENGINE_ENV, ENV_FILE

    from speccompat.testing.models import make_checkpoint

    env_dir = ENV_FILE.parent
    if env_dir.parent.name != ".envs" or env_dir.name != f"vllm-{ENGINE_ENV['vllm']}":
        pytest.skip(f"the README's commands name .envs/vllm-0.32.0; this environment is {env_dir}")
    block = fenced(readme_block("<!-- readme-path:start -->", "<!-- readme-path:end -->"), "bash", "activate")
    block = block.replace("vllm-0.32.0", env_dir.name)
    (tmp_path / ".envs").symlink_to(env_dir.parent)
    demo = tmp_path / ".speccompat-demo"
    make_checkpoint("llama", demo / "llama")
    samples = [[11, 12, 13, 14, 15], list(range(20, 60)), list(range(100, 400))]
    (demo / "prepared.jsonl").write_text("".join(json.dumps({"id": f"demo-{i}", "input_ids": s}) + "\n"
                                                 for i, s in enumerate(samples)))
    shell = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SPECCOMPAT_", "VIRTUAL_ENV"))}
    shell["PATH"] = "/usr/bin:/bin"
    # the environment's editable install may be of another checkout: this one's speccompat, nothing else
    # (speculators comes from the environment's own default, as in the user's shell)
    shell["PYTHONPATH"] = str(REPO)
    # each command's exit status (doctor's 3, "works but not run end to end", is one the README names)
    script = ["set -u"]
    for line in filter(str.strip, block.splitlines()):
        script.append(line)
        if not line.rstrip().endswith("\\") and not line.startswith("source "):
            script.append('echo "rc=$?"')
    script = "\n".join(script) + "\n"
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=shell, capture_output=True, text=True,
                          timeout=1200)
    out = proc.stdout
    codes = re.findall(r"^rc=(\d+)$", out, re.M)
    assert len(codes) == 3, out + proc.stderr[-3000:]
    doctor, extract, verify = map(int, codes)
    assert doctor in (0, 3), out
    assert "verdict: " in out and "speculators 0.4.0.1 of this environment" in out, out
    assert extract == 0, out + proc.stderr[-3000:]
    assert "layers stored: 0 2 4 5 of 6" in out and "speculators >= 0.5: train with --target-layer-ids" in out, out
    assert not re.search(r"\bINFO\b", out) and re.search(r"\bINFO\b", proc.stderr), out  # the logs on stderr
    assert verify == 0, out + proc.stderr[-3000:]
    assert len(list((demo / "hs").glob("*.safetensors"))) == len(samples)
    # the Python example, as written, run as the README says
    (tmp_path / "extract.py").write_text(fenced((REPO / "README.md").read_text(), "python", "def main(model_path"))
    proc = subprocess.run(["bash", "-c", f"source .envs/{env_dir.name}/bin/activate && python extract.py "
                           ".speccompat-demo/llama"], cwd=tmp_path, env=shell, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if re.match(r"^\d+ \[", ln)]
    assert lines == ["5 [(5, 256), (5, 256), (5, 256), (5, 256)]", "3 [(3, 256), (3, 256), (3, 256), (3, 256)]"], \
        proc.stdout[-3000:]
