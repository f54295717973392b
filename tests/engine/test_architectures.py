"""Architectures beyond the release runs' Llama and DeepseekV3/Kimi-K2.5, proven on a real engine.

Each architecture is a tiny checkpoint (speccompat.testing.models) run through speculators' own
generator under speccompat and compared with transformers under the tight rule (as
test_parity.py). Each needs its own engine, so they leave the gate (marker ``engine_full``: run by
``nox -s engine_full`` or ``pytest --engine-full``). With ``SPECCOMPAT_ARCH_EVIDENCE_OUT=FILE`` the
outcomes are written there (``evidence/<platform>/architectures-vllm-<V>.json``; speccompat.matrix
reads them into the architectures table). An engine that refuses an architecture is recorded
with its error and the test fails: a refusal is evidence, never a silent skip.
"""

from __future__ import annotations

import os

import pytest
from support.engine_env import ENGINE_ENV

from speccompat.testing.parity import measure, violations

from .conftest import CODE, LAYER_IDS, mixed_sequences, reference_device

pytestmark = [pytest.mark.engine, pytest.mark.engine_full]

#: New architectures, in the order they were brought up.
ARCH_KINDS = ("qwen3", "gpt_oss", "mistral", "qwen3_moe", "gemma3", "glm4_moe", "llama4")
#: The speculators versions the architectures are proven through (first and last of the line).
ARCH_SPECULATORS = ("0.3.0", "0.4.0.1")

CELLS: list[dict] = []


def write_arch_evidence() -> None:
    """Write the architectures evidence file named by SPECCOMPAT_ARCH_EVIDENCE_OUT (after every cell)."""
    out = os.environ.get("SPECCOMPAT_ARCH_EVIDENCE_OUT")
    if not out or not CELLS or ENGINE_ENV is None:
        return
    import datetime
    import json
    import platform
    from pathlib import Path

    import torch

    doc = {"kind": "architectures", "vllm": ENGINE_ENV["vllm"], "vllm_dist": ENGINE_ENV["vllm_dist"],
           "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "date": datetime.date.today().isoformat(), "applied": True,
           "reference_device": reference_device(),
           "code": CODE,  # the capture path it ran (speccompat.matrix: a later change makes its cells stale)
           "cells": CELLS}
    # A run of some architectures keeps the other cells of an existing file for the same release.
    path = Path(out)
    if path.exists():
        old = json.loads(path.read_text())
        # (only cells of the same capture code: older ones would be shown as current)
        if (old.get("kind") == "architectures" and old.get("vllm") == doc["vllm"]
                and (old.get("code") or {}).get("hot_path_sha256") == CODE["hot_path_sha256"]):
            ours = {(c["speculators"], c["model"], c["test"]) for c in CELLS}
            doc["cells"] = [c for c in old["cells"] if (c["speculators"], c["model"], c["test"]) not in ours] + CELLS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{out}.partial")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(out)


@pytest.mark.pool
@pytest.mark.parametrize("speculators", ARCH_SPECULATORS)
@pytest.mark.parametrize("kind", ARCH_KINDS)  # by architecture: one architecture's engines in turn
def test_architecture_parity_with_transformers(engines, references, record_cell, speculators, kind):
    from speccompat.testing.client import EngineError
    from speccompat.testing.models import RECIPES

    recipe = RECIPES[kind]
    cell = {"speculators": speculators, "model": kind, "architecture": recipe.architecture, "test": "parity",
            "layer_ids": LAYER_IDS, "oracle": "transformers"}
    seqs = mixed_sequences(45, seed=7)
    try:
        out = engines.get(speculators, kind, **recipe.engine).generate(seqs)
    except EngineError as exc:
        CELLS.append({**cell, "outcome": "refused", "reason": f"{exc.type}: {exc.error}"[:400]})
        write_arch_evidence()
        record_cell(speculators=speculators, model=kind, test="parity", outcome="refused",
                    reason=CELLS[-1]["reason"])
        raise
    results = out["results"]
    assert len(results) == len(seqs)
    for res, seq in zip(results, seqs, strict=True):
        assert res["input_ids"].tolist() == seq
        assert [tuple(h.shape) for h in res["hidden_states"]] == [(len(seq), recipe.hidden_size)] * len(LAYER_IDS)
    ref32, ref16 = references(kind)
    cases = measure(results, [ref32.hidden_states(s, LAYER_IDS) for s in seqs],
                    [ref16.hidden_states(s, LAYER_IDS) for s in seqs])
    bad = violations(cases)
    worst = max(cases, key=lambda c: c.got.rel)
    CELLS.append({**cell, "sequences": len(seqs), "tokens": sum(map(len, seqs)),
                  "outcome": "failed" if bad else "passed", "worst_rel": round(worst.got.rel, 5),
                  "worst_rel_layer": LAYER_IDS[worst.layer], "worst_noise_rel": round(worst.noise.rel, 5),
                  "worst_min_cos": round(min(c.got.min_cos for c in cases), 5)})
    write_arch_evidence()
    # the same parity run is a cell of the release's end-to-end evidence (speculators x this model)
    record_cell(**{k: v for k, v in CELLS[-1].items() if k not in ("architecture", "oracle")},
                seconds=round(out["seconds"], 3), stats=out["stats"])
    assert not bad, f"{len(bad)} of {len(cases)} cases off:\n" + "\n".join(bad[:15])
    assert out["stats"]["unverified_steps"] == 0, out["stats"]
