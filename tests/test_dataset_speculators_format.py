"""``--layout speculators`` output read by speculators' own training data loader
(``speculators.train.data.Eagle3SampleFileDataset``) of 0.3.0 and 0.4.0.1, unchanged, with fake
results (no engine). Each version runs in its own process (one speculators per interpreter)."""

from __future__ import annotations

import textwrap

import pytest
from support.engine_env import ENGINE_ENV
from support.speculators_child import REPO, needs_speculators, run_child, run_with_speculators

CHILD = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import speccompat
    speccompat.apply()  # as the driver does: speculators' pydantic models need it on this stack
    import torch
    from support.dataset_fakes import LAYERS, jsonl, model_dir, random_records, states
    from support.dataset_runs import provenance, run, scan
    root = Path(sys.argv[1])
    model = model_dir(root)
    recs = random_records(7, seed=3)
    recs[2].pop("loss_mask")  # no mask: speculators' format has one anyway (all ones)
    samples = scan(jsonl(root / "d.jsonl", recs))
    prov = provenance(model, layout="speculators", status={"state": "armed", "vllm": {"raw": "0.32.0"},
                      "speculators": {"raw": sys.argv[3]}, "patches": []})
    from speccompat.dataset import open_dataset
    ds, _ = run(root / "out", samples, prov, batch=2, speculators_version=sys.argv[3])
    from speculators.train.data import Eagle3SampleFileDataset
    loader = Eagle3SampleFileDataset(max_len=64, datapath=str(root / "out"), hidden_states_dtype=torch.bfloat16)
    assert len(loader) == len(samples), len(loader)
    by_file = {str(p): k for k, p in enumerate(loader.data)}
    checked = 0
    for s in samples:
        item = loader[by_file[str(root / "out" / ds.files[s.id])]]
        h = states(s)
        mask = list(s.loss_mask) if s.loss_mask is not None else [1] * s.num_tokens
        assert item["input_ids"].tolist() == list(s.input_ids)[1:]
        assert item["loss_mask"].tolist() == mask[1:]
        assert torch.equal(item["hidden_states"], torch.cat(h[:-1], dim=-1)[:-1])
        assert torch.equal(item["verifier_last_hidden_states"], h[-1][1:])
        assert item["lengths"].tolist() == [s.num_tokens - 1]
        checked += 1
    order = {ds.files[s.id]: s.num_tokens for s in samples}
    print(json.dumps({"checked": checked, "approx_lengths": loader.approx_lengths,
                      "lengths": [order[Path(p).name] for p in loader.data],
                      "files": sorted(p.name for p in (root / "out").iterdir()),
                      "config": json.loads((root / "out" / "data_config.json").read_text()),
                      "freq": {str(k): v for k, v in torch.load(root / "out.freq.pt").items()}}))
''')


@needs_speculators
@pytest.mark.parametrize("version", ["0.3.0", "0.4.0.1"])
def test_speculators_loader_reads_the_speculators_layout(tmp_path, version):
    out = run_with_speculators(CHILD, tmp_path, version)
    assert out["checked"] == 7
    pt = sorted(f for f in out["files"] if f.endswith(".pt"))
    assert pt == sorted(f"data_{i}.pt" for i in range(7))
    cfg = out["config"]
    assert cfg["hidden_states"]["layer_ids"] == [1, 2, 4, 5] and cfg["data"]["num_samples"] == 7
    assert cfg["format"]["file_pattern"] == "data_{idx}.pt"
    if version == "0.3.0":
        assert "sample_lengths.json" not in out["files"] and cfg["format"]["data_format_version"] == 1
    else:
        assert "sample_lengths.json" in out["files"] and "data_format_version" not in cfg["format"]
        assert out["approx_lengths"] == out["lengths"]  # 0.4 reads sample_lengths.json: exact
    assert sum(out["freq"].values()) > 0


@needs_speculators
def test_speculators_generator_refuses_a_colliding_default_before_any_engine(tmp_path):
    """Under apply(), speculators' own VllmHiddenStatesGenerator(model) for a 6-layer model fails in
    its __init__ (speccompat's generator.__init__ patch), naming [2, 3, 3, 5], with no engine."""
    code = textwrap.dedent('''
        import sys, time
        sys.path.insert(0, sys.argv[2])
        import speccompat
        speccompat.apply()
        from support.dataset_fakes import model_dir
        from pathlib import Path
        from speculators.data_generation import VllmHiddenStatesGenerator
        model = model_dir(Path(sys.argv[1]))
        t = time.monotonic()
        try:
            VllmHiddenStatesGenerator(str(model))
        except ValueError as exc:
            print("REFUSED", round(time.monotonic() - t, 2), exc)
    ''')
    proc = run_child(code, [str(tmp_path), str(REPO / "tests")], ENGINE_ENV["speculators"]["0.4.0.1"])
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REFUSED")), None)
    assert line is not None, proc.stdout + proc.stderr[-3000:]
    assert "[2, 3, 3, 5]" in line and float(line.split()[1]) < 1.0, line
    assert "Initializing hidden states generator" not in proc.stderr  # speculators' __init__ never ran
