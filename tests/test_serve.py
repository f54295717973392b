"""``speccompat serve`` with a fake engine (states a function of the token ids; tests/support/serve_fakes.py):
the HTTP exchange speculators 0.9.0's client expects (its own client functions, transfers and
``ArrowDataset`` from the released wheels, in a fresh interpreter), the three backends' layouts, the
batching of concurrent requests, the refusals and errors, handles deleted or expired, SIGTERM, and
a real ``mooncake_master`` on loopback. The real engine: tests/engine/test_serve.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="speccompat serve needs starlette and uvicorn (speccompat[serve])")
pytest.importorskip("uvicorn", reason="speccompat serve needs starlette and uvicorn (speccompat[serve])")
torch = pytest.importorskip("torch")

from support.dataset_fakes import HIDDEN, LAYERS, VOCAB, model_dir  # noqa: E402
from support.serve_fakes import (  # noqa: E402
    FATAL,
    MOONCAKE_DIR,
    POISON,
    REPO,
    FakeGen,
    ThreadServer,
    fake_states,
    get_json,
    mooncake_master,
    mooncake_missing,
    post_json,
)

#: the fake model has 6 layers: LAYERS [1, 2, 4, 5] ascend and end in the final one
ARGS = ["--layer-ids", *map(str, LAYERS), "--port", "0", "--max-model-len", "257", "--shutdown-grace", "0.5"]


def prompts(n: int, seed: int = 0, lo: int = 4, hi: int = 200) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB - 8) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def completion(url: str, ids, **extra):
    return post_json(f"{url}/v1/completions", {"model": extra.pop("model", None) or MODEL[0], "prompt": ids,
                                                "max_tokens": 1, "extra_body": None, "return_token_ids": True,
                                                **extra})


MODEL: list[str] = []


@pytest.fixture
def model(tmp_path):
    d = model_dir(tmp_path, max_position_embeddings=4096)
    MODEL[:] = [str(d)]
    return d


def test_file_backend_response_and_file(model, tmp_path):
    """The response speculators' ``extract_output`` reads, and the file vLLM's connector writes."""
    from safetensors import safe_open

    hs = tmp_path / "hs"
    with ThreadServer(["--model-path", str(model), *ARGS, "--backend", "file", "--hidden-states-dir", str(hs)]) as srv:
        ids = prompts(1)[0]
        status, body, _ = completion(srv.url, ids)
        assert status == 200, body
        assert body["object"] == "text_completion" and body["model"] == str(model)
        assert body["choices"][0]["prompt_token_ids"] == ids
        assert body["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids), "completion_tokens": 0,
                                 "prompt_tokens_details": None}
        path = Path(body["kv_transfer_params"]["hidden_states_path"])
        assert path.parent == hs.absolute() and path.name.endswith(".safetensors")
        with safe_open(str(path), framework="pt") as f:
            assert sorted(f.keys()) == ["hidden_states", "token_ids"] and f.metadata() is None
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        assert t["token_ids"].dtype == torch.int64 and t["token_ids"].tolist() == ids
        assert t["hidden_states"].dtype == torch.bfloat16 and list(t["hidden_states"].shape) == [len(ids), 4, HIDDEN]
        assert torch.equal(t["hidden_states"], torch.stack(fake_states(ids), dim=1))
        # without return_token_ids vLLM leaves prompt_token_ids out
        status, body, _ = completion(srv.url, ids, return_token_ids=False)
        assert status == 200 and body["choices"][0]["prompt_token_ids"] is None
        status, models = get_json(f"{srv.url}/v1/models")
        card = models["data"][0]
        assert status == 200 and card["id"] == str(model) and card["max_model_len"] == 257
        assert card["hidden_states"]["target_layer_ids"] == [2, 3, 5] and card["hidden_states"]["layer_ids"] == LAYERS
        assert get_json(f"{srv.url}/health")[0] == 200
    assert srv.code == 0
    prov = json.loads((hs / "provenance.json").read_text())["provenance"]
    assert prov["hidden_states"]["layer_ids"] == LAYERS and prov["layout"] == "speccompat-serve-file"
    assert prov["hidden_states"]["dtype"] == "bfloat16"  # the engine's dtype (config.json names none)
    assert not list(hs.glob("speccompat-*")), "unclaimed results are removed at shutdown"


def test_check_draft_reads_the_served_layers(model, tmp_path):
    """``speccompat check-draft DRAFT HS_DIR`` checks a draft against what the server stores."""
    from speccompat.dataset.check_draft import main as check_main
    from speccompat.serve.cli import check_settings, parse_args, write_provenance

    hs = tmp_path / "hs"
    hs.mkdir()
    args = parse_args(["--model-path", str(model), *ARGS, "--hidden-states-dir", str(hs)])
    info = check_settings(args)["info"]
    with pytest.raises(ValueError, match="names no dtype"):  # neither the engine nor config.json says it
        write_provenance(args, info, None)
    assert not (hs / "provenance.json").exists()
    write_provenance(args, info, None, FakeGen())
    draft = tmp_path / "draft"
    draft.mkdir()
    import argparse

    for ids, want in (([2, 3, 5], 0), ([1, 2, 4], 1)):
        (draft / "config.json").write_text(json.dumps({"architectures": ["Eagle3Speculator"],
                                                       "eagle_aux_hidden_state_layer_ids": ids}))
        ns = argparse.Namespace(draft=draft, dataset=hs, fix=False, vllm="0.32.0", num_hidden_layers=None)
        assert check_main(ns) == want, ids


LOADER = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    import torch, openai, datasets
    data = import_loader(Path(sys.argv[1]))
    from speculators.data_generation.vllm_client import generate_hidden_states
    from speculators.data_generation.offline import check_hidden_states
    from hs_connectors.transfer import FileTransfer, FP8Transfer, MooncakeTransfer
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
    from support.serve_fakes import fake_states
    specs, rows = json.loads(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
    out = []
    for spec in specs:
        url, backend, work = spec["url"], spec["backend"], Path(spec["work"])
        ds = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows],
                                         "seq_len": [len(r) for r in rows]})
        ds.set_format("torch")
        ds.save_to_disk(str(work / "arrow"))
        if backend == "mooncake":
            transfer = MooncakeTransfer(MooncakeHiddenStatesStore(MooncakeStoreConfig(
                local_hostname="127.0.0.1", metadata_server=spec["meta"], master_server_address=spec["master"],
                global_segment_size=64 << 20, local_buffer_size=64 << 20)))
        else:
            transfer = (FP8Transfer if backend == "fp8" else FileTransfer)(work / "arrow" / "hidden_states")
        # speculators' own client function, then its trainer's dataset generating every row online
        client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
        model = client.models.list().data[0].id
        transfer.setup()
        handle, params = generate_hidden_states(client, model, {"input_ids": rows[0]})
        first = transfer.get_generated(params)
        check_hidden_states(first, rows[0])
        transfer.delete(handle)
        loader = data.ArrowDataset(max_len=4096, datapath=str(work / "arrow"), transfer=transfer,
                                   vllm_endpoint=url + "/v1", on_missing="generate")
        worst = 0.0
        for k, ids in enumerate(rows):
            item = loader[k]
            want = torch.stack(fake_states(ids), dim=1)
            assert item["input_ids"].tolist() == ids, k
            got = torch.cat([item["hidden_states"].view(len(ids), -1, want.shape[-1]),
                             item["verifier_last_hidden_states"].unsqueeze(1)], dim=1)
            if backend == "fp8":
                worst = max(worst, float((got.float() - want.float()).norm() / want.float().norm()))
            else:
                assert torch.equal(got, want), k
        out.append({"backend": backend, "rows": len(rows), "model": model, "first_keys": sorted(first),
                    "worst_rel": worst, "handle": handle})
    print(json.dumps(out))
''')


def run_loader(specs: list[dict], rows, tmp_path, extra_path=()):
    """speculators 0.9.0's client and ArrowDataset against each server of ``specs`` (url, backend, and
    for mooncake master and meta), in one fresh interpreter."""
    from support.trainer_wheels import run_trainer_child

    rows_path = tmp_path / "rows.json"
    rows_path.write_text(json.dumps(rows))
    for k, spec in enumerate(specs):
        spec["work"] = str(tmp_path / f"child-{k}")
        Path(spec["work"]).mkdir()
    return run_trainer_child(LOADER, "0.9.0", [json.dumps(specs), str(rows_path)], list(extra_path))


def test_speculators_09_generates_online(model, tmp_path):
    """speculators 0.9.0's ``generate_hidden_states`` + hs-connectors' transfer, then its
    ``ArrowDataset(on_missing="generate")`` over 12 rows, against a file and an fp8 server: every
    row's states are the engine's (bf16 exact; fp8 within its rounding); the loader deletes every
    handle, so nothing is left."""
    rows = prompts(12, seed=4)
    argv = ["--model-path", str(model), *ARGS]
    with ThreadServer([*argv, "--backend", "file", "--hidden-states-dir", str(tmp_path / "hs-file")]) as f, \
            ThreadServer([*argv, "--backend", "fp8", "--hidden-states-dir", str(tmp_path / "hs-fp8")]) as q:
        out = run_loader([{"url": f.url, "backend": "file"}, {"url": q.url, "backend": "fp8"}], rows, tmp_path)
        left = sorted(p.name for d in ("hs-file", "hs-fp8") for p in (tmp_path / d).glob("speccompat-*"))
    assert [o["backend"] for o in out] == ["file", "fp8"]
    for o in out:
        assert o["rows"] == 12 and o["model"] == str(model)
        assert o["first_keys"] == ["hidden_states", "token_ids"]  # FP8Transfer drops the scales once applied
    assert out[0]["worst_rel"] == 0 and 0 < out[1]["worst_rel"] < 0.04, out
    assert left == [], left  # FileTransfer.delete unlinked every file


def test_chat_completions_through_the_chat_template(model, tmp_path):
    """``messages`` are rendered with the tokenizer's chat template (speculators sends
    ``add_generation_prompt`` false); the response carries ``prompt_token_ids`` at the top level and
    its states are those of the rendered ids; image parts are refused with one line."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from speccompat.testing.models import RECIPES, _write_tokenizer

    (model / "tokenizer.json").unlink()
    _write_tokenizer(model, RECIPES["llama"])
    messages = [{"role": "user", "content": "w10 w11 w12"}, {"role": "assistant", "content": "w40 w41"}]
    want = AutoTokenizer.from_pretrained(model).apply_chat_template(messages, tokenize=True, add_generation_prompt=False,
                                                                     return_dict=False)
    with ThreadServer(["--model-path", str(model), *ARGS, "--hidden-states-dir", str(tmp_path / "hs")]) as srv:
        url = f"{srv.url}/v1/chat/completions"
        status, body, _ = post_json(url, {"model": str(model), "messages": messages, "max_tokens": 1,
                                          "add_generation_prompt": False, "continue_final_message": False,
                                          "return_token_ids": True})
        image = post_json(url, {"model": str(model), "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
        t = load_file(body["kv_transfer_params"]["hidden_states_path"])
    assert status == 200 and body["object"] == "chat.completion", body
    assert body["prompt_token_ids"] == want and len(want) > 5
    assert t["token_ids"].tolist() == want and torch.equal(t["hidden_states"], torch.stack(fake_states(want), dim=1))
    assert image[0] == 400 and "only text content is served" in image[1]["error"]["message"]


OFFLINE_GENERATION = textwrap.dedent('''
    import asyncio, json, sys
    from pathlib import Path
    import datasets, torch
    from safetensors.torch import load_file
    import_loader(Path(sys.argv[1]))
    from speculators.cli.generate_offline_data import _generate_and_save_hidden_states
    from support.serve_fakes import fake_states
    url, rows, work = sys.argv[2], json.loads(Path(sys.argv[3]).read_text()), Path(sys.argv[4])
    ds = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows],
                                     "seq_len": [len(r) for r in rows]})
    ds.set_format("torch")
    ds.save_to_disk(str(work / "prepared"))
    asyncio.run(_generate_and_save_hidden_states(
        model=None, endpoint=url + "/v1", preprocessed_data=str(work / "prepared"), output=None, max_samples=None,
        concurrency=4, validate_outputs=True, request_timeout=60, max_retries=0, fail_on_error=True,
        max_consecutive_errors=None, world_size=1, rank=0))
    same = 0
    for k, ids in enumerate(rows):
        t = load_file(work / "prepared" / "hidden_states" / f"hs_{k}.safetensors")
        same += t["token_ids"].tolist() == ids and torch.equal(t["hidden_states"], torch.stack(fake_states(ids), dim=1))
    print(json.dumps({"rows": len(rows), "same": same}))
''')


def test_speculators_09_offline_generation(model, tmp_path):
    """speculators 0.9.0's own offline data generation (``generate_offline_data``'s loop, 4 concurrent
    workers, ``--validate-outputs``) against the server moves every file to ``hs_<row>.safetensors``
    with the row's states."""
    from support.trainer_wheels import run_trainer_child

    hs = tmp_path / "hs"
    rows = prompts(9, seed=10)
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "child").mkdir()
    with ThreadServer(["--model-path", str(model), *ARGS, "--hidden-states-dir", str(hs)]) as srv:
        out = run_trainer_child(OFFLINE_GENERATION, "0.9.0", [srv.url, str(tmp_path / "rows.json"),
                                                               str(tmp_path / "child")])
        left = list(hs.glob("speccompat-*"))
    assert out == {"rows": 9, "same": 9} and left == []


def test_fp8_file_layout(model, tmp_path):
    """The fp8 backend's file: FP8HiddenStatesConnector's tensors, speccompat.dataset.fp8's rule."""
    from safetensors.torch import load_file

    from speccompat.dataset import fp8

    hs = tmp_path / "hs"
    with ThreadServer(["--model-path", str(model), *ARGS, "--backend", "fp8", "--hidden-states-dir", str(hs)]) as srv:
        ids = prompts(1, seed=9)[0]
        status, body, _ = completion(srv.url, ids)
        t = load_file(body["kv_transfer_params"]["hidden_states_path"])
    assert status == 200
    assert sorted(t) == ["hidden_states", "hidden_states_scales", "token_ids"]
    assert t["hidden_states"].dtype == torch.float8_e4m3fn and list(t["hidden_states"].shape) == [len(ids), 4, HIDDEN]
    assert t["hidden_states_scales"].dtype == torch.float32 and list(t["hidden_states_scales"].shape) == [len(ids), 1, 1]
    values, scales = fp8.quantize(fake_states(ids), "token", stack=True)
    assert torch.equal(t["hidden_states"].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(t["hidden_states_scales"], scales)


def test_concurrent_clients_share_engine_steps(model, tmp_path):
    """32 clients at once: every answer is its own prompt's states, and the loop put several
    requests into one engine step."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file

    hs = tmp_path / "hs"
    rows = prompts(64, seed=5)
    with ThreadServer(["--model-path", str(model), *ARGS, "--hidden-states-dir", str(hs)], delay=0.05) as srv:
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda ids: completion(srv.url, ids), rows))
        for ids, (status, body, _) in zip(rows, answers, strict=True):
            assert status == 200, body
            t = load_file(body["kv_transfer_params"]["hidden_states_path"])
            assert t["token_ids"].tolist() == ids
            assert torch.equal(t["hidden_states"], torch.stack(fake_states(ids), dim=1))
        batches = list(srv.gen.batches)
    assert sum(batches) == 64 and max(batches) > 4, batches


BAD_REQUESTS = [
    ({"prompt": []}, 400, "prompt is empty"),
    ({}, 400, "prompt must be a list of token ids, got NoneType"),
    ({"prompt": [1, 2.5]}, 400, "prompt[1]: token id 2.5 is not an integer"),
    ({"prompt": [1, True]}, 400, "prompt[1]: token id True is not an integer"),
    ({"prompt": [1, VOCAB]}, 400, f"prompt[1]: token id {VOCAB} outside the vocabulary [0, {VOCAB})"),
    ({"prompt": [-1]}, 400, "outside the vocabulary"),
    ({"prompt": list(range(3, 260))}, 400, "maximum context length is 257 tokens. However, your request has 257 input"),
    ({"prompt": "some text"}, 400, "prompt is text: this server takes token ids"),
    ({"prompt": [[3, 4], [5]]}, 400, "2 prompts: one prompt per request"),
    ({"prompt": [3, 4], "model": "other"}, 404, "The model `other` does not exist."),
    ({"prompt": [3, 4], "max_tokens": 16}, 400, "send max_tokens=1"),
    ({"prompt": [3, 4], "stream": True}, 400, "send stream=false"),
    ({"prompt": [3, 4], "n": 2}, 400, "send n=1"),
]


def test_bad_requests_get_one_line(model, tmp_path):
    """Each bad request: its status and one line naming the problem; none reaches the engine, and the
    server goes on serving."""
    with ThreadServer(["--model-path", str(model), *ARGS, "--hidden-states-dir", str(tmp_path / "hs")]) as srv:
        answers = [post_json(f"{srv.url}/v1/completions", {"model": str(model), "max_tokens": 1} | payload)
                   for payload, _, _ in BAD_REQUESTS]
        ok, _, _ = completion(srv.url, [3, 4, 5])  # still serving
    for (payload, status, message), (got, body, _) in zip(BAD_REQUESTS, answers, strict=True):
        err = body["error"]
        assert got == status and message in err["message"] and "\n" not in err["message"], (payload, body)
        assert err["code"] == status and err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert ok == 200 and srv.gen.batches == [1]  # no bad request reached the engine


def test_http_errors(model, tmp_path):
    with ThreadServer(["--model-path", str(model), *ARGS, "--hidden-states-dir", str(tmp_path / "hs")]) as srv:
        assert post_json(f"{srv.url}/v1/completions", None, raw=b"{not json")[0] == 400
        assert post_json(f"{srv.url}/v1/completions", None, raw=b"[1, 2]")[1]["error"]["message"].startswith(
            "the request body must be a JSON object")
        status, body = get_json(f"{srv.url}/v1/nothing")
        assert (status, body["error"]["message"]) == (404, "no such path: /v1/nothing")
        status, body = get_json(f"{srv.url}/v1/completions")
        assert status == 405 and "method GET is not allowed" in body["error"]["message"]
        status, body, _ = post_json(f"{srv.url}/v1/chat/completions",
                                    {"model": str(model), "messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "chat template" in body["error"]["message"], body


def test_bad_states_fail_their_request_only(model, tmp_path):
    """A prompt whose states are non-finite fails alone (500); the requests of the same engine step
    are run again one at a time and answered; the server goes on."""
    from concurrent.futures import ThreadPoolExecutor

    rows = prompts(8, seed=6)
    rows[3] = rows[3][:5] + [POISON] + rows[3][5:]
    with ThreadServer(["--model-path", str(model), *ARGS, "--hidden-states-dir", str(tmp_path / "hs")],
                      delay=0.05) as srv:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda ids: completion(srv.url, ids), rows))
        after = completion(srv.url, rows[0])[0]
    codes = [a[0] for a in answers]
    assert codes == [200, 200, 200, 500, 200, 200, 200, 200] and after == 200, codes
    assert "non-finite" in answers[3][1]["error"]["message"]


def test_engine_failure_fails_in_flight_and_exits_1(model, tmp_path):
    """An engine failure: the requests in flight get 503, /health says so, the server exits 1."""
    with ThreadServer(["--model-path", str(model), *ARGS, "--hidden-states-dir", str(tmp_path / "hs")]) as srv:
        status, body, _ = completion(srv.url, [5, 6, FATAL])
        srv.thread.join(30)
    assert status == 503 and "the fake engine's worker died" in body["error"]["message"], body
    assert srv.code == 1


def test_unclaimed_results_expire(model, tmp_path):
    """A result nobody deletes is removed after --handle-ttl; one the client deletes is forgotten;
    while --max-stored-gb is exceeded new requests get 503 with Retry-After."""
    hs = tmp_path / "hs"
    with ThreadServer(["--model-path", str(model), *ARGS, "--hidden-states-dir", str(hs), "--handle-ttl", "1.5",
                       "--max-stored-gb", "0.0000001"]) as srv:
        first = completion(srv.url, [3, 4, 5, 6])
        busy = completion(srv.url, [3, 4, 5, 7])
        path = Path(first[1]["kv_transfer_params"]["hidden_states_path"])
        assert path.is_file()
        deadline = time.monotonic() + 10
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        expired = not path.exists()
        again = completion(srv.url, [3, 4, 5, 8])
        Path(again[1]["kv_transfer_params"]["hidden_states_path"]).unlink()  # the client deletes it
        time.sleep(2.5)
    assert first[0] == 200 and expired
    assert busy[0] == 503 and busy[2].get("retry-after") == "1" and "not yet claimed" in busy[1]["error"]["message"]
    assert again[0] == 200


@pytest.mark.parametrize(("extra", "message"), [
    (["--layer-ids", "1", "2", "4"], "is not the final decoder layer 5"),
    (["--layer-ids", "4", "2", "5"], "are not ascending"),
    (["--layer-ids", "1", "2", "9"], "outside the model's decoder layers"),
    (["--max-model-len", "99999"], "more than the model allows"),
    (["--backend", "fp8"], "--backend fp8 needs --hidden-states-dir"),
])
def test_refusals_before_anything_starts(model, tmp_path, extra, message):
    """Settings that cannot work: one line, exit 2, no engine started, nothing written."""
    code = subprocess.run([sys.executable, "-m", "speccompat", "serve", "--model-path", str(model), "--layer-ids", "1",
                           "2", "4", "5", "--max-model-len", "4096", "--port", "0", *extra],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert code.returncode == 2, code.stderr
    assert message in code.stderr and "Traceback" not in code.stderr, code.stderr
    assert "starting the engine" not in code.stderr and list(tmp_path.iterdir()) == [model.parent / "model"]


def test_port_in_use_is_refused(model, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "speccompat", "serve", "--model-path", str(model), "--layer-ids",
                               *map(str, LAYERS), "--port", str(port), "--hidden-states-dir", str(tmp_path / "hs")],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr


def test_help_documents_every_option_and_exit_status():
    proc = subprocess.run([sys.executable, "-m", "speccompat", "serve", "--help"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0
    import argparse

    from speccompat.serve.cli import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    for action in ap._actions:
        for flag in action.option_strings:
            assert flag in proc.stdout, flag
        if action.option_strings and action.dest != "help":
            assert action.help, action.option_strings
    for line in ("0 stopped by SIGTERM", "1 the engine did", "2 refused before anything started"):
        assert line in proc.stdout


def test_sigterm_finishes_requests_in_flight(model, tmp_path):
    """SIGTERM while requests are in flight: each is answered, then the server exits 0 and removes
    what nobody claimed; no new connection is taken."""
    from concurrent.futures import ThreadPoolExecutor

    hs = tmp_path / "hs"
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "support" / "serve_fakes.py"), "--model-path", str(model),
                             *ARGS, "--hidden-states-dir", str(hs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "FAKE_DELAY": "1.0", "PYTHONPATH": str(REPO)})
    try:
        line = ""
        while not line.startswith("serving "):
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
        url = line.split(" on ")[-1].strip()
        rows = prompts(6, seed=7)
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(completion, url, ids) for ids in rows]
            time.sleep(0.5)  # in the engine's first (1 s) step
            proc.send_signal(signal.SIGTERM)
            answers = [f.result() for f in futures]
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [a[0] for a in answers] == [200] * 6, answers
    assert code == 0, proc.stderr.read()
    assert not list(hs.glob("speccompat-*"))


MOONCAKE_WHY = mooncake_missing()


@pytest.mark.skipif(MOONCAKE_WHY is not None, reason=str(MOONCAKE_WHY))
def test_mooncake_backend_with_a_real_master(model, tmp_path, monkeypatch):
    """A real ``mooncake_master`` on loopback: speculators 0.9.0's ArrowDataset with hs-connectors'
    ``MooncakeTransfer`` reads every row's states bit-exact from the store and deletes each object;
    the manifest is hs-connectors' transfer manifest."""
    monkeypatch.syspath_prepend(str(MOONCAKE_DIR))  # the server's store client (the test process is the server)
    rows = prompts(10, seed=8)
    with mooncake_master(tmp_path / "master.log") as (master, meta):
        argv = ["--model-path", str(model), *ARGS, "--backend", "mooncake", "--mooncake-master", master,
                "--mooncake-metadata-server", meta, "--mooncake-global-segment-gib", "0.25",
                "--mooncake-local-buffer-gib", "0.125"]
        with ThreadServer(argv) as srv:
            assert srv.url, "the server did not start"
            status, body, _ = completion(srv.url, rows[0])
            (out,) = run_loader([{"url": srv.url, "backend": "mooncake", "master": master, "meta": meta}], rows,
                                tmp_path, extra_path=[str(MOONCAKE_DIR)])
    manifest = body["kv_transfer_params"]
    assert status == 200 and manifest["version"] == 1 and manifest["handle"].startswith("speccompat-")
    n = len(rows[0])
    assert manifest["tensors"]["hidden_states"] == {"shape": [n, 4, HIDDEN], "dtype": "torch.bfloat16",
                                                    "nbytes": n * 4 * HIDDEN * 2, "offset": 0}
    tok = manifest["tensors"]["token_ids"]
    assert tok["dtype"] == "torch.int64" and tok["offset"] % 64 == 0 and tok["offset"] >= n * 4 * HIDDEN * 2
    assert manifest["metadata"] == {"num_tokens": n, "total_aligned_bytes": -(-(tok["offset"] + 8 * n) // 64) * 64,
                                    "extract_mode": "prompt_only"}
    assert out["rows"] == 10


def test_the_server_imports_only_the_standard_library_at_module_level():
    """``speccompat serve`` loads starlette, uvicorn and torch only when it runs (vLLM's spawned workers
    re-import the command's modules); tests/test_walls.py keeps it in the data product's wing."""
    from speccompat.testing import layering

    ROOT = Path(__file__).resolve().parent.parent
    assert layering.floor_of("speccompat.serve") is not None
    files = list((ROOT / "speccompat" / "serve").glob("*.py"))
    assert len(files) >= 5
    top = [(f.name, name) for f in files for name, at_top in layering.imports(ROOT, f) if at_top
           and name.split(".")[0] not in set(sys.stdlib_module_names) | {"speccompat", "__future__"}]
    assert not top, f"module-level imports beyond the standard library: {top}"
