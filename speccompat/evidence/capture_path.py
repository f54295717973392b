"""The capture path: the files a run of a vLLM release runs, and their hashes.

:data:`HOT_PATH` names the core modules that run between ``speccompat.apply()`` and the states
``generate()`` returns; :func:`hot_path_sha256` hashes all of them with ``adapters/``;
:func:`release_capture_path` hashes one release's part (the core, the adapter modules it runs, its
fingerprint), in this process or, for another tree or commit, in a subprocess
(:func:`release_capture_paths`, :func:`release_sha256_at`). :func:`code_record` is what an evidence
file records of the code it ran. Dev tooling: nothing of the core imports it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from packaging.version import Version

#: The capture path: the modules that run, in the driver or in vLLM's workers, between
#: ``speccompat.apply()`` and the states ``generate()`` returns - installing the patches (api, _state,
#: patches, patching, importhooks, plugin, detect, registry, probe, platform, stand_ins), the code that
#: replaces speculators' (generator, capture, transport, layers, errors) and the adapters
#: (``adapters/``). :func:`hot_path_sha256` hashes all of it. A run of one release is judged on that
#: release's part (:func:`release_capture_path`): these core modules, the adapter modules it runs
#: (the selected one and its parents) and its fingerprint; a change to another release's adapter
#: leaves its cells current.
HOT_PATH = ("__init__.py", "_state.py", "_version.py", "adapter.py", "api.py", "capture.py", "detect.py",
            "errors.py", "generator.py", "importhooks.py", "layers.py", "patches", "patching.py", "platform.py",
            "plugin.py", "probe.py", "registry.py", "stand_ins.py", "streaming.py", "transport.py")
#: speccompat modules that do not run during an extraction: reports and the command line, the
#: matrix's lookup and its generation from the evidence (``evidence/``), the static probe (static evidence), the release watch, the scale-out helpers of the example
#: drivers, the online server (``serve/``: it calls the generator, as the extraction driver does); the
#: data set library (``dataset/``) and the test harness (``testing/``) are outside too.
OFF_PATH = ("__main__.py", "cli.py", "demo.py", "evidence", "matrix.py", "parallel.py", "report.py", "serve", "static_probe.py",
            "watch.py")


def hot_path_files(root: Any) -> list[str]:
    """The capture path's files under the repository ``root``, as sorted relative paths."""
    from pathlib import Path

    root = Path(root)
    files = [f"speccompat/{name}" for name in HOT_PATH if name.endswith(".py")]
    for package in (name for name in HOT_PATH if not name.endswith(".py")):  # every module of a package
        files += [p.relative_to(root).as_posix() for p in (root / "speccompat" / package).glob("*.py")]
    files += sorted(p.relative_to(root).as_posix() for p in (root / "adapters").glob("*.py"))
    return sorted(files)


#: The file whose ``__version__`` assignment is no capture code: a release of speccompat changes the
#: version string and nothing a run does, so the capture path's hashes read it with the value masked.
UNVERSIONED = "speccompat/_version.py"
#: How the capture path is hashed: 1, every byte of its files; 2, ``UNVERSIONED``'s version masked
#: (:func:`capture_bytes`). ``evidence/hot_path.json`` says which, and translates the release hashes
#: recorded under scheme 1 (``translated``, :func:`hot_path_state`).
HASH_SCHEME = 2


def capture_bytes(root: Any, rel: str, unversioned: str | None = UNVERSIONED) -> bytes:
    """The bytes of the capture path's file ``rel`` (under ``root``) as its hashes read them: the
    file's, with the value of ``__version__ = ...`` masked in ``unversioned`` (None: every byte)."""
    import re
    from pathlib import Path

    data = (Path(root) / rel).read_bytes()
    if rel == unversioned:
        data = re.sub(rb"(?m)^__version__ = .*$", b"__version__ = ...", data)
    return data


def hot_path_sha256(root: Any, unversioned: str | None = UNVERSIONED) -> str:
    """One hash of the capture path's files (their paths and :func:`capture_bytes`): what an evidence
    file ran."""
    import hashlib

    h = hashlib.sha256()
    for rel in hot_path_files(root):
        h.update(rel.encode() + b"\0" + hashlib.sha256(capture_bytes(root, rel, unversioned)).digest())
    return h.hexdigest()


def release_capture_path(root: Any, version: str, hot_path: tuple[str, ...] = HOT_PATH,
                         unversioned: str | None = UNVERSIONED) -> dict[str, Any]:
    """The capture path of vLLM release ``version`` in the tree ``root``: what a run on it runs.

    Its files: the core (``hot_path``'s modules and packages under ``speccompat/``, no adapter),
    ``adapters/__init__.py`` and the module of each adapter class in the MRO of the adapter
    ``by_version(version)`` selects (the chosen one and the parents it subclasses). ``sha256`` hashes
    each file as :func:`hot_path_sha256` does (:func:`capture_bytes`), then the adapter's fingerprint (``registry.fingerprint``,
    which holds what the next adapter introduces: its ``new`` symbols, required absent) as canonical
    JSON. Returns ``{"sha256", "adapter", "files"}``.

    Self-contained (every import inside; :func:`capture_bytes` travels with it): it runs in this
    process for the tree imported now, and for another tree in a subprocess whose ``sys.path`` starts
    with that tree
    (:func:`release_capture_paths`), reading that tree's ``speccompat.registry``.
    """
    import hashlib
    import json
    import os
    import sys
    from pathlib import Path

    from packaging.version import Version

    from speccompat import registry

    root = Path(os.path.abspath(root))  # absolute, symlinks kept: a tree may link its files elsewhere
    cls = registry.by_version(Version(str(version)))  # imports the adapters package (and the chosen module)
    package = "speccompat.adapters"
    here = Path(os.path.abspath(registry.__file__)).parent
    adapters = [Path(os.path.abspath(p)) for p in getattr(sys.modules.get(package), "__path__", ())]
    if here != root / "speccompat" or adapters != [root / "adapters"]:
        raise RuntimeError(f"speccompat.registry of {here.parent} (adapters {adapters}) is not the tree {root}")
    files = [f"speccompat/{name}" for name in hot_path if name.endswith(".py")]
    for sub in (name for name in hot_path if not name.endswith(".py")):
        files += [p.relative_to(root).as_posix() for p in (root / "speccompat" / sub).glob("*.py")]
    files.append("adapters/__init__.py")
    prefix = package + "."
    for c in (cls.__mro__ if cls is not None else ()):
        if c.__module__.startswith(prefix):
            files.append(f"adapters/{c.__module__[len(prefix):]}.py")
    files = sorted({f for f in files if (root / f).is_file()})
    h = hashlib.sha256()
    for rel in files:
        h.update(rel.encode() + b"\0" + hashlib.sha256(capture_bytes(root, rel, unversioned)).digest())
    fp = registry.fingerprint(cls) if cls is not None else {}
    canon = {path: {k: list(v) if isinstance(v, tuple) else v for k, v in sym._asdict().items()}
             for path, sym in fp.items()}
    h.update(b"fingerprint\0" + json.dumps(canon, sort_keys=True, separators=(",", ":")).encode())
    return {"sha256": h.hexdigest(), "adapter": cls.name() if cls is not None else None, "files": files}


#: Run in a subprocess (``sys.executable -c``): the tree (argv[1]) first on sys.path, its
#: ``adapters/`` registered as ``speccompat.adapters`` (an installed speccompat may map that name
#: to another checkout), then :func:`release_capture_path` for each version of argv[2] (JSON).
_SUBPROCESS = """from __future__ import annotations
import importlib.util, json, os, sys
root = os.path.abspath(sys.argv[1])
sys.path.insert(0, root)
import speccompat
folder = os.path.join(root, "adapters")
spec = importlib.util.spec_from_file_location("speccompat.adapters", os.path.join(folder, "__init__.py"),
                                              submodule_search_locations=[folder])
module = importlib.util.module_from_spec(spec)
sys.modules["speccompat.adapters"] = module
spec.loader.exec_module(module)
HOT_PATH = {hot_path!r}
UNVERSIONED = {unversioned!r}
{source}
print(json.dumps({{v: release_capture_path(root, v, unversioned=UNVERSIONED) for v in json.loads(sys.argv[2])}}))
"""


def _imported_tree(root: Any) -> bool:
    """Whether ``root`` is the tree this process imported speccompat and its adapters from."""
    from pathlib import Path

    from ..registry import _adapters_spec

    root = Path(os.path.abspath(root))  # as release_capture_path compares them: symlinks kept
    adapters = [Path(os.path.abspath(p)) for p in _adapters_spec().submodule_search_locations or ()]
    return Path(os.path.abspath(__file__)).parent.parent == root / "speccompat" and adapters == [root / "adapters"]


def release_capture_paths(root: Any, versions: Any, unversioned: str | None = UNVERSIONED) -> dict[str, dict[str, Any]]:
    """:func:`release_capture_path` of each of ``versions`` in the tree ``root``: in this process
    where it is the tree imported now, else in one subprocess that imports that tree's code."""
    import inspect
    import subprocess

    versions = sorted({str(v) for v in versions}, key=Version)
    if not versions:
        return {}
    if _imported_tree(root):
        return {v: release_capture_path(root, v, unversioned=unversioned) for v in versions}
    program = _SUBPROCESS.format(hot_path=HOT_PATH, unversioned=unversioned,
                                 source=inspect.getsource(capture_bytes) + "\n\n" + inspect.getsource(release_capture_path))
    done = subprocess.run([sys.executable, "-B", "-c", program, str(root), json.dumps(versions)], cwd=str(root),
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"capture path of {versions} in {root}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


#: (commit, vLLM release) -> the release's capture path hash at that commit (None: git lacks it).
_AT_COMMIT: dict[tuple[str, str], str | None] = {}


def release_sha256_at(root: Any, commit: str, versions: Any) -> dict[str, str | None]:
    """The capture path hash of each of ``versions`` at ``commit`` of the git checkout ``root``:
    ``git archive <commit> speccompat adapters`` extracted into a temporary folder, derived there
    (:func:`release_capture_paths`, one subprocess for the versions not yet known); None where git
    does not have the commit or its code cannot be read so. Each (commit, version) is derived once
    per process (``_AT_COMMIT``)."""
    import io
    import subprocess
    import tarfile
    import tempfile

    versions = {str(v) for v in versions}
    missing = sorted(v for v in versions if (commit, v) not in _AT_COMMIT)
    if missing:
        git = {"cwd": str(root), "capture_output": True, "timeout": 120}
        try:
            known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], **git).returncode == 0
            archive = subprocess.run(["git", "archive", commit, "speccompat", "adapters"], **git) if known else None
        except (OSError, subprocess.SubprocessError):
            archive = None
        if archive is None or archive.returncode != 0:  # not cached: another checkout may have it
            return {v: _AT_COMMIT.get((commit, v)) for v in sorted(versions, key=Version)}
        with tempfile.TemporaryDirectory(prefix="speccompat-at-") as tmp:
            with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(tmp, filter="data")
                else:  # Python before 3.11.4
                    tar.extractall(tmp)
            try:
                derived = release_capture_paths(tmp, missing)
            except RuntimeError:  # that commit's code cannot tell: the run is judged as without it
                derived = {}
        _AT_COMMIT.update({(commit, v): derived[v]["sha256"] if v in derived else None for v in missing})
    return {v: _AT_COMMIT[(commit, v)] for v in sorted(versions, key=Version)}


def code_record(root: Any, version: Any = None) -> dict[str, Any]:
    """What an evidence file records of the code it ran: the capture path's hash, with ``version``
    (the vLLM release it runs) also that release's capture path (``release_sha256``,
    :func:`release_capture_path`), and, where ``root`` is a git checkout, the commit and whether the
    capture path differed from it."""
    import subprocess

    rec: dict[str, Any] = {"hot_path_sha256": hot_path_sha256(root)}
    if version is not None:
        rec["release_sha256"] = release_capture_paths(root, [version])[str(version)]["sha256"]
    try:
        rec["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                       check=True, timeout=30).stdout.strip()
        diff = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *hot_path_files(root)], cwd=root,
                              capture_output=True, timeout=30)
        rec["hot_path_modified"] = diff.returncode != 0
    except (OSError, subprocess.SubprocessError):
        pass
    return rec
