"""``--layout speculators`` written by two shards and finished by the job's merge
(``finish_job``): the same files as one run, side files included (data_config.json,
sample_lengths.json, the token-frequency file), with fake results (no engine)."""

from __future__ import annotations

import json
import textwrap

from support.speculators_child import needs_speculators, run_with_speculators

CHILD = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import speccompat
    speccompat.apply()
    from support.dataset_fakes import jsonl, model_dir, random_records
    from support.dataset_runs import provenance, run, scan
    from support.shard_runs import run_shard
    from speccompat.dataset.shards import finish_job, find_parts
    root = Path(sys.argv[1])
    model = model_dir(root)
    data = jsonl(root / "data.jsonl", random_records(9, seed=4))
    samples = scan(data)
    prov = provenance(model, layout="speculators", status={"state": "armed", "vllm": {"raw": "0.32.0"},
                      "speculators": {"raw": sys.argv[3]}, "patches": []})
    run(root / "single", samples, prov, batch=2, speculators_version=sys.argv[3])
    for k in range(2):
        run_shard(root / "sharded", samples, prov, k, 2, command=f"drv.py --num-shards 2 --shard-index {k}")
    assert len(find_parts(root / "sharded")) == 2
    code = finish_job(root / "sharded", data, token_freq_path=root / "sharded.freq.pt")
    files = lambda d: {p.name: p.read_bytes().hex() for p in d.iterdir() if not p.name.startswith(".")}
    import torch
    from speculators.train.data import Eagle3SampleFileDataset
    loader = Eagle3SampleFileDataset(max_len=64, datapath=str(root / "sharded"), hidden_states_dtype=torch.bfloat16)
    lengths = {s.id: s.num_tokens for s in samples}
    print(json.dumps({"code": code, "single": files(root / "single"), "sharded": files(root / "sharded"),
                      "freq": [(root / "single.freq.pt").read_bytes() == (root / "sharded.freq.pt").read_bytes()],
                      "loaded": [len(loader), sorted(loader.approx_lengths) == sorted(lengths.values())]}))
''')


@needs_speculators
def test_sharded_speculators_layout_matches_one_run_side_files_included(tmp_path):
    out = run_with_speculators(CHILD, tmp_path, "0.4.0.1")
    assert out["code"] == 0
    single, sharded = out["single"], out["sharded"]
    assert {"data_config.json", "sample_lengths.json", "manifest.jsonl"} <= set(single)
    assert sorted(sharded) == sorted(single)
    for name in set(single) - {"data_config.json", "manifest.jsonl"}:
        assert sharded[name] == single[name], name
    # what made the set: one run's command, or the job's and the shards it was merged from
    merged = {"shards": 2, "commands": ["drv.py --num-shards 2"]}
    one, joined = (json.loads(bytes.fromhex(d["data_config.json"])) for d in (single, sharded))
    assert joined["reproducibility"].pop("merged_from") == merged and "merged_from" not in one["reproducibility"]
    assert joined["reproducibility"].pop("command") == "drv.py --num-shards 2"
    one["reproducibility"].pop("command")
    assert joined == one
    heads = [bytes.fromhex(d["manifest.jsonl"]).decode().split("\n", 1) for d in (single, sharded)]
    assert heads[0][1] == heads[1][1]  # the entries
    run = json.loads(heads[1][0])["run"]
    assert run["command"] == "drv.py --num-shards 2" and run["merged_from"] == merged
    assert out["freq"] == [True]
    assert out["loaded"] == [9, True]  # speculators 0.4's own loader reads the merged set (sample_lengths.json)


CHILD_MERGE_AND_LIMIT = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import speccompat
    speccompat.apply()
    from support.dataset_fakes import jsonl, model_dir, random_records
    from support.dataset_runs import provenance, run, scan
    from support.shard_runs import run_shard
    from speccompat.cli import main as cli_main
    root = Path(sys.argv[1])
    model = model_dir(root)
    data = jsonl(root / "data.jsonl", random_records(10, seed=5))
    samples = scan(data)
    prov = provenance(model, layout="speculators", status={"state": "armed", "vllm": {"raw": "0.32.0"},
                      "speculators": {"raw": sys.argv[3]}, "patches": []})
    extra = {"train_data_path": str(data)}
    run(root / "single", samples, prov, batch=2, speculators_version=sys.argv[3], extra=extra)
    side = lambda d: {p.name: p.read_bytes().hex() for p in d.iterdir()
                      if p.name in ("data_config.json", "sample_lengths.json")}
    full = side(root / "single")
    freq = (root / "single.freq.pt").read_bytes()
    # --limit 5 on the finished set: nothing to do, side files untouched
    run(root / "single", samples[:5], prov, batch=2, speculators_version=sys.argv[3],
        extra={**extra, "max_samples": 5})
    limited = side(root / "single")
    limited_freq = (root / "single.freq.pt").read_bytes() == freq
    # two shards joined by `speccompat merge` (the SLURM recipe)
    for k in range(2):
        run_shard(root / "sharded", samples, prov, k, 2)
    code = cli_main(["merge", str(root / "sharded"), "--inputs", str(data), "--token-freq-path",
                     str(root / "sharded.freq.pt")])
    merged = side(root / "sharded")
    merged_freq = (root / "sharded.freq.pt").read_bytes() == freq if (root / "sharded.freq.pt").exists() else None
    print(json.dumps({"code": code, "full": full, "limited": limited, "limited_freq": limited_freq,
                      "merged": merged, "merged_freq": merged_freq}))
''')


@needs_speculators
def test_merge_writes_the_side_files_of_one_run_and_a_limit_leaves_them_alone(tmp_path):
    out = run_with_speculators(CHILD_MERGE_AND_LIMIT, tmp_path, "0.4.0.1")
    assert set(out["full"]) == {"data_config.json", "sample_lengths.json"}
    assert len(json.loads(bytes.fromhex(out["full"]["sample_lengths.json"]))) == 10
    assert out["limited"] == out["full"] and out["limited_freq"] is True
    assert out["code"] == 0
    assert out["merged"]["sample_lengths.json"] == out["full"]["sample_lengths.json"] and out["merged_freq"] is True
    merged, full = (json.loads(bytes.fromhex(out[k]["data_config.json"])) for k in ("merged", "full"))
    assert merged["reproducibility"].pop("merged_from")["shards"] == 2
    assert merged == full  # the same command: the shards recorded this process's, which has no --shard-index
