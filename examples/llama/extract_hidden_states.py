"""Llama / Qwen (any model vLLM and speculators 0.3/0.4 run): the same driver as
examples/kimi_k25/extract_hidden_states.py, which holds nothing model-specific.

    python examples/llama/extract_hidden_states.py --model-path /models/Llama-3.1-8B-Instruct \
        --prepared-data data.jsonl --output-dir hs/ --tp-size 1 --max-seq-len 4096

``--layer-ids`` defaults to speculators' choice ``[2, L//2, L-3, L-1]`` (32 layers: 2 16 29 31).
For the tokenization step use examples/kimi_k25/prepare_data.py (drop ``--trust-remote-code``).
At the end it prints the trainer flags for the data set (``speccompat.layers.describe_for_training``:
``--target-layer-ids`` for speculators >= 0.5, the draft config's ``eagle_aux_hidden_state_layer_ids``
for 0.3/0.4).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":  # vLLM's spawned workers re-import this file: nothing may run then
    sys.argv[0] = str(Path(__file__).resolve().parents[1] / "kimi_k25" / "extract_hidden_states.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
