"""``speccompat demo``: the main job end to end on a tiny model, on whatever vLLM is installed.

Makes a tiny random-weight checkpoint, extracts its hidden states through speculators'
``VllmHiddenStatesGenerator`` under speccompat, compares them with transformers, and prints what
speccompat did. In an environment built by ``scripts/mkenv.py`` the speculators version is taken
from the environment's description (``--speculators``); otherwise the installed one is used.

The terminal gets a short summary; everything vLLM, its workers and transformers print goes to
``<workdir>/demo.log`` (speccompat's own log lines too), so the summary reads at a glance.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

LAYER_IDS = [0, 2, 4, 5]


def use_speculators(version: str | None) -> str | None:
    """Put the requested speculators of a mkenv environment first on the path (workers too).

    Returns the version chosen, or ``None`` outside such an environment (the installed speculators,
    if any, is used then)."""
    desc = Path(sys.prefix) / "speccompat-env.json"
    if not desc.exists():
        if version:
            raise SystemExit(f"--speculators {version}: {sys.prefix} is not an environment made by scripts/mkenv.py")
        return None
    folders = json.loads(desc.read_text())["speculators"]
    version = version or max(folders, key=lambda v: [int(x) for x in v.split(".")])
    if version not in folders:
        raise SystemExit(f"speculators {version} is not in this environment (have {sorted(folders)})")
    folder = folders[version]
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
    return version


def environment_speculators_in_use() -> str | None:
    """The version of a mkenv environment's speculators folder that ``import speculators`` would load
    here (its default, or one ``PYTHONPATH`` names), or None: no such environment, no speculators, or
    one from elsewhere."""
    import importlib.util

    desc = Path(sys.prefix) / "speccompat-env.json"
    spec = importlib.util.find_spec("speculators")
    if not desc.exists() or spec is None or not spec.origin:
        return None
    origin = Path(spec.origin).resolve()
    for version, folder in json.loads(desc.read_text())["speculators"].items():
        if Path(folder).resolve() in origin.parents:
            return version
    return None


@contextlib.contextmanager
def output_to(log: Path) -> Iterator[TextIO]:
    """Send this process's stdout/stderr (file descriptors 1 and 2, so child processes and C
    libraries too) to ``log``; yield a stream to the original terminal for the summary."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    term = os.fdopen(os.dup(saved_out), "w", buffering=1)
    with open(log, "ab", buffering=0) as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield term
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            term.close()


@contextlib.contextmanager
def progress(term: TextIO, what: str, every: float = 10.0) -> Iterator[None]:
    """``what ...`` then the elapsed seconds while it runs (in place on a terminal, a line every
    ``every`` seconds otherwise), then ``done in N s``."""
    t0 = time.monotonic()
    stop = threading.Event()
    tty = term.isatty()
    term.write(f"{what} ...")
    term.flush()

    def tick() -> None:
        while not stop.wait(1.0 if tty else every):
            s = f" {time.monotonic() - t0:.0f} s"
            term.write(f"\r{what} ...{s}" if tty else f"\n  ... still running ({s.strip()})")
            term.flush()

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        term.write(("\r" if tty else "\n") + f"{what}: done in {time.monotonic() - t0:.1f} s\n")
        term.flush()


def describe_stats(stats: dict[str, Any]) -> str:
    """The scheduling figures of one generate() call, in words."""
    parts = [f"{stats.get('driver_steps', stats.get('steps', '?'))} engine step(s)"]
    if "chunked" in stats:
        parts.append(f"{stats['chunked']} sequence(s) prefilled in several chunks")
    if "restarted" in stats:
        parts.append(f"{stats['restarted']} restarted after preemption")
    times = [(k, stats[k]) for k in ("loop_s", "collect_s", "unpack_s") if k in stats]
    names = {"loop_s": "engine loop", "collect_s": "collecting from the workers", "unpack_s": "copy-out"}
    if times:
        parts.append("time: " + ", ".join(f"{names[k]} {v:.2f} s" for k, v in times))
    return "; ".join(parts)


def describe_parity(cases: list[Any], bad: list[str]) -> list[str]:
    """The parity verdict with the tolerance it applied (docs/parity.md)."""
    from .testing.parity import Thresholds

    t = Thresholds()
    worst = max(cases, key=lambda c: c.got.rel / max(t.rel_ratio * c.noise.rel, t.rel_floor))
    limit = max(t.rel_ratio * worst.noise.rel, t.rel_floor)
    verdict = "PASS" if not bad else "FAIL"
    lines = [
        f"parity with transformers: {verdict}, {len(cases) - len(bad)}/{len(cases)} (sequence, layer) cases "
        "within tolerance",
        f"  tolerance per case: relative error <= max({t.rel_ratio:g} x that case's own bf16 noise, "
        f"{t.rel_floor:g}) against a float32 transformers reference (docs/parity.md)",
        f"  closest to its limit: sequence {worst.seq}, layer {LAYER_IDS[worst.layer]}: relative error "
        f"{worst.got.rel:.4f}, limit {limit:.4f} (transformers' own bf16 noise there: {worst.noise.rel:.4f})",
    ]
    return lines + ["  " + line for line in bad[:10]]


def run_demo(model: str, workdir: str, sequences: int, speculators: str | None = None) -> int:
    chosen = use_speculators(speculators)
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "demo.log"
    log.write_bytes(b"")
    with output_to(log) as term:
        import speccompat

        status = speccompat.apply()
        term.write(f"speccompat {speccompat.__version__}: {status.state}, adapter {status.adapter}"
                   + (f"; speculators {chosen} from this environment" if chosen else "") + "\n")
        term.write(f"(vLLM's, the workers' and transformers' output: {log})\n")
        from speculators.data_generation import VllmHiddenStatesGenerator

        from .testing.models import make_checkpoint
        from .testing.parity import measure, violations
        from .testing.reference import ReferenceModel

        path = make_checkpoint(model, work / model)
        term.write(f"tiny {model} checkpoint (random weights): {path}\n")
        with progress(term, "starting vLLM's engine through speculators' generator"):
            gen = VllmHiddenStatesGenerator(str(path), layer_ids=LAYER_IDS, max_model_len=1024,
                                            gpu_memory_utilization=0.1)
        rng = random.Random(0)
        seqs = [[rng.randrange(4, 512) for _ in range(rng.randrange(20, 600))] for _ in range(sequences)]
        tokens = sum(map(len, seqs))
        prepared = work / "prepared.jsonl"  # the same sequences for `speccompat extract` (the README's next step)
        prepared.write_text("".join(json.dumps({"id": f"demo-{i}", "input_ids": s}) + "\n" for i, s in enumerate(seqs)))
        t0 = time.time()
        with progress(term, f"extracting {len(seqs)} sequences ({tokens:,} tokens), layers {LAYER_IDS}"):
            results = gen.generate(seqs)
        dt = time.time() - t0
        term.write(f"  {tokens / dt:,.0f} tokens/s; {describe_stats(getattr(gen, '_speccompat_stats', {}))}\n")
        term.write("what speccompat did:\n" + "\n".join("  " + ln for ln in str(speccompat.status()).splitlines()) + "\n")
        with progress(term, "computing the transformers reference (float32 and bfloat16)"):
            ref32, ref16 = ReferenceModel(str(path), "float32"), ReferenceModel(str(path), "bfloat16")
            cases = measure(results, [ref32.hidden_states(s, LAYER_IDS) for s in seqs],
                            [ref16.hidden_states(s, LAYER_IDS) for s in seqs])
        bad = violations(cases)
        term.write("\n".join(describe_parity(cases, bad)) + "\n")
        term.write(f"the same sequences for `speccompat extract --prepared-data`: {prepared}\n")
        del gen
    return 1 if bad else 0
