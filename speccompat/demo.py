"""``speccompat demo``: the main job end to end on a tiny model, on whatever vLLM is installed.

Makes a tiny random-weight checkpoint, extracts its hidden states through speculators'
``VllmHiddenStatesGenerator`` under speccompat, compares them with transformers, and prints what
speccompat did. In an environment built by ``scripts/mkenv.py`` the speculators version is taken
from the environment's description (``--speculators``); otherwise the installed one is used.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

LAYER_IDS = [0, 2, 4, 5]


def _use_speculators(version: str | None) -> str | None:
    """Put the requested speculators of a mkenv environment first on the path (workers too)."""
    desc = Path(sys.prefix) / "speccompat-env.json"
    if not desc.exists():
        return None
    folders = json.loads(desc.read_text())["speculators"]
    version = version or max(folders)
    if version not in folders:
        raise SystemExit(f"speculators {version} is not in this environment (have {sorted(folders)})")
    folder = folders[version]
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
    return version


def run_demo(model: str, workdir: str, sequences: int, speculators: str | None = None) -> int:
    chosen = _use_speculators(speculators)
    import speccompat

    status = speccompat.apply()
    print(f"speccompat {speccompat.__version__}: {status.state}, adapter {status.adapter}"
          + (f" (speculators {chosen} from this environment)" if chosen else ""))
    from speculators.data_generation import VllmHiddenStatesGenerator

    from .testing.models import make_checkpoint
    from .testing.parity import measure, violations
    from .testing.reference import ReferenceModel

    path = make_checkpoint(model, Path(workdir) / model)
    print(f"tiny {model} checkpoint: {path}")
    t0 = time.time()
    gen = VllmHiddenStatesGenerator(str(path), layer_ids=LAYER_IDS, max_model_len=1024, gpu_memory_utilization=0.1)
    print(f"engine started in {time.time() - t0:.1f} s")
    rng = random.Random(0)
    seqs = [[rng.randrange(4, 512) for _ in range(rng.randrange(20, 600))] for _ in range(sequences)]
    t0 = time.time()
    results = gen.generate(seqs)
    dt = time.time() - t0
    tokens = sum(map(len, seqs))
    print(f"extracted {len(results)} sequences, {tokens} tokens, layers {LAYER_IDS} in {dt:.2f} s "
          f"({tokens / dt:,.0f} tokens/s); scheduling: {getattr(gen, '_speccompat_stats', {})}")
    print(speccompat.status())
    ref32, ref16 = ReferenceModel(str(path), "float32"), ReferenceModel(str(path), "bfloat16")
    cases = measure(results, [ref32.hidden_states(s, LAYER_IDS) for s in seqs],
                    [ref16.hidden_states(s, LAYER_IDS) for s in seqs])
    bad = violations(cases)
    worst = max(cases, key=lambda c: c.got.rel)
    print(f"parity with transformers: {len(cases) - len(bad)}/{len(cases)} (sequence, layer) cases within "
          f"bf16 noise; worst rel error {worst.got.rel:.4f} (its bf16 noise {worst.noise.rel:.4f})")
    for line in bad[:10]:
        print("  " + line)
    del gen
    return 1 if bad else 0
