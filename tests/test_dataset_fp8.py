"""``--dtype fp8`` data sets with fake results (no engine): speculators 0.9.0's own ``ArrowDataset``
with hs-connectors' ``FP8Transfer`` reads them unchanged and gets the states of the bf16 set within
fp8's error; half the bytes per token; verify, resume, export and the reader; refusals."""

from __future__ import annotations

import json
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="fp8 data sets are made and read with torch")

from support.dataset_fakes import LAYERS, jsonl, model_dir, random_records, states  # noqa: E402
from support.dataset_runs import provenance, run, scan  # noqa: E402
from support.fp8_checks import rel_err, within_fp8  # noqa: E402

from speccompat.dataset import fp8  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8_e4m3fn")


LOADER_CHILD = textwrap.dedent('''
    import json, sys, warnings
    from pathlib import Path
    import torch
    from support.dataset_fakes import states
    from support.dataset_runs import scan
    from support.fp8_checks import within_fp8, rel_err
    from speccompat.dataset.reader import HiddenStatesDataset
    data = import_loader(Path(sys.argv[1]))
    from hs_connectors.transfer import FP8Transfer
    out, inputs = Path(sys.argv[2]), Path(sys.argv[3])
    samples = scan(inputs)
    loader = data.ArrowDataset(max_len=64, datapath=str(out), on_missing="raise",
                               transfer=FP8Transfer(out / "hidden_states"))
    ours = HiddenStatesDataset(out)
    assert len(loader) == len(samples) == len(ours), (len(loader), len(samples))
    worst = {"draft": 0.0, "verifier": 0.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a token-id mismatch is only a warning in the loader
        for k, s in enumerate(samples):
            item, mine = loader[k], ours[k]
            h = states(s)  # the bf16 states the set was made from
            assert item["input_ids"].tolist() == list(s.input_ids), k
            assert item["hidden_states"].dtype == torch.bfloat16
            # speccompat's reader dequantizes exactly as FP8Transfer does
            assert torch.equal(item["hidden_states"], torch.cat(mine["hidden_states"][:-1], dim=-1)), k
            assert torch.equal(item["verifier_last_hidden_states"], mine["hidden_states"][-1]), k
            draft, want = item["hidden_states"], torch.cat(h[:-1], dim=-1)
            big = max(float(t.float().abs().max()) for t in h) / 448  # the largest scale of the sample
            assert within_fp8(draft, want, torch.tensor(big)), k
            assert within_fp8(item["verifier_last_hidden_states"], h[-1], torch.tensor(big)), k
            worst["draft"] = max(worst["draft"], rel_err(draft, want))
            worst["verifier"] = max(worst["verifier"], rel_err(item["verifier_last_hidden_states"], h[-1]))
    print(json.dumps({"checked": len(samples), "worst": worst}))
''')


def _write(root, *, layout="speculators-arrow", scale="token", records=None):
    model = model_dir(root)
    inputs = jsonl(root / "d.jsonl", records or random_records(7, seed=3))
    samples = scan(inputs)
    ds, _ = run(root / "out", samples, provenance(model, layout=layout, dtype="fp8", fp8_scale=scale), batch=2)
    return ds, inputs, samples


@pytest.mark.parametrize("scale", ["token", "token-layer"])
def test_speculators_09_fp8_transfer_reads_the_fp8_arrow_set(tmp_path, scale):
    """speculators 0.9.0's own ArrowDataset with hs-connectors 0.9.0's FP8Transfer (the released
    wheels, a fresh interpreter) reads both scale shapes unchanged: per sample, the draft input and
    the verifier state are the bf16 states within fp8's rounding, and equal to speccompat's reader."""
    from support.trainer_wheels import run_trainer_child

    pytest.importorskip("datasets", reason="the speculators-arrow layout needs `datasets` (speccompat[arrow])")
    _ds, inputs, samples = _write(tmp_path, scale=scale)
    out = run_trainer_child(LOADER_CHILD, "0.9.0", [str(tmp_path / "out"), str(inputs)])
    assert out["checked"] == len(samples) == 7
    assert 0 < out["worst"]["draft"] < 0.04 and 0 < out["worst"]["verifier"] < 0.04, out


def test_fp8_files_follow_hs_connectors_schema(tmp_path):
    """The Arrow layout's sample file holds what hs-connectors' fp8 connector writes: hidden_states
    F8_E4M3 [n, layers, hidden], hidden_states_scales F32 [n, 1, 1], token_ids I64 [n]; scale =
    amax/448 per token over all layers (rounded to bfloat16), dequantized by fp8 * scale."""
    pytest.importorskip("datasets")
    from safetensors import safe_open

    _ds, _inputs, samples = _write(tmp_path, scale="token")
    s = samples[2]
    path = tmp_path / "out" / "hidden_states" / "hs_2.safetensors"
    with safe_open(str(path), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    assert set(t) == {"hidden_states", "hidden_states_scales", "token_ids", "loss_mask"}
    n, hidden = s.num_tokens, 8
    assert t["hidden_states"].dtype == torch.float8_e4m3fn and list(t["hidden_states"].shape) == [n, len(LAYERS), hidden]
    assert t["hidden_states_scales"].dtype == torch.float32 and list(t["hidden_states_scales"].shape) == [n, 1, 1]
    assert t["token_ids"].tolist() == list(s.input_ids)
    ref = torch.stack(states(s), dim=1).float()
    amax = ref.abs().amax(dim=(1, 2), keepdim=True)
    assert torch.equal(t["hidden_states_scales"], (amax / 448).to(torch.bfloat16).float())
    assert float(t["hidden_states"].float().abs().amax()) == 448.0  # each token's largest value uses the range
    assert within_fp8(t["hidden_states"].float() * t["hidden_states_scales"], ref, t["hidden_states_scales"])
    view = json.loads((tmp_path / "out" / "speccompat_arrow.json").read_text())
    assert view["trainer"].startswith("speculators >= 0.9: --hidden-states-backend fp8")


def test_per_token_layer_scales_follow_each_layer(tmp_path):
    """--fp8-scale token-layer: [n, layers, 1] scales, each layer's own amax/448. e4m3's exponent spans
    2^15 of normal values, so a layer 1000x smaller than the largest keeps fp8's relative precision
    under one shared scale too; 10^5x smaller, it falls into the subnormals and loses most of it,
    which a scale of its own keeps."""
    from speccompat.dataset.fp8 import dequantize, quantize

    g = torch.Generator().manual_seed(0)
    hs = [torch.randn(50, 64, generator=g).bfloat16() * m for m in (1e-4, 0.01, 10.0, 10.0)]
    ref = torch.stack(hs, dim=1).float()
    q1, s1 = quantize(hs, "token", stack=True)
    q2, s2 = quantize(hs, "token-layer", stack=True)
    assert list(s1.shape) == [50, 1, 1] and list(s2.shape) == [50, 4, 1]
    e1 = rel_err(dequantize(q1, s1, torch.float32)[:, 0], ref[:, 0])
    e2 = rel_err(dequantize(q2, s2, torch.float32)[:, 0], ref[:, 0])
    assert e2 < 0.04 < 0.2 < e1, (e1, e2)  # 10^5x smaller: ~0.03 with its own scale, most lost with a shared one
    for q, s in ((q1, s1), (q2, s2)):  # 10^3x smaller: fp8's precision either way
        assert rel_err(dequantize(q, s, torch.float32)[:, 1], ref[:, 1]) < 0.04
    for q, s in ((q1, s1), (q2, s2)):  # the large layers: fp8's precision either way
        assert rel_err(dequantize(q, s, torch.float32)[:, 2:], ref[:, 2:]) < 0.04


def test_quantize_refuses_non_finite_and_keeps_zero_tokens():
    from speccompat.dataset.fp8 import dequantize, quantize

    h = torch.zeros(3, 8, dtype=torch.bfloat16)
    q, s = quantize([h, h.clone()], "token", stack=True)
    assert torch.equal(dequantize(q, s, torch.float32), torch.zeros(3, 2, 8)) and bool((s > 0).all())
    bad = torch.ones(3, 8, dtype=torch.bfloat16)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite hidden states \(layer position\(s\) \[1\]\)"):
        quantize([h, bad], "token", stack=False)
    big = torch.full((2, 8), 3e38, dtype=torch.float32)  # no overflow: the scale takes the magnitude
    q, s = quantize([big], "token", stack=False)
    assert torch.allclose(q[0].float() * s[:, 0], big, rtol=2 ** -4)


def test_bytes_per_token_at_most_051_of_bf16(tmp_path):
    """A size property of written data sets (files' sizes, headers and token ids included):
    fp8 (both scale shapes) at most 0.51x the bf16 set of the same inputs, at hidden size 1024."""
    hidden = 1024

    def big_states(sample, seed=0):
        g = torch.Generator().manual_seed(seed + sample.num_tokens)
        return [torch.randn(sample.num_tokens, hidden, generator=g).bfloat16() for _ in LAYERS]

    from speccompat.dataset import open_dataset

    model = model_dir(tmp_path, hidden=hidden)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(6, seed=1, lo=40, hi=60)))
    tokens = sum(s.num_tokens for s in samples)
    size = {}
    for name, kw in {"bf16": {}, "token": {"dtype": "fp8", "fp8_scale": "token"},
                     "token-layer": {"dtype": "fp8", "fp8_scale": "token-layer"}}.items():
        out = tmp_path / name
        ds = open_dataset(out, samples, provenance(model, **kw))
        with ds, ds.writer(threads=2) as w:
            for s in ds.todo:
                w.submit([ds.job(s, big_states(s))])
        size[name] = sum(p.stat().st_size for p in out.glob("*.safetensors")) / tokens
        from speccompat.dataset.verify import verify_dataset

        assert verify_dataset(out) == ([], len(samples))
    assert size["token"] <= 0.51 * size["bf16"], size
    assert size["token-layer"] <= 0.51 * size["bf16"], size
    assert size["token-layer"] - size["token"] == pytest.approx(4 * (len(LAYERS) - 1), abs=1), size  # 12 B/token


def test_reader_verify_resume_and_safetensors_layout(tmp_path):
    """The per-sample safetensors layout in fp8: verify is clean, the reader dequantizes (any layer
    subset, per-layer scales picked for it), a resume redoes only a damaged file, and verify names a
    changed scale (checksum) and a NaN written in place of a value."""
    from speccompat.dataset.reader import HiddenStatesDataset
    from speccompat.dataset.verify import verify_dataset

    ds, inputs, samples = _write(tmp_path, layout="safetensors", scale="token-layer")
    out = tmp_path / "out"
    assert verify_dataset(out) == ([], len(samples))
    r = HiddenStatesDataset(out)
    sub = HiddenStatesDataset(out, layers=[LAYERS[3], LAYERS[1]], dequantize_dtype=torch.float32)
    for k, s in enumerate(samples):
        ref = states(s)
        item = r[k]
        assert [t.dtype for t in item["hidden_states"]] == [torch.bfloat16] * len(LAYERS)
        for got, want in zip(item["hidden_states"], ref, strict=True):
            amax = want.float().abs().amax(dim=-1, keepdim=True)
            assert within_fp8(got, want, amax / 448)
        part = sub[k]["hidden_states"]
        assert torch.equal(part[0].bfloat16(), item["hidden_states"][3])
        assert torch.equal(part[1].bfloat16(), item["hidden_states"][1])
    # damage: a scale changed in place (same size) -> checksum problem; resume redoes the file
    entry = next(e for e in ds.manifest.entries.values() if e["id"] == samples[1].id)
    path = out / entry["file"]
    blob = bytearray(path.read_bytes())
    from speccompat.dataset.formats import read_safetensors

    _m, t, mm = read_safetensors(path)
    start = len(blob) - sum(len(v[2]) for v in t.values())  # data after the header
    hdr = json.loads(blob[8:start].decode())
    b0 = start + hdr[fp8.SCALES]["data_offsets"][0]
    del t, mm
    blob[b0:b0 + 4] = bytes([0, 0, 0xC0, 0x7F])  # a NaN scale
    path.write_bytes(bytes(blob))
    problems, _ = verify_dataset(out)
    assert any("hidden_states_scales checksum differs" in p for p in problems), problems
    assert any("hidden_states_scales has 1 value(s) that are not finite and positive" in p for p in problems)
    ds2, _ = run(out, samples, provenance(model_dir(tmp_path), dtype="fp8", fp8_scale="token-layer"), batch=2)
    assert [s.id for s in ds2.todo] == [samples[1].id]
    assert verify_dataset(out) == ([], len(samples))


def test_a_different_scale_granularity_is_a_different_data_set(tmp_path):
    from speccompat.dataset import Rejected

    _ds, _inputs, samples = _write(tmp_path, layout="safetensors", scale="token")
    with pytest.raises(Rejected, match=r"hidden_states.fp8.scale: \"token\" -> \"token-layer\""):
        run(tmp_path / "out", samples, provenance(model_dir(tmp_path), dtype="fp8", fp8_scale="token-layer"))
    with pytest.raises(Rejected, match=r"hidden_states.dtype: \"fp8\" -> \"bfloat16\""):
        run(tmp_path / "out", samples, provenance(model_dir(tmp_path)))


def test_extract_refuses_fp8_before_any_engine(tmp_path, monkeypatch, caplog):
    """--dtype fp8 with --format speculators (0.3/0.4 cannot read it), and on a torch without
    float8_e4m3fn: exit 2 before an engine starts or anything is written, naming why."""
    from speccompat.dataset import extract as ex

    model = model_dir(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", random_records(3))
    out = tmp_path / "out"
    monkeypatch.setattr(ex, "start_generator", lambda *a: pytest.fail("the engine must not start"))
    argv = ["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out), "--max-seq-len", "64",
            "--dtype", "fp8"]
    assert ex.main([*argv, "--format", "speculators"]) == 2 and not out.exists()
    assert "Eagle3SampleFileDataset casts the stored tensors with .to(dtype) and knows no scale" in caplog.text
    caplog.clear()
    monkeypatch.delattr(torch, "float8_e4m3fn")
    assert ex.main(argv) == 2 and not out.exists()
    assert "has no float8_e4m3fn" in caplog.text and "nothing was started or written" in caplog.text


def test_export_converts_bf16_and_fp8_both_ways_and_verifies(tmp_path):
    """export --dtype: bf16 -> fp8 (speculators-arrow) quantizes as the driver does (the same files'
    tensors as an fp8 run of the same states), fp8 -> fp8 into another layout keeps every value and
    scale, fp8 -> bf16 gives the dequantized states; each result verifies; fp8 -> speculators (0.3/0.4) is
    refused, naming why, before anything is written."""
    pytest.importorskip("datasets")
    from speccompat.dataset import Rejected
    from speccompat.dataset.export import export_dataset
    from speccompat.dataset.reader import HiddenStatesDataset

    model = model_dir(tmp_path)
    inputs = jsonl(tmp_path / "d.jsonl", random_records(5, seed=8))
    samples = scan(inputs)
    run(tmp_path / "bf16", samples, provenance(model), batch=2)
    run(tmp_path / "fp8", samples, provenance(model, layout="speculators-arrow", dtype="fp8", fp8_scale="token-layer"))
    assert export_dataset(tmp_path / "bf16", "speculators-arrow", tmp_path / "q", dtype="fp8", fp8_scale="token-layer",
                          progress=False) == []
    assert export_dataset(tmp_path / "q", "safetensors", tmp_path / "q2", progress=False) == []
    assert export_dataset(tmp_path / "q2", "safetensors", tmp_path / "back", dtype="bfloat16", progress=False) == []
    direct, q, q2, back = (HiddenStatesDataset(tmp_path / n, dequantize_dtype=torch.float32)
                           for n in ("fp8", "q", "q2", "back"))
    for k, s in enumerate(samples):
        ref = states(s)
        for a, b, c, d, want in zip(direct[k]["hidden_states"], q[k]["hidden_states"], q2[k]["hidden_states"],
                                    back[k]["hidden_states"], ref, strict=True):
            assert torch.equal(a, b) and torch.equal(b, c)  # the driver's values; fp8 -> fp8 keeps them
            assert d.dtype == torch.bfloat16 and torch.equal(d, c.bfloat16())
            assert within_fp8(c, want, want.float().abs().amax(dim=-1, keepdim=True) / 448)
    prov = json.loads((tmp_path / "q2" / "manifest.jsonl").read_text().splitlines()[0])["provenance"]
    assert prov["hidden_states"]["dtype"] == "fp8" and prov["hidden_states"]["fp8"]["scale"] == "token-layer"
    assert prov["hidden_states"]["fp8"]["dequantize"] == "hidden_states.to(dtype) * hidden_states_scales.to(dtype)"
    assert prov["exported_from"]["dtype"] == "fp8"
    with pytest.raises(Rejected, match=r"knows no scale.*pass --dtype bfloat16 to dequantize it"):
        export_dataset(tmp_path / "q2", "speculators", tmp_path / "pt", progress=False)
    assert not (tmp_path / "pt").exists()


def test_fp8_shards_merge_and_check_draft_facts(tmp_path):
    """Shards of an fp8 speculators-arrow set merge into one that verifies, whose rows the reader
    dequantizes; check-draft takes the layer ids from its provenance as from a bf16 set's."""
    pytest.importorskip("datasets")
    import argparse

    from support.shard_runs import run_shard

    from speccompat.dataset import verify_dataset
    from speccompat.dataset.check_draft import dataset_layers
    from speccompat.dataset.reader import HiddenStatesDataset
    from speccompat.dataset.shards import main as merge_main

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(7, seed=4)))
    prov = provenance(model, layout="speculators-arrow", dtype="fp8", fp8_scale="token")
    for k in (1, 0):
        run_shard(tmp_path / "out", samples, prov, k, 2)
    args = argparse.Namespace(dir=tmp_path / "out", threads=2, no_verify=False, inputs=None, limit=None,
                              token_freq_path=None)
    assert merge_main(args) == 0
    assert verify_dataset(tmp_path / "out") == ([], 7)
    r = HiddenStatesDataset(tmp_path / "out")
    for k, s in enumerate(samples):
        assert r[k]["input_ids"].tolist() == list(s.input_ids)
        for got, want in zip(r[k]["hidden_states"], states(s), strict=True):
            assert within_fp8(got, want, torch.stack(states(s), 1).float().abs().amax(dim=(1, 2))[:, None] / 448)
    assert dataset_layers(tmp_path / "out").layer_ids == LAYERS


def _rewrite_consistently(out, entry_id, change):
    """Replace sample ``entry_id``'s file by ``change(tensors)`` (a dict of torch tensors) and make its
    manifest entry agree (bytes, names, dtypes, shapes, checksums): only verify's content checks can
    tell."""
    from safetensors.torch import load_file, save_file

    from speccompat.dataset.checksum import digest_fn
    from speccompat.dataset.formats import read_safetensors

    lines = (out / "manifest.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    entries = [json.loads(x) for x in lines[1:]]
    entry = next(e for e in entries if e["id"] == entry_id)
    path = out / entry["file"]
    meta, _t, mm = read_safetensors(path)
    meta = dict(meta)
    del _t, mm
    save_file(change(load_file(path)), path, metadata=meta)
    digest = digest_fn(header["checksum"])
    _m, raw, mm = read_safetensors(path)
    entry["tensors"] = {n: {**entry["tensors"].get(n, {}), "dtype": d, "shape": s, "checksum": digest(b)}
                        for n, (d, s, b) in raw.items()}
    del raw, mm
    entry["bytes"] = path.stat().st_size
    (out / "manifest.jsonl").write_text("\n".join([lines[0], *(json.dumps(e) for e in entries)]) + "\n")


@pytest.mark.parametrize("damage", ["missing", "negative"])
def test_export_refuses_an_fp8_source_verify_rejects(tmp_path, damage, capsys):
    """An fp8 source whose scales are missing or negative, its manifest made to agree: verify exits 1,
    and export --dtype bfloat16 refuses it (exit 2, naming the file) instead of writing raw fp8 values or
    flipped signs into a set that verifies clean; nothing is written."""
    from speccompat.cli import main

    ds, _inputs, samples = _write(tmp_path, layout="safetensors", scale="token")
    out = tmp_path / "out"

    def change(t):
        if damage == "missing":
            t.pop(fp8.SCALES)
        else:
            t[fp8.SCALES] = -t[fp8.SCALES]
        return t

    _rewrite_consistently(out, samples[2].id, change)
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr()
    assert "hidden_states_scales" in err.out and "1 problem(s)" in err.err
    new = tmp_path / "bf16"
    assert main(["export", str(out), "--to", "safetensors", "--dtype", "bfloat16", str(new)]) == 2
    err = capsys.readouterr().err
    want = "expected" if damage == "missing" else "not finite and positive"
    assert "verify rejects this source" in err and want in err and ds.files[samples[2].id] in err, err
    assert not new.exists() and not (tmp_path / "bf16.speccompat-export-staging").exists()


def test_fp8_scale_without_fp8_is_refused_by_extract_and_export(tmp_path, monkeypatch, caplog, capsys):
    """--fp8-scale was silently ignored without --dtype fp8: extract and export refuse it (exit 2)
    before an engine starts or anything is written."""
    from speccompat.cli import main
    from speccompat.dataset import extract as ex

    model = model_dir(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", random_records(3))
    out = tmp_path / "out"
    monkeypatch.setattr(ex, "start_generator", lambda *a: pytest.fail("the engine must not start"))
    argv = ["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out), "--max-seq-len", "64"]
    assert ex.main([*argv, "--fp8-scale", "token-layer"]) == 2 and not out.exists()
    assert "--fp8-scale token-layer applies to --dtype fp8 only (this run stores bfloat16)" in caplog.text
    run(tmp_path / "src", scan(data), provenance(model))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "src"), "--to", "safetensors", "--fp8-scale", "token",
                 str(tmp_path / "new")]) == 2
    assert "--fp8-scale token applies to --dtype fp8 only" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_the_closing_advice_of_an_fp8_run_names_only_trainers_that_read_fp8(tmp_path):
    from speccompat.dataset import extract as ex

    base = ["--model-path", "m", "--prepared-data", "d.jsonl", "--output-dir", str(tmp_path / "hs"),
            "--format", "speculators-arrow"]
    bf16 = ex.closing_advice(ex.ExtractConfig.from_args(ex.parse_args(base)), [1, 2, 5], 6)
    q = ex.closing_advice(ex.ExtractConfig.from_args(ex.parse_args([*base, "--dtype", "fp8"])), [1, 2, 5], 6)
    assert "speculators 0.3/0.4: put" in bf16 and "speculators >= 0.5: train with --target-layer-ids 2 3" in bf16
    assert "0.3/0.4: put" not in q and ">= 0.5" not in q
    assert "speculators >= 0.9 (the trainers that read fp8): train with --hidden-states-backend fp8 " \
           "--target-layer-ids 2 3" in q and "speculators 0.3-0.8 cannot read fp8" in q
    assert q.splitlines()[:2] == bf16.splitlines()[:2]  # the layers' meaning is the same


@pytest.mark.parametrize("layout", ["safetensors", "speculators-arrow"])
def test_values_fp8_stores_as_zero_are_counted_and_said(tmp_path, layout):
    """A token whose amax is 100 has the scale 100/448: a value of 1e-6 is below fp8's smallest step
    (2^-9 of the scale, rounded to nearest) and is stored as 0. The writer counts exactly the values
    that were not 0 and read back as 0; the run's note says how many."""
    from speccompat.dataset import open_dataset
    from speccompat.dataset.reader import HiddenStatesDataset

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(4, seed=6)))
    out = tmp_path / "out"
    ds = open_dataset(out, samples, provenance(model, layout=layout, dtype="fp8", fp8_scale="token"))
    made = {}
    with ds.writer(threads=2) as w:
        for s in samples:
            h = [x.float() for x in states(s)]
            h[0][:, 0] = 100.0  # each token's amax
            h[1][:, :5] = 1e-6  # flushed
            h[2][:, 5] = 0.0  # a true zero: not counted
            made[s.id] = h
            w.submit([ds.job(s, [x.bfloat16() for x in h])])
    ds.lock.close()
    back = HiddenStatesDataset(out, dequantize_dtype=torch.float32)
    want = 0
    for k, s in enumerate(samples):
        for x, y in zip(made[s.id], back[k]["hidden_states"], strict=True):
            want += int(((x.bfloat16().float() != 0) & (y == 0)).sum())
    assert want >= 5 * sum(s.num_tokens for s in samples)
    assert w.stats.fp8_flushed == want
    assert w.stats.fp8_values == sum(s.num_tokens for s in samples) * len(LAYERS) * made[samples[0].id][0].shape[1]
    note = fp8.flushed_note(w.stats.fp8_flushed, w.stats.fp8_values, "token")
    assert note.startswith(f"fp8: {want} of {w.stats.fp8_values} hidden-state values (") and "token-layer" in note
    assert fp8.flushed_note(0, 10, "token") is None
