"""The adapter chain: discovery, version selection, documented changes, and each operation's
behaviour against stand-in vLLM callables (what each release expects)."""

from __future__ import annotations

import sys
import types

import pytest
from packaging.version import Version

from speccompat.adapter import Adapter, Change
from speccompat.errors import DriftError, HiddenStatesError
from speccompat.registry import adapter_modules, all_adapters, by_name, by_version


def test_modules_are_discovered_by_name_and_form_one_chain():
    adapters = all_adapters()
    assert [a.name() for a in adapters] == [m for _, m in adapter_modules()]
    assert adapters[0].__mro__[1] is Adapter
    for prev, cur in zip(adapters, adapters[1:], strict=False):
        assert cur.__mro__[1] is prev, f"{cur.name()} must subclass {prev.name()}"
        assert cur.since_version() > prev.since_version()
    for since, module in adapter_modules():
        assert module == "vllm_" + str(since).replace(".", "_")
        assert by_name(module).since == str(since)


def test_every_adapter_documents_the_changes_it_answers():
    for a in all_adapters():
        own = vars(a).get("changes", ())
        assert own, f"{a.name()} records no change"
        for c in own:
            assert isinstance(c, Change)
            assert all(getattr(c, f).strip() for f in Change._fields), f"{a.name()}: empty field in {c}"
            assert Version(c.vllm) >= a.since_version(), f"{a.name()} records a change of an older release"
        assert a.history()[-len(own):] == list(own)
        for sym in a.requires.values():
            assert ":" in sym.path


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.10.2", None),
        ("0.11.0", "vllm_0_11_0"),
        ("0.11.2", "vllm_0_11_1"),
        ("0.16.0", "vllm_0_12_0"),
        ("0.16.1.dev123+gabc1234", "vllm_0_12_0"),
        ("0.17.0.dev5", "vllm_0_17_0"),
        ("0.26.0", "vllm_0_17_0"),
        ("0.28.0", "vllm_0_28_0"),
        ("0.32.0", "vllm_0_29_0"),
        ("0.33.0", "vllm_0_33_0"),
        ("0.33.9", "vllm_0_33_0"),
        ("0.34.0", "vllm_0_34_0"),
        ("0.35.1", "vllm_0_34_0"),
    ],
)
def test_selection_by_version(version, expected):
    a = by_version(Version(version))
    assert (a.name() if a else None) == expected


def fn(**kw):
    return kw


def A(version):
    return by_version(Version(version))()


def test_cache_config_lets_the_platform_choose_the_block_size_and_turns_prefix_caching_off():
    for v in ("0.11.0", "0.32.0"):
        assert A(v).cache_config(fn, block_size=16, gpu_memory_utilization=0.5) == {
            "gpu_memory_utilization": 0.5, "enable_prefix_caching": False}


def test_cache_config_turns_the_extensible_kv_cache_off_from_0_34():
    assert "enable_extensible_kv_cache" not in A("0.33.0").cache_config(fn, gpu_memory_utilization=0.5)
    for asked in (None, True):  # whatever the caller passes, the hand-driven engine cannot extend it
        kw = {} if asked is None else {"enable_extensible_kv_cache": asked}
        assert A("0.34.0").cache_config(fn, block_size=16, gpu_memory_utilization=0.5, **kw) == {
            "gpu_memory_utilization": 0.5, "enable_prefix_caching": False, "enable_extensible_kv_cache": False}


def test_a_vllm_config_with_the_extensible_kv_cache_on_is_refused_from_0_34():
    pytest.importorskip("vllm", reason="the 0.28.0 adapter's vllm_config asks vLLM for the platform")
    def config(extensible):
        return lambda **kw: types.SimpleNamespace(cache_config=types.SimpleNamespace(
            enable_extensible_kv_cache=extensible), **kw)

    for resolved in (False, None):
        assert A("0.34.0").vllm_config(config(resolved), model_config=None).cache_config.enable_extensible_kv_cache is resolved
    with pytest.raises(DriftError, match="extensible KV cache on") as e:
        A("0.34.0").vllm_config(config(True), model_config=None)
    assert e.value.symbol == "vllm.config:CacheConfig.enable_extensible_kv_cache"
    # before 0.34 the field does not exist and nothing is checked
    assert A("0.33.0").vllm_config(config(True), model_config=None).cache_config.enable_extensible_kv_cache


def test_scheduler_config_is_encoder_decoder_and_async_scheduling():
    assert A("0.11.0").scheduler_config(fn, max_num_seqs=32, is_encoder_decoder=False) == {
        "max_num_seqs": 32, "async_scheduling": False}
    for v in ("0.11.1", "0.12.0", "0.32.0"):
        assert A(v).scheduler_config(fn, max_num_seqs=32) == {
            "max_num_seqs": 32, "is_encoder_decoder": False, "async_scheduling": False}


@pytest.mark.parametrize(("device", "asynchronous"), [("cuda", True), ("cpu", False)])
def test_scheduler_config_turns_the_workers_asynchronous_on_cuda_from_0_33(monkeypatch, device, asynchronous):
    module = sys.modules[type(A("0.33.0")).__module__]
    monkeypatch.setattr(module, "device_kind", lambda: device)
    assert A("0.33.0").scheduler_config(fn, max_num_seqs=32) == {
        "max_num_seqs": 32, "is_encoder_decoder": False, "async_scheduling": asynchronous}
    # The caller's own choice does not survive: the adapter decides what the workers run.
    assert A("0.33.0").scheduler_config(fn, max_num_seqs=32, async_scheduling=not asynchronous)["async_scheduling"] is asynchronous


class Group:
    def __init__(self, names, block_size):
        self.layer_names = names
        self.kv_cache_spec = type("Spec", (), {"block_size": block_size})()


class KVConfig:
    def __init__(self, groups):
        self.kv_cache_groups = groups


class CacheCfg:
    block_size = 16
    kv_cache_layout = "NHD"


class VllmCfg:
    def __init__(self):
        self.cache_config = CacheCfg()


def test_kv_cache_config_from_groups_specs_argument_per_release():
    groups = [Group(["l0", "l1"], 16), Group(["l2"], 16)]
    got = A("0.11.2").kv_cache_config_from_groups(fn, vllm_config=None, kv_cache_groups=groups, available_memory=1)
    assert set(got["kv_cache_specs"]) == {"l0", "l1", "l2"}
    assert got["kv_cache_specs"]["l2"] is groups[1].kv_cache_spec
    got = A("0.12.0").kv_cache_config_from_groups(fn, vllm_config=None, kv_cache_groups=groups,
                                                  available_memory=1, kv_cache_specs={"x": 1})
    assert "kv_cache_specs" not in got


def test_kv_cache_layout_travels_with_the_config_from_0_29():
    class Out:
        kv_cache_layout = None

    out = A("0.29.0").kv_cache_config_from_groups(lambda **kw: Out(), vllm_config=VllmCfg(), kv_cache_groups=[],
                                                  available_memory=1)
    assert out.kv_cache_layout == "NHD"


def test_scheduler_uses_the_block_size_the_workers_built():
    cfg = VllmCfg()
    kv = KVConfig([Group(["a"], 128)])
    assert A("0.11.0").scheduler(fn, vllm_config=cfg, kv_cache_config=kv, structured_output_manager=1,
                                 block_size=16) == {"vllm_config": cfg, "kv_cache_config": kv,
                                                    "structured_output_manager": 1}
    got = A("0.32.0").scheduler(fn, vllm_config=cfg, kv_cache_config=kv, structured_output_manager=1, block_size=16)
    assert got["block_size"] == 128 and cfg.cache_config.block_size == 128


def test_request_drops_eos_token_id_from_0_17():
    kw = {"request_id": "r", "eos_token_id": 2}
    assert A("0.16.0").request(fn, **kw) == kw
    assert A("0.17.0").request(fn, **kw) == {"request_id": "r"}


def test_unique_reply_shapes():
    assert A("0.11.0").unique_reply([{"a": 1}]) == {"a": 1}
    with pytest.raises(DriftError, match="one-element list"):
        A("0.11.0").unique_reply({"a": 1})
    assert A("0.11.1").unique_reply({"a": 1}) == {"a": 1}
    with pytest.raises(DriftError, match="returned a list"):
        A("0.11.1").unique_reply([{"a": 1}])


class Exec:
    """An executor whose replies come in order; ``result()`` of a later reply collects the earlier."""

    def __init__(self, first, sampled="sampled", fail=None):
        self.first, self.sampled, self.fail, self.calls = first, sampled, fail, []

    def _reply(self, name, value, non_block):
        self.calls.append((name, non_block))

        def result():
            self.calls.append(("reply", name))
            if self.fail == name:
                raise RuntimeError(f"Worker failed with error in {name}")
            return value

        return types.SimpleNamespace(result=result) if non_block else result()

    def execute_model(self, so, non_block=False):
        return self._reply("execute", self.first, non_block)

    def sample_tokens(self, grammar, non_block=False):
        assert grammar is None
        return self._reply("sample", self.sampled, non_block)

    def compile_or_warm_up_model(self):
        self.calls.append("warmup")


SO = types.SimpleNamespace(total_num_scheduled_tokens=5)


@pytest.fixture
def gpu(monkeypatch):
    """vLLM's platform as the adapters see it: a GPU (``current_platform.is_cpu()`` False)."""
    mod = types.ModuleType("vllm.platforms")
    mod.current_platform = types.SimpleNamespace(is_cpu=lambda: False)
    monkeypatch.setitem(sys.modules, "vllm.platforms", mod)
    return mod


def test_two_steps_in_flight_on_a_gpu_one_on_a_cpu(gpu):
    assert A("0.11.0").in_flight(Exec(None)) == 1  # one-phase execution: no sample_tokens future
    assert A("0.11.1").in_flight(Exec(None)) == A("0.33.0").in_flight(Exec(None)) == 2
    gpu.current_platform.is_cpu = lambda: True
    assert A("0.24.0").in_flight(Exec(None)) == 1


def test_execution_is_two_phase_from_0_11_1_and_both_phases_are_sent_before_either_reply():
    e = Exec(first="output")
    assert A("0.11.0").submit(e, SO).result() == "output" and e.calls == [("execute", False), ("reply", "execute")]
    e = Exec(first=None)
    fut = A("0.11.1").submit(e, SO)
    assert e.calls == [("execute", True), ("sample", True)]  # nothing waited for yet
    assert fut.result() == "sampled"
    e = Exec(first="early")  # an output from execute_model itself: the sampling phase had nothing to do
    assert A("0.20.0").submit(e, SO).result() == "early"
    e = Exec(first=None)  # a step without tokens only carries finished ids: no sampling phase
    assert A("0.33.0").submit(e, types.SimpleNamespace(total_num_scheduled_tokens=0)).result() is None
    assert e.calls == [("execute", True), ("reply", "execute")]


def test_a_worker_error_in_execute_model_is_the_one_raised_and_both_replies_are_collected():
    e = Exec(first=None, sampled=None, fail="execute")
    with pytest.raises(RuntimeError, match="error in execute"):
        A("0.24.0").submit(e, SO).result()
    assert e.calls[2:] == [("reply", "sample"), ("reply", "execute")]
    e = Exec(first=None, sampled=None)
    with pytest.raises(HiddenStatesError, match="no model output"):
        A("0.24.0").submit(e, SO).result()


def test_warm_up_is_the_drivers_job_from_0_27():
    e = Exec(None)
    A("0.26.0").after_kv_cache_init(e)
    assert e.calls == []
    A("0.27.0").after_kv_cache_init(e)
    assert e.calls == ["warmup"]


def test_moved_names():
    assert A("0.11.0").moved_names() == {("vllm.utils.hashing", "get_hash_fn_by_name"): "vllm.utils"}
    for v in ("0.11.1", "0.32.0"):
        assert A(v).moved_names() == {}
    moved = A("0.33.0").moved_names()
    assert set(moved.values()) == {"vllm.v1.core.kv_cache_planning"}
    assert ("vllm.v1.core.kv_cache_utils", "get_kv_cache_config_from_groups") in moved
