"""``--layout speculators-arrow``, ``speccompat export`` and the reader, with fake results (no engine):
speculators 0.9.0's and 0.6.0's own ``ArrowDataset`` (from the released wheels) read what the writer
wrote, tensor-equal; export round trips are tensor-equal and verify; bad layer sets are refused."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from support.dataset_fakes import LAYERS, jsonl, model_dir, random_records, states
from support.dataset_runs import provenance, run, scan
from support.trainer_wheels import run_trainer_child

pytest.importorskip("datasets", reason="the speculators-arrow layout needs `datasets` (speccompat[arrow])")
#: the tests that write or read states (the writer stores torch tensors); the refusals run without it
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="the data set's writer stores torch tensors: torch is not installed")

LOADER_CHILD = textwrap.dedent('''
    import json, sys, warnings
    from pathlib import Path
    import torch
    from support.dataset_fakes import states
    from support.dataset_runs import scan
    data = import_loader(Path(sys.argv[1]))
    out, inputs, version = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    samples = [s for s in scan(inputs) if s.id in set(json.loads(sys.argv[5]))]
    loader = data.ArrowDataset(max_len=64, datapath=str(out), on_missing="raise")
    assert len(loader) == len(samples), (len(loader), len(samples))
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a token-id mismatch is only a warning in the loader
        for k, s in enumerate(samples):
            item = loader[k]
            h = states(s)
            mask = list(s.loss_mask) if s.loss_mask is not None else [1] * s.num_tokens
            assert item["input_ids"].tolist() == list(s.input_ids), k
            assert item["loss_mask"].tolist() == mask, k
            assert torch.equal(item["hidden_states"], torch.cat(h[:-1], dim=-1)), k
            assert torch.equal(item["verifier_last_hidden_states"], h[-1]), k
            assert item["lengths"].tolist() == [s.num_tokens], k
            checked += 1
    print(json.dumps({"checked": checked, "approx_lengths": [int(x) for x in loader.approx_lengths]}))
''')


def _write(root, records, *, layout="speculators-arrow", limit=None, fail=()):
    model = model_dir(root)
    inputs = jsonl(root / "d.jsonl", records)
    samples = scan(inputs)
    if limit is not None:
        samples = samples[:limit]
    todo = [s for s in samples if s.id not in fail]
    ds, _ = run(root / "out", todo, provenance(model, layout=layout), batch=2)
    return ds, inputs, todo


@needs_torch
@pytest.mark.parametrize("version", ["0.9.0", "0.6.0"])
def test_speculators_arrow_dataset_reads_the_arrow_layout(tmp_path, version):
    recs = random_records(9, seed=5)
    recs[3].pop("loss_mask")  # the Arrow row gets all ones, as speculators' preprocessing has
    ds, inputs, todo = _write(tmp_path, recs, fail={"s004"})  # a failed sample leaves no gap in the rows
    assert len(todo) == 8
    import json

    out = run_trainer_child(LOADER_CHILD, version,
                            [str(tmp_path / "out"), str(inputs), version, json.dumps([s.id for s in todo])])
    assert out["checked"] == 8
    assert out["approx_lengths"] == [s.num_tokens for s in todo]


@needs_torch
def test_arrow_layout_files_view_and_verify(tmp_path):
    import json

    import torch
    from safetensors.torch import load_file

    from speccompat.dataset import verify_dataset
    from speccompat.dataset.arrow_format import INFO_NAME

    recs = random_records(6, seed=2)
    ds, _inputs, todo = _write(tmp_path, recs)
    out = tmp_path / "out"
    assert verify_dataset(out) == ([], 6)
    info = json.loads((out / INFO_NAME).read_text())
    assert [r["id"] for r in info["rows"]] == [s.id for s in todo]
    assert info["target_layer_ids"] == [i + 1 for i in LAYERS[:-1]]
    assert [x["vllm_aux_id"] for x in info["layers"]] == [i + 1 for i in LAYERS]
    freq: dict[int, int] = {}
    for r, s in enumerate(todo):
        f = load_file(out / "hidden_states" / f"hs_{r}.safetensors")
        assert f["token_ids"].dtype == torch.int64 and f["token_ids"].tolist() == list(s.input_ids)
        assert torch.equal(f["hidden_states"], torch.stack(states(s), dim=1))
        assert f["hidden_states"].shape == (s.num_tokens, len(LAYERS), 8)
        for t, m in zip(s.input_ids, s.loss_mask, strict=True):
            if m:
                freq[t] = freq.get(t, 0) + 1
    assert torch.load(out / "token_freq.pt") == freq
    # a changed row, a stray hs file, a tampered hs file are found
    (out / "hidden_states" / "hs_99.safetensors").write_bytes(b"x")
    problems, _ = verify_dataset(out)
    assert problems == ["hidden_states/hs_99.safetensors: extra file (not a row of the view)"]


@needs_torch
def test_arrow_layout_resume_after_limit_renumbers_rows(tmp_path):
    from datasets import load_from_disk

    from speccompat.dataset import verify_dataset

    recs = random_records(7, seed=4)
    _write(tmp_path, recs, limit=3)
    assert len(load_from_disk(str(tmp_path / "out"))) == 3
    ds, _inputs, todo = _write(tmp_path, recs)  # resumes: 4 more, the rows are rebuilt in input order
    assert ds.done == 3 and len(ds.todo) == 4
    rows = load_from_disk(str(tmp_path / "out")).with_format(None)
    assert [r["input_ids"] for r in rows] == [list(s.input_ids) for s in todo]
    assert verify_dataset(tmp_path / "out") == ([], 7)


@needs_torch
def test_arrow_layout_overwrite_replaces_the_view_and_a_rerun_keeps_it(tmp_path):
    """--overwrite moves the old set aside, its ``hidden_states/`` folder and Arrow files included;
    a re-run with nothing to do leaves the view as it is (same inode of ``state.json``)."""
    from datasets import load_from_disk

    from speccompat.dataset import verify_dataset
    from speccompat.dataset.directory import TRASH_NAME

    recs = random_records(4, seed=5)
    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", recs))
    out = tmp_path / "out"
    run(out, samples, provenance(model, layout="speculators-arrow"))
    state = (out / "state.json").stat().st_ino
    ds, _ = run(out, samples, provenance(model, layout="speculators-arrow"))
    assert ds.done == 4 and not ds.todo and (out / "state.json").stat().st_ino == state
    ds, _ = run(out, samples, provenance(model, layout="speculators-arrow"), seed=1, overwrite=True)
    assert len(ds.todo) == 4 and not (out / TRASH_NAME).exists()
    rows = load_from_disk(str(out)).with_format(None)
    assert [r["input_ids"] for r in rows] == [list(s.input_ids) for s in samples]
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == [f"hs_{r}.safetensors" for r in range(4)]
    assert verify_dataset(out) == ([], 4)


def test_arrow_layout_refuses_layers_the_trainer_would_misread(tmp_path):
    from speccompat.dataset import Rejected, open_dataset

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(2)))
    with pytest.raises(Rejected, match="not the final decoder layer 5"):
        open_dataset(tmp_path / "a", samples, provenance(model, layout="speculators-arrow", layer_ids=[1, 2, 4]))
    with pytest.raises(Rejected, match="layer 2 follows layer 4"):
        open_dataset(tmp_path / "b", samples, provenance(model, layout="speculators-arrow", layer_ids=[1, 4, 2, 5]))
    assert not (tmp_path / "a" / "manifest.jsonl").exists()


def _same(a, b, layer_ids=LAYERS):
    import torch

    from speccompat.dataset.reader import HiddenStatesDataset

    x, y = HiddenStatesDataset(a), HiddenStatesDataset(b)
    assert len(x) == len(y) > 0
    for k in range(len(x)):
        p, q = x[k], y[k]
        assert p["id"] == q["id"] and torch.equal(p["input_ids"], q["input_ids"])
        ones = torch.ones_like(p["input_ids"])  # a layout that always stores a mask fills in ones
        pm = p["loss_mask"] if p["loss_mask"] is not None else ones
        qm = q["loss_mask"] if q["loss_mask"] is not None else ones
        assert torch.equal(pm, qm)
        assert p["layer_ids"] == q["layer_ids"] == list(layer_ids)
        assert all(torch.equal(u, v) for u, v in zip(p["hidden_states"], q["hidden_states"], strict=True))
    return len(x)


@needs_torch
def test_export_round_trip_safetensors_arrow_safetensors(tmp_path):
    import torch

    from speccompat.dataset.export import export_dataset
    from speccompat.dataset.reader import HiddenStatesDataset

    recs = random_records(8, seed=7)
    recs[1].pop("loss_mask")
    _ds, _inputs, todo = _write(tmp_path, recs, layout="safetensors")
    assert export_dataset(tmp_path / "out", "speculators-arrow", tmp_path / "arrow", progress=False) == []
    assert export_dataset(tmp_path / "arrow", "safetensors", tmp_path / "back", progress=False) == []
    assert _same(tmp_path / "out", tmp_path / "arrow") == 8
    assert _same(tmp_path / "out", tmp_path / "back") == 8
    # and against the generator's results, through the reader
    rd = HiddenStatesDataset(tmp_path / "arrow", layers=[2, 5])
    for k, s in enumerate(todo):
        item = rd[k]
        h = states(s)
        assert item["vllm_aux_ids"] == [3, 6]
        assert torch.equal(item["hidden_states"][0], h[1]) and torch.equal(item["hidden_states"][1], h[3])
    import json

    prov = json.loads((tmp_path / "back" / "manifest.jsonl").read_text().splitlines()[0])["provenance"]
    assert prov["exported_from"]["layout"] == "speculators-arrow" and prov["layout"] == "safetensors"


@needs_torch
def test_export_refuses_a_set_without_the_final_layer(tmp_path):
    from speccompat.dataset import Rejected
    from speccompat.dataset.export import export_dataset

    model = model_dir(tmp_path, layers=8)  # LAYERS end at 5: no final layer (7) for the verifier state
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(2)))
    run(tmp_path / "out", samples, provenance(model))
    with pytest.raises(Rejected, match="not the final decoder layer 7"):
        export_dataset(tmp_path / "out", "speculators-arrow", tmp_path / "arrow", progress=False)
    assert not (tmp_path / "arrow").exists()


@needs_torch
def test_arrow_layout_shards_then_merge_number_rows_in_input_order(tmp_path):
    import argparse

    from datasets import load_from_disk
    from support.shard_runs import run_shard

    from speccompat.dataset import verify_dataset
    from speccompat.dataset.shards import main as merge_main

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(9, seed=8)))
    prov = provenance(model, layout="speculators-arrow")
    for k in (1, 0):  # finishing in any order
        run_shard(tmp_path / "out", samples, prov, k, 2)
    assert not (tmp_path / "out" / "state.json").exists()  # no view before the merge
    args = argparse.Namespace(dir=tmp_path / "out", threads=2, no_verify=False, inputs=None, limit=None,
                              token_freq_path=None)
    assert merge_main(args) == 0
    rows = load_from_disk(str(tmp_path / "out")).with_format(None)
    assert [r["input_ids"] for r in rows] == [list(s.input_ids) for s in samples]
    assert verify_dataset(tmp_path / "out") == ([], 9)


@needs_torch
def test_export_speculators_04_to_arrow(tmp_path):
    """A ``data_<i>.pt`` set (speculators 0.3/0.4's layout) to the Arrow layout, tensor-equal."""
    from speccompat.dataset import open_dataset
    from speccompat.dataset.export import export_dataset

    model = model_dir(tmp_path)
    recs = random_records(6, seed=9)
    recs[0].pop("loss_mask")
    samples = scan(jsonl(tmp_path / "d.jsonl", recs))
    ds = open_dataset(tmp_path / "pt", samples, provenance(model, layout="speculators"))
    with ds.writer(threads=2) as w:  # the .pt files and manifest (data_config.json needs speculators itself)
        w.submit([ds.job(s, states(s)) for s in ds.todo])
    ds.lock.close()
    assert sorted(p.name for p in (tmp_path / "pt").glob("*.pt")) == [f"data_{i}.pt" for i in range(6)]
    assert export_dataset(tmp_path / "pt", "speculators-arrow", tmp_path / "arrow", progress=False) == []
    assert _same(tmp_path / "pt", tmp_path / "arrow") == 6


def test_arrow_layout_without_datasets_is_refused_before_any_engine(tmp_path, monkeypatch):
    import importlib.util

    from speccompat.dataset import Rejected, open_dataset

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(2)))
    with pytest.raises(Rejected, match=r"needs datasets: pip install 'speccompat\[arrow\]'"):
        open_dataset(tmp_path / "out", samples, provenance(model, layout="speculators-arrow"))
    assert not (tmp_path / "out" / "manifest.jsonl").exists()


@needs_torch
def test_export_records_the_layers_it_stores(tmp_path):
    """A source stored in layer order 1 4 2 5 becomes an Arrow set in order 1 2 4 5: the new
    provenance's whole ``hidden_states`` record (ids, serving ids of each layer, dtype) is that of
    the exported spec, as a run storing it would write, and each stored layer holds its own states."""
    import json

    import torch

    from speccompat.dataset.export import export_dataset
    from speccompat.dataset.provenance import hidden_states_record
    from speccompat.dataset.reader import HiddenStatesDataset
    from speccompat.dataset.spec import StoredSpec

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(3, seed=4)))
    run(tmp_path / "src", samples, provenance(model, layer_ids=[1, 4, 2, 5]))
    assert export_dataset(tmp_path / "src", "speculators-arrow", tmp_path / "arrow", dtype="float16",
                          progress=False) == []
    prov = json.loads((tmp_path / "arrow" / "manifest.jsonl").read_text().splitlines()[0])["provenance"]
    src = json.loads((tmp_path / "src" / "manifest.jsonl").read_text().splitlines()[0])["provenance"]
    spec = StoredSpec.of_provenance(prov)
    assert spec == StoredSpec("float16", (1, 2, 4, 5), src["model"]["hidden_size"])
    assert prov["hidden_states"] == hidden_states_record(spec)
    assert [(r["layer"], r["vllm_aux_id"]) for r in prov["hidden_states"]["layers"]] == [(1, 2), (2, 3), (4, 5), (5, 6)]
    rd = HiddenStatesDataset(tmp_path / "arrow")
    for k, s in enumerate(samples):  # states() gives layer ids 1 4 2 5 their tensors in that order
        h = states(s)
        for pos, stored in enumerate([0, 2, 1, 3]):
            assert torch.equal(rd[k]["hidden_states"][pos], h[stored].to(torch.float16))


@needs_torch
def test_two_builds_of_one_arrow_view_are_byte_identical(tmp_path, monkeypatch):
    pytest.importorskip("datasets", reason="the speculators-arrow layout")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(5, seed=6)))
    for name in ("a", "b"):
        run(tmp_path / name, samples, provenance(model, layout="speculators-arrow"), batch=2)

    def files(d):
        return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
                and not p.name.endswith(".lock")}

    a, b = files(tmp_path / "a"), files(tmp_path / "b")
    assert sorted(a) == sorted(b) and "state.json" in a
    assert [k for k in a if a[k] != b[k]] == []
