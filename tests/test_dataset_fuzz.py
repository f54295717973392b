"""No traceback, whatever the bytes: a property-based fuzz test (hypothesis) of ``speccompat verify``,
``merge``, ``export``, ``check-draft`` and the driver's resume check (``open_dataset``: the one
check of the files already there before a run skips them) and its input check.

Each example copies a finished data set (one run's ``manifest.jsonl``, a sharded set not merged yet,
or the speculators-arrow layout) and damages it: manifest lines replaced by other bytes or JSON,
header and entry fields set to arbitrary JSON (the provenance digest recomputed or not), safetensors
headers rewritten (length, dtypes, shapes, offsets, metadata), tensor bytes overwritten (the
manifest's checksums recomputed or not, so the deeper checks see the damage too), and names added
to the directory (files, folders, links out of it, dangling and looping links, names that are not
UTF-8) - plus input lines for ``merge --inputs`` and the resume check. Every command must then exit
0, 1, 2 or 130 without an exception escaping it and without the CLI's "internal error" line, print a
line when it does not exit 0, and leave a folder outside the data set (the links' target) as it was.

The default suite runs a bounded number of examples per command, derandomized (the same ones every
run); ``nox -s fuzz`` raises it (``SPECCOMPAT_FUZZ_EXAMPLES``, random examples).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz test needs hypothesis (the test extra)")
pytest.importorskip("torch", reason="the data set's writer")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

#: examples per command: a few dozen in the default suite, many more in ``nox -s fuzz``
EXAMPLES = int(os.environ.get("SPECCOMPAT_FUZZ_EXAMPLES") or 25)
LONG = "SPECCOMPAT_FUZZ_EXAMPLES" in os.environ
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG, database=None,
                suppress_health_check=list(HealthCheck), print_blob=True)
EXITS = {0, 1, 2, 130}

# ---------------------------------------------------------------------------------------------
# the data sets to damage (built once)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    from support.dataset_fakes import jsonl, model_dir, random_records
    from support.dataset_runs import provenance, run, scan
    from support.shard_runs import run_shard

    root = tmp_path_factory.mktemp("fuzz-bases")
    model = model_dir(root)
    records = random_records(4, seed=11, lo=3, hi=9)
    data = jsonl(root / "d.jsonl", records)
    samples = scan(data)
    run(root / "single", samples, provenance(model), batch=2)
    for k in (0, 1):
        run_shard(root / "sharded", samples, provenance(model), k, 2)
    out = {"single": root / "single", "sharded": root / "sharded", "inputs": data, "model": model}
    try:
        import datasets  # noqa: F401

        run(root / "arrow", samples, provenance(model, layout="speculators-arrow"), batch=2)
        out["arrow"] = root / "arrow"
    except ImportError:
        pass
    return out


# ---------------------------------------------------------------------------------------------
# damage
# ---------------------------------------------------------------------------------------------

SPECIAL = [0, -1, 1, 2, 8, 2 ** 63, -(2 ** 63) - 1, 10 ** 30, 1e308, -0.0, float("nan"), float("inf"), "", ".",
           "..", "../x", "a/b", "/etc/passwd", "\ud800", "x" * 300, [], {}, None, True, False, "safetensors",
           "speculators", "speculators-arrow", "BF16", "F16", "F32", "I64", "I8", "U8", "F64", "xxh3_64", "crc32",
           [1], [0, 8], [2, 8], [-1], [2 ** 40, 8], [[1]], "manifest.jsonl", "hidden_states"]

json_values = st.recursive(
    st.sampled_from(SPECIAL) | st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)

HEADER_PATHS = [["speccompat_dataset"], ["layout"], ["checksum"], ["provenance"], ["provenance_sha256"], ["run"],
                ["provenance", "hidden_states"], ["provenance", "hidden_states", "layer_ids"],
                ["provenance", "hidden_states", "dtype"], ["provenance", "model"],
                ["provenance", "model", "hidden_size"], ["provenance", "model", "vocab_size"],
                ["provenance", "model", "num_hidden_layers"], ["provenance", "max_seq_len"],
                ["provenance", "layout"], ["provenance", "truncation"], ["provenance", "exported_from"]]
ENTRY_PATHS = [["id"], ["file"], ["line"], ["num_tokens"], ["bytes"], ["input_sha256"], ["tensors"],
               ["truncated_from"], ["tensors", "input_ids"], ["tensors", "input_ids", "shape"],
               ["tensors", "input_ids", "dtype"], ["tensors", "loss_mask", "checksum"],
               ["tensors", "loss_mask", "shape"], ["tensors", "hidden_states_1", "shape"],
               ["tensors", "hidden_states_1", "dtype"], ["tensors", "hidden_states", "shape"]]
TENSOR_PATHS = [["dtype"], ["shape"], ["data_offsets"], []]
NAMES = ["manifest.jsonl", "manifest.header.json", "manifest.shard-00000-of-00002.jsonl",
         "manifest.shard-00001-of-00002.jsonl", "manifest.shard-00002-of-00003.jsonl", ".speccompat-dataset.lock",
         ".speccompat-shard-00000-of-00002.lock", ".speccompat-header.lock", ".speccompat-overwrite",
         ".speccompat-arrow-build", ".speccompat-export-staging", "hidden_states", "state.json", "dataset_info.json",
         "speccompat_arrow.json", "token_freq.pt", "data-00000-of-00001.arrow", "data_0.pt", "data_config.json",
         "s000.safetensors", "s001.safetensors", "x.safetensors", "x.safetensors.123.partial",
         "manifest.jsonl.9.partial", "provenance.json", "config.json"]

ops = st.one_of(
    st.tuples(st.just("manifest_line"), st.integers(0, 8), st.binary(max_size=64) | json_values.map(
        lambda v: json.dumps(v).encode())),
    st.tuples(st.just("manifest_field"), st.integers(0, 8), st.sampled_from(HEADER_PATHS + ENTRY_PATHS),
              st.one_of(st.just("<delete>"), json_values), st.booleans()),
    st.tuples(st.just("st_header"), st.integers(0, 8), st.integers(0, 8), st.sampled_from(TENSOR_PATHS),
              st.one_of(st.just("<delete>"), json_values), st.booleans()),
    st.tuples(st.just("st_length"), st.integers(0, 8), st.integers(0, 2 ** 64 - 1)),
    st.tuples(st.just("tensor_bytes"), st.integers(0, 8), st.integers(0, 8), st.integers(0, 4096),
              st.binary(min_size=1, max_size=16), st.booleans()),
    st.tuples(st.just("truncate"), st.integers(0, 8), st.integers(0, 4096)),
    st.tuples(st.just("entry"), st.sampled_from(NAMES) | st.text(min_size=1, max_size=12)
              | st.binary(min_size=1, max_size=12), st.sampled_from(["file", "dir", "link-out", "link-dangling",
                                                                   "link-loop", "link-file-out"]),
              st.binary(max_size=64)),
)
damages = st.lists(ops, min_size=1, max_size=4)

input_line = st.one_of(
    st.binary(max_size=40),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"id": json_values, "input_ids": json_values | st.lists(st.integers(-2, 600), max_size=6)},
                          optional={"loss_mask": json_values | st.lists(st.integers(-1, 300), max_size=6)})
    .map(lambda d: json.dumps(d).encode()),
)
input_lines = st.lists(input_line, max_size=5)


def _set(obj, path, value):
    """``obj`` with ``path`` set to ``value`` (``"<delete>"``: removed) where the path exists."""
    if not path:
        return value
    cur = obj
    for k in path[:-1]:
        if not isinstance(cur, dict) or not isinstance(cur.get(k), dict):
            return obj
        cur = cur[k]
    if isinstance(cur, dict):
        if value == "<delete>":
            cur.pop(path[-1], None)
        else:
            cur[path[-1]] = value
    return obj


def _dumps(v) -> bytes:
    return json.dumps(v, allow_nan=True).encode()


def _manifests(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.startswith("manifest") and p.name.endswith((".jsonl", ".json"))
                  and not p.is_symlink() and p.is_file())


def _samples(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.endswith(".safetensors") and p.is_file() and not p.is_symlink())


def _fix_entries(d: Path, sample: Path) -> None:
    """Make the manifest entries of ``sample`` agree with its bytes (size, checksums), so the
    checks beyond the checksum see the damage."""
    from speccompat.dataset.checksum import digest_fn
    from speccompat.dataset.formats import read_safetensors

    try:
        _meta, tensors, _mm = read_safetensors(sample)
    except (OSError, ValueError):
        return
    for m in _manifests(d):
        lines = m.read_bytes().split(b"\n")
        head = None
        for k, line in enumerate(lines):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            if "checksum" in obj and head is None:
                head = obj
            if obj.get("file") != sample.name or not isinstance(obj.get("tensors"), dict):
                continue
            try:
                digest = digest_fn((head or {}).get("checksum") or "xxh3_64")
            except (ValueError, TypeError):
                continue
            obj["bytes"] = sample.stat().st_size
            for name, (dtype, shape, buf) in tensors.items():
                key = "input_ids" if name == "token_ids" else name
                if isinstance(obj["tensors"].get(key), dict):
                    obj["tensors"][key].update({"dtype": dtype, "shape": shape, "checksum": digest(buf)})
            lines[k] = _dumps(obj)
        m.write_bytes(b"\n".join(lines))


def damage(d: Path, outside: Path, todo: list) -> None:
    for op in todo:
        kind = op[0]
        manifests, samples = _manifests(d), _samples(d)
        if kind == "manifest_line" and manifests:
            m = manifests[op[1] % len(manifests)]
            lines = m.read_bytes().split(b"\n")
            lines[op[1] % len(lines)] = op[2]
            m.write_bytes(b"\n".join(lines))
        elif kind == "manifest_field" and manifests:
            _, k, path, value, fix = op
            m = manifests[k % len(manifests)]
            lines = m.read_bytes().split(b"\n")
            k %= max(1, len([x for x in lines if x.strip()]))
            try:
                obj = json.loads(lines[k])
            except ValueError:
                continue
            obj = _set(obj, path, value)
            if fix and isinstance(obj, dict) and isinstance(obj.get("provenance"), dict):
                from speccompat.dataset.provenance import digest

                with contextlib.suppress(Exception):
                    obj["provenance_sha256"] = digest(obj["provenance"])
            lines[k] = _dumps(obj)
            m.write_bytes(b"\n".join(lines))
        elif kind == "st_header" and samples:
            _, f, t, path, value, fix = op
            p = samples[f % len(samples)]
            raw = p.read_bytes()
            n = int.from_bytes(raw[:8], "little")
            try:
                header = json.loads(raw[8:8 + n])
            except ValueError:
                continue
            names = sorted(header)
            if not names:
                continue
            name = names[t % len(names)]
            if name == "__metadata__":
                header[name] = value if path == [] else _set(header[name], ["speccompat_sample"], value)
            else:
                header[name] = _set(header[name], path, value)
            new = _dumps(header)
            new += b" " * (-len(new) % 8)
            p.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
            if fix:
                _fix_entries(d, p)
        elif kind == "st_length" and samples:
            p = samples[op[1] % len(samples)]
            raw = bytearray(p.read_bytes())
            raw[:8] = struct.pack("<Q", op[2])
            p.write_bytes(bytes(raw))
        elif kind == "tensor_bytes" and samples:
            _, f, t, off, data, fix = op
            p = samples[f % len(samples)]
            raw = bytearray(p.read_bytes())
            n = int.from_bytes(raw[:8], "little")
            try:
                header = json.loads(raw[8:8 + n])
                spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
                lo, hi = spans[t % len(spans)]
            except (ValueError, KeyError, TypeError, ZeroDivisionError):
                lo, hi = 0, len(raw) - 8 - n
            at = 8 + n + lo + (off % max(1, hi - lo))
            raw[at:at + len(data)] = data[: max(0, len(raw) - at)]
            p.write_bytes(bytes(raw[:len(raw)]))
            if fix:
                _fix_entries(d, p)
        elif kind == "truncate" and samples:
            p = samples[op[1] % len(samples)]
            raw = p.read_bytes()
            p.write_bytes(raw[: op[2] % max(1, len(raw))])
        elif kind == "entry":
            _, name, how, data = op
            if isinstance(name, str) and ("/" in name or "\0" in name or name in (".", "..")):
                continue
            if isinstance(name, bytes) and (b"/" in name or b"\0" in name or name in (b".", b"..")):
                continue
            try:
                target = os.path.join(os.fsencode(d), name if isinstance(name, bytes) else os.fsencode(name))
            except UnicodeEncodeError:
                continue
            if os.path.islink(target) or os.path.isfile(target):
                os.unlink(target)
            elif os.path.isdir(target):
                shutil.rmtree(target)
            if how == "file":
                with open(target, "wb") as fh:
                    fh.write(data)
            elif how == "dir":
                os.mkdir(target)
                with open(os.path.join(target, b"inside"), "wb") as fh:
                    fh.write(data)
            elif how == "link-out":
                os.symlink(outside, target)
            elif how == "link-file-out":
                os.symlink(outside / "sentinel", target)
            elif how == "link-dangling":
                os.symlink(outside / "no-such-file", target)
            else:
                os.symlink(target, target)


def snapshot(d: Path) -> dict:
    out = {}
    for root, dirs, files in os.walk(d):
        for n in dirs + files:
            p = os.path.join(root, n)
            out[os.path.relpath(p, d)] = ("link", os.readlink(p)) if os.path.islink(p) else (
                open(p, "rb").read() if os.path.isfile(p) else "dir")  # noqa: SIM115
    return out


@contextlib.contextmanager
def damaged(bases, base: str, todo: list):
    """A damaged copy of ``bases[base]`` at ``<tmp>/set``, a folder ``<tmp>/outside`` its links point to."""
    tmp = Path(tempfile.mkdtemp(prefix="speccompat-fuzz-"))
    try:
        outside = tmp / "outside"
        outside.mkdir()
        (outside / "sentinel").write_bytes(b"outside the data set")
        shutil.copytree(bases[base], tmp / "set", symlinks=True)
        damage(tmp / "set", outside, todo)
        before = snapshot(outside)
        yield tmp, tmp / "set"
        assert snapshot(outside) == before, "something outside the data set was touched"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cli(capsys, *argv: str) -> tuple[int, str]:
    """``speccompat *argv`` in this process: its exit status and what it printed."""
    from speccompat.cli import INTERNAL_ERROR, main

    capsys.readouterr()
    code = main(list(argv))
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert INTERNAL_ERROR not in text, text
    assert "Traceback" not in text, text
    assert code in EXITS, (code, text)
    if code != 0:
        assert text.strip(), f"exit {code} without a line saying why"
    return code, text


bases_names = st.sampled_from(["single", "sharded", "arrow"])


# ---------------------------------------------------------------------------------------------
# the properties
# ---------------------------------------------------------------------------------------------

# each @example: damage that once made a command raise (kept in every run)
@FUZZ
@given(base=bases_names, todo=damages)
@example(base="single", todo=[("tensor_bytes", 0, 1, 0, b"\xc8", True)])  # a loss_mask value outside int8
@example(base="single", todo=[("entry", b"\xff.safetensors", "file", b"x")])  # a name that is not UTF-8
def test_verify_never_raises(bases, capsys, base, todo):
    if base not in bases:
        base = "single"
    with damaged(bases, base, todo) as (_tmp, d):
        cli(capsys, "verify", str(d))


@FUZZ
@given(base=bases_names, todo=damages, lines=input_lines, with_inputs=st.booleans())
@example(base="single", todo=[("manifest_line", 0, b"")], lines=[], with_inputs=True)  # entries, no header
@example(base="sharded", todo=[("entry", ".speccompat-arrow-build", "link-out", b"")], lines=[], with_inputs=False)
def test_merge_never_raises(bases, capsys, base, todo, lines, with_inputs):
    if base not in bases:
        base = "sharded"
    with damaged(bases, base, todo) as (tmp, d):
        argv = ["merge", str(d)]
        if with_inputs:
            inputs = tmp / "in.jsonl"
            inputs.write_bytes(bases["inputs"].read_bytes() + b"\n".join(lines))
            argv += ["--inputs", str(inputs)]
        cli(capsys, *argv)


@FUZZ
@given(base=bases_names, todo=damages, to=st.sampled_from(["safetensors", "speculators-arrow"]))
@example(base="single", todo=[("tensor_bytes", 1, 2, 3, b"\xff\xff", False)], to="safetensors")  # one corrupt file
@example(base="single", todo=[("manifest_field", 0, ["checksum"], [], False)], to="safetensors")  # unhashable
def test_export_never_raises_and_leaves_no_half_data_set(bases, capsys, base, todo, to):
    if base not in bases:
        base = "single"
    if to == "speculators-arrow" and "arrow" not in bases:
        to = "safetensors"
    with damaged(bases, base, todo) as (tmp, d):
        out = tmp / "exported"
        code, _text = cli(capsys, "export", str(d), "--to", to, str(out))
        if code != 0:  # nothing that passes for a data set is left
            assert not (out / "manifest.jsonl").exists()


draft_configs = st.one_of(
    json_values,
    st.fixed_dictionaries({}, optional={
        "speculators_model_type": st.sampled_from(["eagle3", "dflash", "x"]) | json_values,
        "eagle_aux_hidden_state_layer_ids": st.lists(st.integers(-3, 12), max_size=4) | json_values,
        "transformer_layer_config": st.fixed_dictionaries({}, optional={"num_hidden_layers": json_values}),
        "eagle_config": json_values, "dflash_config": json_values, "architectures": json_values,
        "num_hidden_layers": json_values}))


@FUZZ
@given(base=bases_names, todo=damages, config=draft_configs, raw=st.none() | st.binary(max_size=32),
       fix=st.booleans())
@example(base="single", todo=[("entry", "manifest.jsonl", "link-out", b"")], config={}, raw=None, fix=False)
@example(base="single", todo=[("manifest_line", 1, b"")], config={"eagle_config": ["\ud800"]}, raw=None, fix=True)
def test_check_draft_never_raises(bases, capsys, base, todo, config, raw, fix):
    if base not in bases:
        base = "single"
    with damaged(bases, base, todo) as (tmp, d):
        draft = tmp / "draft"
        draft.mkdir()
        (draft / "config.json").write_bytes(raw if raw is not None else _dumps(config))
        cli(capsys, "check-draft", str(draft), str(d), "--vllm", "0.32.0", *(["--fix"] if fix else []))


@FUZZ
@given(base=st.sampled_from(["single", "sharded"]), todo=damages, lines=input_lines,
       on_bad=st.sampled_from(["skip", "fail"]))
@example(base="single", todo=[("entry", "x.safetensors.123.partial", "dir", b"")], lines=[], on_bad="fail")
@example(base="single", todo=[("entry", "manifest.jsonl", "dir", b"")], lines=[], on_bad="skip")
@example(base="single", todo=[("entry", "s000.safetensors", "dir", b"")], lines=[], on_bad="skip")
@example(base="single", todo=[("entry", "hidden_states", "link-out", b"")],
         lines=[b'{"id": "bad\\ud800", "input_ids": [5, 6]}'], on_bad="skip")  # a lone surrogate
def test_the_resume_check_and_the_input_check_only_refuse(bases, base, todo, lines, on_bad):
    """What a run does before its engine starts, on damaged files and input lines: a plan or
    :class:`Rejected`, nothing else."""
    from support.dataset_runs import provenance

    from speccompat.dataset import Rejected, open_dataset, report_scan, scan_jsonl
    from speccompat.dataset.shards import ShardSpec, open_shard

    with damaged(bases, base, todo) as (tmp, d):
        inputs = tmp / "in.jsonl"
        inputs.write_bytes(bases["inputs"].read_bytes() + b"\n".join(lines))
        try:
            scan = scan_jsonl(inputs, vocab_size=512, max_seq_len=64, on_bad=on_bad)
            report_scan(scan, 64)
            prov = provenance(bases["model"])
            if base == "sharded":
                ds = open_shard(d, scan.samples, prov, ShardSpec(2, 0, "fuzz"))
            else:
                ds = open_dataset(d, scan.samples, prov)
            ds.close()
            assert {s.id for s in ds.todo} <= {s.id for s in scan.samples}
        except Rejected as exc:
            assert str(exc).strip()
