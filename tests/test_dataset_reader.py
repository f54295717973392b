"""The reader (speccompat.dataset.reader.HiddenStatesDataset) on every layout, with a subset of layers."""

from __future__ import annotations

import pytest
from support.dataset_fakes import LAYERS, jsonl, model_dir, random_records, states
from support.dataset_runs import provenance, scan

torch = pytest.importorskip("torch", reason="the data set's writer")


def write(root, layout, samples, model):
    from speccompat.dataset import open_dataset

    ds = open_dataset(root / layout, samples, provenance(model, layout=layout))
    with ds.writer(threads=2) as w:  # the files and the manifest (the .pt layout's side files need speculators)
        w.submit([ds.job(s, states(s)) for s in ds.todo])
    ds.close()
    if layout == "speculators-arrow":
        ds.finish()
    return root / layout


@pytest.mark.parametrize("layers", [[2, 5], [5, 1], [4], None])
def test_the_reader_returns_the_same_tensors_on_every_layout(tmp_path, layers):
    from speccompat.dataset.reader import HiddenStatesDataset

    model = model_dir(tmp_path)
    recs = random_records(4, seed=2)
    recs[1].pop("loss_mask")
    samples = scan(jsonl(tmp_path / "d.jsonl", recs))
    layouts = ["safetensors", "speculators"]
    try:
        import datasets  # noqa: F401

        layouts.append("speculators-arrow")
    except ImportError:
        pass
    want = layers if layers is not None else LAYERS
    for layout in layouts:
        d = write(tmp_path, layout, samples, model)
        rd = HiddenStatesDataset(d, layers=layers)
        assert len(rd) == len(samples), layout
        for k, s in enumerate(samples):
            item = rd[k]
            h = dict(zip(LAYERS, states(s), strict=True))
            assert item["id"] == s.id and item["input_ids"].tolist() == list(s.input_ids), layout
            assert item["layer_ids"] == want and item["vllm_aux_ids"] == [i + 1 for i in want]
            assert len(item["hidden_states"]) == len(want), layout
            for i, t in zip(want, item["hidden_states"], strict=True):
                assert torch.equal(t, h[i]), (layout, i)
