"""The package speccompat.dataset: importing it (and the command line) imports neither torch,
safetensors nor vLLM."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_package_imports_neither_torch_nor_safetensors():
    code = ("import sys, speccompat, speccompat.dataset, speccompat.dataset.verify, speccompat.cli;"
            "from speccompat.dataset import store, writer, inputs;"
            "print([m for m in ('torch', 'safetensors', 'vllm', 'xxhash') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
