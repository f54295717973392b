"""``speccompat serve`` on the real CPU engine: speculators 0.9.0's own ``ArrowDataset(on_missing=
"generate")`` (released wheel, fresh interpreter) against the server yields, row by row, the tensors
of the offline ``speccompat extract --format speculators-arrow`` set of the same samples (bf16 bit
for bit; fp8 bit for bit against the offline ``--dtype fp8`` set and within fp8's rounding of the
bf16 one), through hs-connectors 0.9.0's transfer of each backend (``FileTransfer``,
``FP8Transfer``, ``MooncakeTransfer`` with a real ``mooncake_master`` on loopback).

In the gate (one engine start: the server): the tiny Llama with the file backend against the shared
pool engine's states (speculators' generator under speccompat, what the offline driver writes), and
on the same server 80 requests from 24 concurrent tasks of speculators' own async client. The matrix
against the offline sets (file, fp8 and mooncake on the Llama and on Kimi-K2.5's
``KimiK25ForConditionalGeneration``) is ``engine_full`` and ``serve_e2e`` (``nox -s serve_e2e``, which
writes benchmarks/results/serve-e2e-cpu.json).
"""

from __future__ import annotations

import json
import os
import random
import textwrap
from pathlib import Path

import pytest
from support.engine_env import ENGINE_ENV

from speccompat.testing.online import (
    COMPARE,
    MOONCAKE_DIR,
    ServerProcess,
    extract_offline,
    mooncake_master,
    mooncake_missing,
    rows_only,
)

from .conftest import skip_unless_model_runs
from .test_kimi_driver import _env, checkpoint_vocab, random_ids, write_jsonl

pytestmark = pytest.mark.engine

LAYER_IDS = [1, 2, 4, 5]  # ascending, the last the final layer of the 6-layer tiny models
MAX_SEQ_LEN = 255
RESULTS = os.environ.get("SPECCOMPAT_SERVE_E2E_OUT")
_RECORD: dict = {}


def record(key: str, value: dict) -> None:
    """Keep a case's figures; with SPECCOMPAT_SERVE_E2E_OUT, write them all (after every case)."""
    _RECORD[key] = value
    if RESULTS:
        import datetime
        import platform

        Path(RESULTS).parent.mkdir(parents=True, exist_ok=True)
        doc = {"vllm": ENGINE_ENV["vllm"], "vllm_dist": ENGINE_ENV["vllm_dist"], "date": datetime.date.today().isoformat(),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores", "layer_ids": LAYER_IDS,
               "command": "nox -s serve_e2e", "cases": _RECORD}
        Path(RESULTS).write_text(json.dumps(doc, indent=1) + "\n")


class Case:
    """One model's samples and offline sets (bf16, fp8), made once per model."""

    def __init__(self, root: Path, model: Path, kind: str) -> None:
        self.root, self.model, self.kind = root, model, kind
        _vocab, words = checkpoint_vocab(model)
        rng = random.Random(21)
        self.rows = [random_ids(rng, n, words) for n in (37, 120, 12, 200, 64, 5, 90, 255, 33, 150)]
        lines = [json.dumps({"id": f"r{k}", "input_ids": s, "loss_mask": [0] * 2 + [1] * (len(s) - 2)})
                 for k, s in enumerate(self.rows)]
        self.data = write_jsonl(root / "data.jsonl", lines)
        self.offline: dict[str, Path] = {}

    def offline_set(self, dtype: str) -> Path:
        if dtype not in self.offline:
            out = self.root / f"offline-{dtype}"
            extract_offline(self.model, self.data, out, LAYER_IDS, env=_env(), max_seq_len=MAX_SEQ_LEN, dtype=dtype,
                            log=self.root / f"extract-{dtype}.log")
            self.offline[dtype] = out
        return self.offline[dtype]


@pytest.fixture(scope="module")
def cases(engines, tmp_path_factory):
    pytest.importorskip("datasets", reason="--format speculators-arrow needs `datasets` (speccompat[arrow])")
    made: dict[str, Case] = {}

    def get(kind: str) -> Case:
        skip_unless_model_runs(kind)
        if kind not in made:
            made[kind] = Case(tmp_path_factory.mktemp(f"serve-{kind}"), engines.checkpoint(kind), kind)
        return made[kind]

    return get


def server_args(case: Case, backend: str, hs: Path, extra: list[str] = ()) -> list[str]:
    args = ["--model-path", str(case.model), "--layer-ids", *map(str, LAYER_IDS), "--backend", backend,
            "--max-model-len", str(MAX_SEQ_LEN + 1), "--gpu-memory-utilization", "0.1", *extra]
    return [*args, "--hidden-states-dir", str(hs)] if backend != "mooncake" else args


def compare(case: Case, server: ServerProcess, backend: str, tag: str, extra: list[str] = ()) -> dict:
    from support.trainer_wheels import run_trainer_child

    fp8_offline = backend == "fp8" and "fp8-offline" in extra
    offline = case.offline_set("fp8" if fp8_offline else "bfloat16")
    online = rows_only(offline, case.root / f"online-{tag}")
    out = case.root / f"compare-{tag}.json"
    paths = [str(MOONCAKE_DIR)] if backend == "mooncake" else []
    return run_trainer_child(COMPARE, "0.9.0", [server.url, backend, str(offline), str(online), str(out), *extra],
                             paths)


#: The gate's layers: the shared pool engine's (tests/engine/conftest.py LAYER_IDS), ascending, the last the final one
POOL_LAYERS = [0, 2, 4, 5]

GATE = textwrap.dedent('''
    import asyncio, json, sys
    from pathlib import Path
    import datasets, openai, torch
    data = import_loader(Path(sys.argv[1]))
    from hs_connectors.transfer import FileTransfer
    from speculators.data_generation.vllm_client import generate_hidden_states_async
    url, rows, want, work = sys.argv[2], json.loads(Path(sys.argv[3]).read_text()), torch.load(sys.argv[4]), Path(sys.argv[5])
    ds = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[0] * 2 + [1] * (len(r) - 2) for r in rows],
                                     "seq_len": [len(r) for r in rows]})
    ds.set_format("torch")
    ds.save_to_disk(str(work / "arrow"))
    # the trainer's dataset, every row generated online through hs-connectors' FileTransfer
    live = data.ArrowDataset(max_len=1 << 20, datapath=str(work / "arrow"), transfer=FileTransfer(work / "arrow" / "hidden_states"),
                             vllm_endpoint=url + "/v1", on_missing="generate")
    exact = 0
    for k, ids in enumerate(rows):
        item, hs = live[k], want[k]
        assert item["input_ids"].tolist() == ids and item["loss_mask"].tolist() == [0] * 2 + [1] * (len(ids) - 2), k
        exact += (torch.equal(item["hidden_states"], hs[:, :-1].flatten(1))
                  and torch.equal(item["verifier_last_hidden_states"], hs[:, -1]))
    # speculators' own async client from 24 concurrent tasks, 80 requests
    async def many():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
        model = (await client.models.list()).data[0].id
        sem, ok = asyncio.Semaphore(24), []
        async def one(k):
            row = k % len(rows)
            async with sem:
                path, _ = await generate_hidden_states_async(client, model, {"input_ids": rows[row]})
            got = FileTransfer(Path(path).parent).get_generated({"hidden_states_path": path})
            FileTransfer(Path(path).parent).delete(path)
            ok.append(torch.equal(got["hidden_states"], want[row]) and got["token_ids"].tolist() == rows[row])
        await asyncio.gather(*(one(k) for k in range(80)))
        return {"requests": 80, "ok": sum(ok), "mismatched": len(ok) - sum(ok)}
    print(json.dumps({"rows": len(rows), "exact_rows": exact, "concurrent": asyncio.run(many())}))
''')


@pytest.mark.pool(kind="llama")
def test_online_equals_the_generator_and_concurrent_clients(engines, tmp_path):
    """The gate's case (one server; the reference is the shared pool engine's, speculators' generator
    under speccompat, which the offline driver writes unchanged: test_arrow_driver): speculators
    0.9.0's ArrowDataset(on_missing="generate") through FileTransfer yields every row's states bit for
    bit; then 80 requests from 24 concurrent tasks of speculators' own generate_hidden_states_async,
    each answer its own prompt's states; the server exits 0 on SIGTERM and leaves no file behind."""
    import torch
    from support.trainer_wheels import run_trainer_child

    pytest.importorskip("datasets", reason="speculators' ArrowDataset needs `datasets` (speccompat[arrow])")
    model = engines.checkpoint("llama")
    _vocab, words = checkpoint_vocab(model)
    rng = random.Random(21)
    rows = [random_ids(rng, n, words) for n in (37, 120, 12, 200, 64, 5, 90, 255, 33, 150)]
    want = [torch.stack(r["hidden_states"], dim=1).to(torch.bfloat16)
            for r in engines.get("0.4.0.1", "llama").generate(rows)["results"]]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    torch.save(want, tmp_path / "want.pt")
    hs = tmp_path / "hs"
    args = ["--model-path", str(model), "--layer-ids", *map(str, POOL_LAYERS), "--backend", "file", "--hidden-states-dir",
            str(hs), "--max-model-len", str(MAX_SEQ_LEN + 1), "--gpu-memory-utilization", "0.1"]
    (tmp_path / "child").mkdir()
    with ServerProcess(args, tmp_path / "serve.log", env=_env()) as server:
        got = run_trainer_child(GATE, "0.9.0", [server.url, str(tmp_path / "rows.json"), str(tmp_path / "want.pt"),
                                                str(tmp_path / "child")])
    assert got["rows"] == len(rows) and got["exact_rows"] == len(rows), got
    assert got["concurrent"] == {"requests": 80, "ok": 80, "mismatched": 0}, got
    assert server.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert not list(hs.glob("speccompat-*")), "the trainer deleted every file"
    assert json.loads((hs / "provenance.json").read_text())["provenance"]["hidden_states"]["layer_ids"] == POOL_LAYERS


MATRIX = [("llama", "file"), ("llama", "fp8"), ("llama", "mooncake"), ("kimi_k25", "file"), ("kimi_k25", "fp8"), ("kimi_k25", "mooncake")]


@pytest.mark.engine_full
@pytest.mark.serve_e2e
@pytest.mark.parametrize(("kind", "backend"), MATRIX, ids=[f"{k}-{b}" for k, b in MATRIX])
def test_online_equals_offline(cases, kind, backend, tmp_path):
    """The three backends on Llama and Kimi-K2.5 (its VLM wrapper, text prompts): every row bit for bit
    against the offline set (fp8: against the offline fp8 set; within fp8's rounding of the bf16 set)."""
    case = cases(kind)
    if backend == "mooncake" and (why := mooncake_missing()):
        pytest.skip(why)
    hs = case.root / f"hs-{backend}"
    with contextlib_master(backend, case.root / "master.log") as master:
        extra = ["--mooncake-master", master[0], "--mooncake-metadata-server", master[1],
                 "--mooncake-global-segment-gib", "0.5", "--mooncake-local-buffer-gib", "0.25"] if master else []
        env = _env()
        if backend == "mooncake":
            env["PYTHONPATH"] = os.pathsep.join([str(MOONCAKE_DIR), env["PYTHONPATH"]])
        with ServerProcess(server_args(case, backend, hs, extra), case.root / f"serve-{backend}.log", env=env) as server:
            if backend == "fp8":
                exact = compare(case, server, "fp8", "fp8-vs-fp8", ["fp8-offline"])
                got = compare(case, server, "fp8", "fp8-vs-bf16")
            else:
                got = compare(case, server, backend, backend, list(master) if master else [])
    assert server.returncode == 0, (case.root / f"serve-{backend}.log").read_text()[-3000:]
    assert got["rows"] == len(case.rows), got
    if backend == "fp8":
        assert exact["exact_rows"] == len(case.rows), exact
        assert 0 < got["worst_rel"] < 0.04, got
        record(f"{kind}-{backend}", {"vs_offline_fp8": exact, "vs_offline_bf16": got})
    else:
        assert got["exact_rows"] == len(case.rows), got
        record(f"{kind}-{backend}", {**got, "server_start_s": round(server.started_s, 1)})
    if backend != "mooncake":
        assert not list(hs.glob("speccompat-*")), "the trainer deleted every file"


def contextlib_master(backend: str, log: Path):
    import contextlib

    return mooncake_master(log) if backend == "mooncake" else contextlib.nullcontext(None)
