"""``speccompat serve`` on the real CPU engine: speculators 0.9.0's own ``ArrowDataset(on_missing=
"generate")`` (released wheel, fresh interpreter) against the server yields, row by row, the tensors
of the offline ``speccompat extract --format speculators-arrow`` set of the same samples (bf16 bit
for bit; fp8 bit for bit against the offline ``--dtype fp8`` set and within fp8's rounding of the
bf16 one), through hs-connectors 0.9.0's transfer of each backend (``FileTransfer``,
``FP8Transfer``, ``MooncakeTransfer`` with a real ``mooncake_master`` on loopback).

In the gate: the tiny Llama with the file backend (one extraction, one server), and on the same
server 24 concurrent clients of speculators' own async client. The rest of the matrix (fp8 and
mooncake, Kimi-K2.5's ``KimiK25ForConditionalGeneration`` for all three) is ``engine_full`` and
``serve_e2e`` (``nox -s serve_e2e``, which writes benchmarks/results/serve-e2e-cpu.json).
"""

from __future__ import annotations

import json
import os
import random
import textwrap
from pathlib import Path

import pytest
from conftest import ENGINE_ENV

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
    from trainer_wheels import run_trainer_child

    fp8_offline = backend == "fp8" and "fp8-offline" in extra
    offline = case.offline_set("fp8" if fp8_offline else "bfloat16")
    online = rows_only(offline, case.root / f"online-{tag}")
    out = case.root / f"compare-{tag}.json"
    paths = [str(MOONCAKE_DIR)] if backend == "mooncake" else []
    return run_trainer_child(COMPARE, "0.9.0", [server.url, backend, str(offline), str(online), str(out), *extra],
                             paths)


@pytest.mark.parametrize("kind", ["llama"])
def test_online_equals_offline_file_backend_and_concurrent_clients(cases, kind):
    """The gate's case: file backend, bit for bit; then speculators' own async client from 24
    concurrent tasks (80 requests), each answer its own prompt's states; the server exits 0 on
    SIGTERM and leaves no file behind."""
    case = cases(kind)
    hs = case.root / "hs-file"
    with ServerProcess(server_args(case, "file", hs), case.root / "serve-file.log", env=_env()) as server:
        got = compare(case, server, "file", "file")
        many = concurrent_clients(case, server, hs)
    assert got["rows"] == len(case.rows) and got["exact_rows"] == len(case.rows), got
    assert got["left_in_online_dir"] == [] and not list(hs.glob("speccompat-*")), "the trainer deleted every file"
    assert many["ok"] == many["requests"] == 80 and many["mismatched"] == 0, many
    assert server.returncode == 0, (case.root / "serve-file.log").read_text()[-3000:]
    assert json.loads((hs / "provenance.json").read_text())["provenance"]["hidden_states"]["layer_ids"] == LAYER_IDS
    record(f"{kind}-file", {**got, "concurrent": many, "server_start_s": round(server.started_s, 1)})


CONCURRENT = textwrap.dedent('''
    import asyncio, json, sys
    from pathlib import Path
    import openai, torch
    from safetensors.torch import load_file
    import_loader(Path(sys.argv[1]))
    from speculators.data_generation.vllm_client import generate_hidden_states_async
    url, rows, offline = sys.argv[2], json.loads(Path(sys.argv[3]).read_text()), Path(sys.argv[4])
    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
        model = (await client.models.list()).data[0].id
        sem, ok, bad = asyncio.Semaphore(24), 0, 0
        async def one(k):
            nonlocal ok, bad
            row = k % len(rows)
            async with sem:
                path, _ = await generate_hidden_states_async(client, model, {"input_ids": rows[row]})
            got, want = load_file(path), load_file(offline / "hidden_states" / f"hs_{row}.safetensors")
            Path(path).unlink()
            same = torch.equal(got["hidden_states"], want["hidden_states"]) and got["token_ids"].tolist() == rows[row]
            ok += same
            bad += not same
        await asyncio.gather(*(one(k) for k in range(80)))
        return {"requests": 80, "ok": ok, "mismatched": bad}
    print(json.dumps(asyncio.run(main())))
''')


def concurrent_clients(case: Case, server: ServerProcess, hs: Path) -> dict:
    from trainer_wheels import run_trainer_child

    rows = case.root / "rows.json"
    rows.write_text(json.dumps(case.rows))
    return run_trainer_child(CONCURRENT, "0.9.0", [server.url, str(rows), str(case.offline_set("bfloat16"))])


MATRIX = [("llama", "fp8"), ("llama", "mooncake"), ("kimi_k25", "file"), ("kimi_k25", "fp8"), ("kimi_k25", "mooncake")]


@pytest.mark.engine_full
@pytest.mark.serve_e2e
@pytest.mark.parametrize(("kind", "backend"), MATRIX, ids=[f"{k}-{b}" for k, b in MATRIX])
def test_online_equals_offline(cases, kind, backend, tmp_path):
    """The other backends and Kimi-K2.5 (its VLM wrapper, text prompts): every row bit for bit
    (fp8: against the offline fp8 set; within fp8's rounding of the bf16 set)."""
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
