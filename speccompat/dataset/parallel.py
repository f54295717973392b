"""Several engines for one extraction: child processes on this host, or Ray actors on a cluster.

The job is one ``ExtractConfig`` (``speccompat.dataset.extract``); :func:`launch_engines` turns it
into one config per engine (``ExtractConfig.engine_configs``: shard k of T each) and each of those
into the engine's command (``ExtractConfig.to_argv``); all of them write into the same data set
(``speccompat.dataset.shards``: one manifest part per shard, merged at the end).
:func:`run_local` starts the commands as child processes (GPUs split with
``CUDA_VISIBLE_DEVICES``, see :func:`partition_devices`), prefixes their output with the engine's
name and returns every exit status. :func:`run_ray` runs the same commands inside Ray actors
(``num_gpus`` = GPUs per engine) on an existing cluster (``ray.init(address=...)``). Ray is an
optional extra (``pip install 'speccompat[ray]'``), imported only by :func:`run_ray`.

The job's progress comes from the data set, never from the engines' log text
(:class:`DataSetProgress`): each shard's manifest part, read as it grows.

Only the standard library is imported at module level (the data-set modules inside functions).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DataSetProgress", "EngineRun", "exit_meaning", "launch_engines", "partition_cpus", "partition_devices",
           "run_local", "run_ray", "worst"]

logger = logging.getLogger("speccompat.parallel")

#: The whole job's progress at most this often.
PROGRESS_EVERY_S = 30.0


@dataclass
class EngineRun:
    """One engine of the job: a name for the log, the command (for Ray: its arguments after the
    Python executable, run with the actor's own interpreter), environment changes, and its shard
    ``(index, number of shards)``. ``done`` of ``samples``: how far its shard is, from the data set
    (:class:`DataSetProgress`; ``samples`` None until the shard has opened its part)."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    shard: tuple[int, int] | None = None
    done: int = 0
    samples: int | None = None
    code: int | None = None


class DataSetProgress:
    """The engines' progress read from the data set they write: shard K of N's manifest part
    (``manifest.shard-KKKKK-of-NNNNN.jsonl``) starts with a header that says how many samples the
    shard owns and how many of them were done when it opened (by any shard, any earlier run), and
    every entry appended after that is one more sample done. The parts are read as they grow
    (``Manifest.follow``: read-only, no lock, a line being appended counts once it is whole, a part
    rewritten by a shard that (re)opens is read anew)."""

    def __init__(self, out_dir: Path | str) -> None:
        from .directory import DatasetDir

        self.dir = DatasetDir(out_dir)
        self._parts: dict[tuple[int, int], Any] = {}

    def update(self, runs: list[EngineRun]) -> None:
        from .directory import part_name

        for run in runs:
            if run.shard is None:
                continue
            if run.shard not in self._parts:
                self._parts[run.shard] = self.dir.new_manifest(part_name(*run.shard))
            part = self._parts[run.shard].follow()
            facts = (part.header or {}).get("shard")
            if not isinstance(facts, dict) or (facts.get("index"), facts.get("num_shards")) != run.shard:
                continue  # not opened yet (or a part of an older version): nothing known
            try:
                samples, done, entries = int(facts["samples"]), int(facts["done"]), int(facts["entries"])
            except (KeyError, TypeError, ValueError):
                continue
            run.samples, run.done = samples, max(0, min(samples, done + len(part.entries) - entries))


def exit_meaning(code: int) -> str:
    if code == 0:
        return "every sample of its shard written"
    if code == 2:
        return "refused before its engine started"
    if code < 0 or code > 128:
        sig = -code if code < 0 else code - 128
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return "failed (its finished samples are kept; a re-run resumes the rest)"


def worst(codes: list[int]) -> int:
    """The job's exit status: 0 only when every engine exited 0; a signal counts as 128 + signal."""
    norm = [128 - c if c < 0 else c for c in codes]
    return max(norm, default=0)


def partition_devices(engines: int, per_engine: int, env: Mapping[str, str] | None = None,
                      engines_per_gpu: int = 1) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` for each engine: consecutive groups of ``per_engine`` of the visible
    devices (``CUDA_VISIBLE_DEVICES`` when set, else the GPUs the NVIDIA driver lists), each group
    shared by ``engines_per_gpu`` consecutive engines (a model much smaller than a GPU: several
    engines, each with its share of the GPU's memory). None when this host has no NVIDIA GPU (CPU
    engines). Raises ValueError when there are too few."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        devices = [d.strip() for d in visible.split(",") if d.strip()]
        where = f"CUDA_VISIBLE_DEVICES={visible}"
    else:
        gpus = Path("/proc/driver/nvidia/gpus")
        count = len(list(gpus.iterdir())) if gpus.is_dir() else 0
        if count == 0:
            return None
        devices = [str(i) for i in range(count)]
        where = f"{count} GPUs listed by the NVIDIA driver"
    groups = -(-engines // engines_per_gpu)
    need = groups * per_engine
    if len(devices) < need:
        shared = f", {engines_per_gpu} per GPU," if engines_per_gpu > 1 else ""
        raise ValueError(f"{engines} engines of {per_engine} GPU(s){shared} need {need} GPUs; this host has {where}")
    return [",".join(devices[g * per_engine:(g + 1) * per_engine]) for d in range(engines)
            for g in [d // engines_per_gpu]]


def partition_cpus(engines: int, per_engine: int) -> list[str] | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for CPU engines: this process's cores split between the
    engines (and within one between its tensor-parallel ranks, ``|``-separated), so that engines
    do not compete for the same cores. None when there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    ranks = engines * per_engine
    if len(cores) < ranks:
        return None
    size = len(cores) // ranks
    groups = [",".join(map(str, cores[r * size:(r + 1) * size])) for r in range(ranks)]
    return ["|".join(groups[d * per_engine:(d + 1) * per_engine]) for d in range(engines)]


def _log_job(runs: list[EngineRun], started: float, progress: Callable[[list[EngineRun]], None] | None) -> None:
    if progress is not None:
        try:
            progress(runs)
        except Exception as exc:  # noqa: BLE001 - progress is a report: the engines go on
            logger.warning("cannot read the job's progress: %s", exc)
    known = [r for r in runs if r.samples is not None]
    done = sum(r.done for r in known)
    total = sum(r.samples or 0 for r in known)
    running = sum(r.code is None for r in runs)
    logger.info("job progress: %d/%s samples extracted by %d engine(s) (%d running), %.0f s", done,
                total if len(known) == len(runs) else f"{total}+", len(runs), running, time.monotonic() - started)


def run_local(runs: list[EngineRun], *, out: Any = None,
              progress: Callable[[list[EngineRun]], None] | None = None) -> list[int]:
    """Start every run as a child process, copy its output (prefixed ``[name]``) to ``out``
    (stderr), log the job's progress (``progress(runs)`` sets each run's ``done``/``samples``,
    e.g. :meth:`DataSetProgress.update`), and return the exit statuses once all have ended.
    SIGTERM or Ctrl-C is passed on to every child (which keeps its finished samples)."""
    out = sys.stderr if out is None else out
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    started = time.monotonic()

    def pump(run: EngineRun, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with lock:
                out.write(f"[{run.name}] {line}")
                out.flush()

    def stop(signum: int, _frame: Any) -> None:
        logger.error("signal %d: stopping %d engine(s)", signum, sum(p.poll() is None for p in procs))
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    pumps = []
    try:
        for run in runs:
            p = subprocess.Popen(run.argv, env={**os.environ, **run.env}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace")
            procs.append(p)
            logger.info("%s: started (pid %d)%s", run.name, p.pid,
                        "".join(f", {k}={v}" for k, v in sorted(run.env.items())))
            t = threading.Thread(target=pump, args=(run, p), daemon=True)
            t.start()
            pumps.append(t)
        last = time.monotonic()
        while any(p.poll() is None for p in procs):
            try:
                time.sleep(0.5)
            except KeyboardInterrupt:
                stop(signal.SIGINT, None)
                continue
            for run, p in zip(runs, procs, strict=True):
                if run.code is None and p.poll() is not None:
                    run.code = p.returncode
                    logger.log(logging.INFO if run.code == 0 else logging.ERROR, "%s: exit %d (%s)", run.name,
                               run.code, exit_meaning(run.code))
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                _log_job(runs, started, progress)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for p in procs:
            if p.poll() is None:  # only after an exception in this loop
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
    for t in pumps:
        t.join(10)
    for run, p in zip(runs, procs, strict=True):
        if run.code is None:
            run.code = p.returncode
            logger.log(logging.INFO if run.code == 0 else logging.ERROR, "%s: exit %d (%s)", run.name, run.code,
                       exit_meaning(run.code))
    _log_job(runs, started, progress)
    return [r.code if r.code is not None else 1 for r in runs]


class _ShardActor:
    """A Ray actor running one engine's command as a child process of the actor (so an engine
    crash is an exit status, not a lost actor; ``CUDA_VISIBLE_DEVICES`` is the one Ray set)."""

    def run(self, name: str, args: list[str], env: dict[str, str]) -> int:
        proc = subprocess.Popen([sys.executable, *args], env={**os.environ, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()
        return proc.wait()


def run_ray(runs: list[EngineRun], *, address: str | None, gpus_per_engine: float, cpus_per_engine: float = 1.0,
            progress: Callable[[list[EngineRun]], None] | None = None) -> list[int]:
    """Run each engine's command in a Ray actor with ``gpus_per_engine`` GPUs (a fraction where
    engines share a GPU; 0 on a cluster without GPUs) and return the exit statuses. ``address``: a cluster's address, ``auto`` (the
    one this node belongs to; Ray reads ``RAY_ADDRESS`` itself) or ``local`` (start a
    single-node cluster in this process, for trying things out). ``EngineRun.argv`` is the
    command after the Python executable: the actors run it with their own interpreter, so the
    script, the model and the output directory must be at the same paths on every node (the
    driver reads the job's progress from that directory, ``progress`` as in :func:`run_local`)."""
    try:
        import ray
    except ImportError:
        raise ImportError("--ray needs Ray, an optional extra: pip install 'speccompat[ray]' (or pip install ray)") \
            from None
    from ray.exceptions import RayActorError, RayTaskError

    started = time.monotonic()
    kw: dict[str, Any] = {"include_dashboard": False} if address == "local" else {}
    ray.init(address=None if address == "local" else address, log_to_driver=True, **kw)
    try:
        res = ray.cluster_resources()
        gpus = res.get("GPU", 0)
        logger.info("Ray cluster %s: %d node(s), %g CPUs, %g GPUs", address, len(ray.nodes()), res.get("CPU", 0), gpus)
        if gpus_per_engine and gpus == 0:
            logger.warning("the Ray cluster has no GPUs: the %d engine(s) run on CPU", len(runs))
            gpus_per_engine = 0
        elif gpus_per_engine and gpus < gpus_per_engine:
            raise ValueError(f"an engine needs {gpus_per_engine:g} GPUs, the Ray cluster has {gpus:g}")
        elif gpus_per_engine * len(runs) > gpus:
            logger.warning("%d engines of %g GPUs exceed the cluster's %g GPUs: some wait for others to finish",
                           len(runs), gpus_per_engine, gpus)
        actor_cls = ray.remote(num_gpus=gpus_per_engine, num_cpus=cpus_per_engine, max_concurrency=2)(_ShardActor)
        actors = [actor_cls.remote() for _ in runs]
        refs = {a.run.remote(r.name, r.argv, r.env): k for k, (a, r) in enumerate(zip(actors, runs, strict=True))}
        for r in runs:
            logger.info("%s: submitted to Ray (%g GPU(s))", r.name, gpus_per_engine)
        pending = list(refs)
        last = time.monotonic()
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=5.0)
            for ref in ready:
                k = refs[ref]
                try:
                    runs[k].code = int(ray.get(ref))
                except (RayActorError, RayTaskError) as exc:
                    logger.error("%s: its actor failed: %s", runs[k].name, str(exc).splitlines()[0])
                    runs[k].code = 1
                logger.log(logging.INFO if runs[k].code == 0 else logging.ERROR, "%s: exit %d (%s)", runs[k].name,
                           runs[k].code, exit_meaning(runs[k].code))
            if time.monotonic() - last >= PROGRESS_EVERY_S or not pending:
                last = time.monotonic()
                _log_job(runs, started, progress)
        return [r.code if r.code is not None else 1 for r in runs]
    finally:
        ray.shutdown()


def launch_engines(cfg: Any, script: Path) -> int:
    """``speccompat extract --data-parallel-size D`` / ``--ray``: D engines of ``--tp-size`` GPUs,
    one shard each. ``cfg``: the job (``speccompat.dataset.extract.ExtractConfig``); each engine
    runs ``script`` with the flags of its own config (``cfg.engine_configs``: within a job of N
    shards given by ``--num-shards``/``--shard-index`` (or SLURM/``RANK``), this process's shard K
    becomes shards K*D .. K*D+D-1 of N*D). The job's progress is read from the data set
    (:class:`DataSetProgress`). Exit status: the worst engine's; when this process is the whole
    job (N is 1) and every engine succeeded, the parts are merged (the merged set records this
    job's command) and checked against the input."""
    from .errors import Rejected
    from .shards import resolve_shard
    from .store import run_info

    outer = resolve_shard(cfg.num_shards, cfg.shard_index)
    D = cfg.data_parallel_size
    share = cfg.engines_per_gpu
    memory = cfg.gpu_memory_utilization
    if share > 1 and memory * share > 1.0:
        raise Rejected(f"--engines-per-gpu {share} with --gpu-memory-utilization {memory}: the engines sharing a GPU "
                       f"would ask for {memory * share:.2f} of its memory; give each at most {1 / share:.2f}")
    engines = cfg.engine_configs(outer)
    total = outer.num_shards * D
    logger.info("%s; %d engine(s) of %d GPU(s) each%s on %s: shards %d..%d of %d", outer, D, cfg.tp_size,
                f", {share} per GPU" if share > 1 else "", "Ray" if cfg.ray else "this host", outer.index * D,
                outer.index * D + D - 1, total)
    runs = [EngineRun(f"engine {d} (shard {e.shard_index} of {total})", [str(script), *e.to_argv()],
                      shard=(e.shard_index, total)) for d, e in enumerate(engines)]
    progress = DataSetProgress(cfg.output_dir).update
    if cfg.ray:
        try:
            codes = run_ray(runs, address=cfg.ray_address, gpus_per_engine=cfg.tp_size / share, progress=progress)
        except (ImportError, ValueError) as exc:
            raise Rejected(str(exc)) from None
    else:
        try:
            devices = partition_devices(D, cfg.tp_size, engines_per_gpu=share)
        except ValueError as exc:
            raise Rejected(str(exc)) from None
        cpus = partition_cpus(D, cfg.tp_size) if devices is None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ \
            else None
        for d, run in enumerate(runs):
            run.argv = [sys.executable, *run.argv]
            if devices is not None:
                run.env["CUDA_VISIBLE_DEVICES"] = devices[d]
            if cpus is not None:
                run.env["VLLM_CPU_OMP_THREADS_BIND"] = cpus[d]
        codes = run_local(runs, progress=progress)
    code = worst(codes)
    failed = [r for r in runs if r.code]
    if failed:
        logger.error("%d of %d engine(s) did not finish their shard: %s. Finished samples are kept: re-run the "
                     "same command to retry the rest", len(failed), len(runs),
                     "; ".join(f"{r.name}: exit {r.code} ({exit_meaning(r.code or 1)})" for r in failed))
        return code
    if outer.num_shards > 1:
        logger.info("this process's %d shard(s) are done; when every shard of the job is: speccompat merge %s "
                    "--inputs %s", D, cfg.output_dir, cfg.prepared_data)
        return code
    from .shards import finish_job

    try:
        return finish_job(cfg.output_dir, cfg.prepared_data, limit=cfg.limit, token_freq_path=cfg.token_freq_path,
                          extra={"train_data_path": str(cfg.prepared_data),
                                 "gpu_memory_utilization": cfg.gpu_memory_utilization, "max_samples": cfg.limit},
                          command=run_info(None)["command"])
    except Rejected as exc:
        logger.error("%s", exc)
        return 1
