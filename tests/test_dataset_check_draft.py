"""Layer numbering (speccompat layer i = output of decoder layer i = vLLM aux id i+1), the trainer
flags derived from it, and ``speccompat check-draft`` on drafts whose config.json is built by
speculators 0.4.0.1 and 0.9.0 write them, read back by vLLM's own config code."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from packaging.version import Version
from support.dataset_fakes import jsonl, model_dir, random_records
from support.dataset_runs import needs_torch, provenance, run, scan

from speccompat.cli import main as cli
from speccompat.layers import (
    LayerIdsError,
    describe_for_training,
    layer_records,
    speculators_default,
    training_layers,
    vllm_default_aux_ids,
)

KIMI_LAYERS = 61  # Kimi-K2.5's text model
KIMI_IDS = [2, 30, 58, 60]  # speculators 0.3/0.4's default [2, L//2, L-3, L-1] for it

# ---------------------------------------------------------------------------------------------
# numbering and trainer flags
# ---------------------------------------------------------------------------------------------


def test_kimi_layers_give_aux_ids_shifted_by_one_and_the_final_layer_as_verifier_state():
    assert speculators_default(KIMI_LAYERS) == KIMI_IDS
    t = training_layers(KIMI_IDS, KIMI_LAYERS)
    assert t.input_layers == (2, 30, 58) and t.aux_ids == (3, 31, 59) and t.verifier_layer == 60
    assert t.target_layer_ids_flag() == ["--target-layer-ids", "3", "31", "59"]
    assert t.draft_config() == {"eagle_aux_hidden_state_layer_ids": [3, 31, 59]}
    # vLLM's default for a draft without ids: (2, L//2, L-3) = outputs of layers 1 29 57, one off
    assert vllm_default_aux_ids(KIMI_LAYERS) == (2, 30, 58) != t.aux_ids
    assert layer_records([2, 60]) == [{"layer": 2, "meaning": "output of decoder layer 2", "vllm_aux_id": 3},
                                      {"layer": 60, "meaning": "output of decoder layer 60", "vllm_aux_id": 61}]
    text = describe_for_training(KIMI_IDS, KIMI_LAYERS, "hs/")
    assert "vLLM aux id i+1: 3 31 59 61" in text and "verifier state: layer 60" in text
    assert "speculators >= 0.5: train with --target-layer-ids 3 31 59" in text
    assert '{"eagle_aux_hidden_state_layer_ids": [3, 31, 59]}' in text and "check-draft DRAFT_DIR hs/ --fix" in text
    assert "default aux ids 2 30 58 = outputs of layers 1 29 57" in text


@pytest.mark.parametrize("ids, needle", [
    ([2, 30, 58], "not the final decoder layer 60 (not stored)"),
    ([2, 60, 30], "not the final decoder layer 60 (stored at position 1)"),
    ([30, 2, 58, 60], "not ascending; the trainers concatenate them in stored order, vLLM serves them in "
                      "ascending order [2, 30, 58]"),
    ([60], "at least one input layer"),
    ([2, 61], "outside the model's decoder layers"),
])
def test_layers_no_trainer_can_serve_are_refused_naming_why(ids, needle):
    with pytest.raises(LayerIdsError, match=None) as err:
        training_layers(ids, KIMI_LAYERS)
    assert needle in str(err.value)
    if len(ids) > 1 and max(ids) < KIMI_LAYERS:
        assert needle in describe_for_training(ids, KIMI_LAYERS)  # the driver prints why instead of flags


def test_vllm_default_is_vllms_own():
    """Against vLLM 0.32.0's ``SupportsEagle3.get_eagle3_default_aux_hidden_state_layers`` itself."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.model_executor.models.interfaces import SupportsEagle3

    for layers in (6, 32, 61, 94):
        stub = SimpleNamespace(model=SimpleNamespace(layers=[None] * layers))
        assert SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(stub) == vllm_default_aux_ids(layers)


def test_provenance_records_each_layer_and_older_data_sets_still_resume(tmp_path):
    from speccompat.dataset.provenance import differences

    prov = provenance(model_dir(tmp_path, layers=KIMI_LAYERS), layer_ids=KIMI_IDS)
    assert prov["hidden_states"]["layers"] == layer_records(KIMI_IDS)
    assert [r["vllm_aux_id"] for r in prov["hidden_states"]["layers"]] == [3, 31, 59, 61]
    older = json.loads(json.dumps(prov))
    del older["hidden_states"]["layers"]  # written before the record existed
    assert differences(older, prov) == []
    other = json.loads(json.dumps(prov))
    other["hidden_states"]["layer_ids"] = [2, 30, 57, 60]
    assert differences(other, prov) == ["hidden_states.layer_ids: [2, 30, 57, 60] -> [2, 30, 58, 60]"]


# ---------------------------------------------------------------------------------------------
# check-draft
# ---------------------------------------------------------------------------------------------

#: A draft config.json as speculators 0.4.0.1's trainer saves it. Its own classes do not build on this
#: environment's transformers 5 (``Eagle3SpeculatorConfig(...)`` fails in ``PretrainedConfig.__init__``:
#: no ``__pydantic_fields_set__``), so the fields are written out from its sources:
#: ``Eagle3DraftModel.from_training_args`` (``speculators/models/eagle3/core.py:518-535``) sets
#: ``transformer_layer_config`` (the verifier's config), ``draft_vocab_size``, ``norm_before_residual``,
#: ``embed_requires_grad`` and ``speculators_config`` (``SpeculatorsConfig``, ``VerifierConfig.from_config``:
#: ``speculators/config.py:81-122``, ``GreedyTokenProposalConfig``: ``proposals/greedy.py:38-51``) and never
#: ``eagle_aux_hidden_state_layer_ids``, which ``to_dict`` (``config.py:296-322``, every pydantic field)
#: writes as null (``models/eagle3/config.py:53``: default None).
V04_DRAFT = {
    "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.4.0.1",
    "draft_vocab_size": 256, "norm_before_residual": True, "target_hidden_size": None,
    "eagle_aux_hidden_state_layer_ids": None, "embed_requires_grad": False, "torch_dtype": "bfloat16",
    "transformer_layer_config": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                 "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
                                 "num_hidden_layers": 1, "vocab_size": 512, "rms_norm_eps": 1e-5},
    "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                           "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                 "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                           "verifier": {"name_or_path": "/models/verifier", "architectures": ["LlamaForCausalLM"]}},
}
#: speculators 0.9.0 saves the same class with the field set from ``--target-layer-ids``
#: (0.9.0 ``speculators/models/eagle3/core.py:391-409``, top level: ``models/eagle3/config.py:53``) and
#: three more norm switches.
V09_EXTRA = {"speculators_version": "0.9.0", "norm_before_fc": False, "fc_norm": False, "norm_output": False}


@pytest.fixture
def drafts(tmp_path):
    out = {}
    for name, cfg in (("v04", V04_DRAFT),
                      ("v09_right", {**V04_DRAFT, **V09_EXTRA, "eagle_aux_hidden_state_layer_ids": [3, 31, 59]}),
                      ("v09_wrong", {**V04_DRAFT, **V09_EXTRA, "eagle_aux_hidden_state_layer_ids": [2, 30, 58]})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        out[name] = tmp_path / name
    return out


@pytest.fixture
def dataset(tmp_path):
    """A Kimi-shaped data set (61 layers, speculators' default ids) written by speccompat's writer."""
    model = model_dir(tmp_path, layers=KIMI_LAYERS)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(3, seed=5)))
    run(tmp_path / "ds", samples, provenance(model, layer_ids=KIMI_IDS))
    return tmp_path / "ds"


def vllm_served(draft: Path) -> tuple[int, ...]:
    """What vLLM 0.32.0 serves the draft: its own config loader (``SpeculatorsConfig``) and aux-id
    resolution (the v1 runner's, which the CPU runner inherits, and the v2 runner's: they must
    agree), else its model default."""
    from types import SimpleNamespace

    from vllm.model_executor.models.interfaces import SupportsEagle3
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    hf = SpeculatorsConfig.from_pretrained(str(draft))
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
    ids = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
    assert ids == get_eagle3_aux_layers_from_config(spec)
    if not ids:
        ids = SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(
            SimpleNamespace(model=SimpleNamespace(layers=[None] * KIMI_LAYERS)))
    return tuple(sorted(set(ids)))


@needs_torch
def test_a_04_draft_is_reported_and_fixed_and_vllm_then_serves_its_layers(drafts, dataset, tmp_path, capsys):
    from speccompat.dataset.check_draft import check_draft

    draft = drafts["v04"]
    original = (draft / "config.json").read_bytes()
    check = check_draft(draft, dataset)
    assert check.served.aux_ids == (2, 30, 58) and check.trained.aux_ids == (3, 31, 59)
    if importlib.util.find_spec("vllm"):
        assert vllm_served(draft) == check.served.aux_ids  # vLLM itself agrees: its default
    assert cli(["check-draft", str(draft), str(dataset)]) == 1
    out = capsys.readouterr().out
    assert ("MISMATCH: trained on the outputs of layers 2 30 58 (vLLM aux ids 3 31 59); vLLM serves aux ids "
            "2 30 58 = outputs of layers 1 29 57 (from vLLM's default (2, L//2, L-3) for L=61") in out
    assert (draft / "config.json").read_bytes() == original and not (draft / "config.json.bak").exists()

    assert cli(["check-draft", str(draft), str(dataset), "--fix"]) == 0
    out = capsys.readouterr().out
    assert "fixed:" in out and out.rstrip().endswith("consistent: vLLM serves the draft the layers it was trained on")
    assert (draft / "config.json.bak").read_bytes() == original
    fixed, before = json.loads((draft / "config.json").read_text()), json.loads(original)
    assert fixed.pop("eagle_aux_hidden_state_layer_ids") == [3, 31, 59]
    before.pop("eagle_aux_hidden_state_layer_ids", None)
    assert fixed == before  # nothing else changed
    assert not list(draft.glob("*.partial"))
    if importlib.util.find_spec("vllm"):
        assert vllm_served(draft) == (3, 31, 59)
    assert cli(["check-draft", str(draft), str(dataset)]) == 0
    # a second fix of another draft over an existing, different backup keeps both originals
    (draft / "config.json").write_bytes((drafts["v09_wrong"] / "config.json").read_bytes())
    assert cli(["check-draft", str(draft), str(dataset), "--fix"]) == 0
    baks = sorted(p.name for p in draft.iterdir() if p.name.startswith("config.json.bak"))
    assert len(baks) == 2 and (draft / "config.json.bak").read_bytes() == original


@needs_torch
def test_a_09_style_draft_with_the_right_ids_is_consistent_and_wrong_ids_are_named(drafts, dataset, capsys):
    if importlib.util.find_spec("vllm"):
        assert vllm_served(drafts["v09_right"]) == (3, 31, 59)
        assert vllm_served(drafts["v09_wrong"]) == (2, 30, 58)
    assert cli(["check-draft", str(drafts["v09_right"]), str(dataset)]) == 0
    assert "consistent" in capsys.readouterr().out
    before = (drafts["v09_wrong"] / "config.json").read_bytes()
    assert cli(["check-draft", str(drafts["v09_wrong"] / "config.json"), str(dataset)]) == 1
    assert ("vLLM serves aux ids 2 30 58 = outputs of layers 1 29 57 (from eagle_aux_hidden_state_layer_ids)"
            in capsys.readouterr().out)
    assert (drafts["v09_wrong"] / "config.json").read_bytes() == before  # no --fix: untouched


def test_served_ids_follow_vllms_lookup_order():
    from speccompat.dataset.check_draft import served_aux_ids

    ids = "eagle_aux_hidden_state_layer_ids"
    spec = {"speculators_model_type": "eagle3", "transformer_layer_config": {"model_type": "llama"}}
    assert served_aux_ids(spec, 61).aux_ids == (2, 30, 58)
    assert served_aux_ids({**spec, ids: [59, 3, 31]}, 61).aux_ids == (3, 31, 59)  # captured ascending
    nested = {**spec, "transformer_layer_config": {ids: [4, 5, 6]}}
    assert served_aux_ids(nested, 61).source == f"transformer_layer_config.{ids}"
    assert served_aux_ids({**nested, ids: [7, 8, 9]}, 61).aux_ids == (7, 8, 9)  # top level wins
    plain = {"model_type": "llama", "eagle_config": {ids: [3, 31, 59]}}
    assert served_aux_ids(plain, 61).aux_ids == (3, 31, 59)
    dflash = {"dflash_config": {"target_layer_ids": [2, 30]}}
    assert served_aux_ids(dflash, 61).aux_ids == (3, 31)
    both = {**dflash, "eagle_config": {"other": 1}}  # a non-empty eagle_config decides, even without ids
    assert served_aux_ids(both, 61).aux_ids == (2, 30, 58)
    if importlib.util.find_spec("vllm") is None:
        return
    from types import SimpleNamespace

    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for cfg in (spec, {**spec, ids: [59, 3, 31]}, nested, {**nested, ids: [7, 8, 9]}, plain, dflash, both):
        hf = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(cfg))) \
            if "speculators_model_type" in cfg else cfg
        runner = SimpleNamespace(speculative_config=SimpleNamespace(
            draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf))))
        theirs = GPUModelRunner._get_eagle3_aux_layers_from_config(runner) or vllm_default_aux_ids(61)
        assert served_aux_ids(cfg, 61).aux_ids == tuple(sorted(set(theirs))), cfg


def ids_unset_draft(tmp_path: Path) -> Path:
    """A draft whose config.json leaves the aux layer ids unset (as speculators 0.4's trainer does)."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3",
                                                  "transformer_layer_config": {"model_type": "llama"}}))
    return draft


def test_data_config_of_a_speculators_made_data_set_and_bad_input(tmp_path, capsys):
    """A data set made by speculators' own script has only ``data_config.json`` (fields as
    ``DataGenerationConfig`` writes them, speccompat/dataset/speculators_format.py)."""
    model = model_dir(tmp_path, layers=KIMI_LAYERS)
    ds = tmp_path / "spec"
    ds.mkdir()
    (ds / "data_config.json").write_text(json.dumps({"model": {"target_model_path": str(model)},
                                                    "hidden_states": {"layer_ids": KIMI_IDS}}))
    draft = ids_unset_draft(tmp_path)
    assert cli(["check-draft", str(draft), str(ds)]) == 1
    assert "trained on the outputs of layers 2 30 58" in capsys.readouterr().out
    (ds / "data_config.json").write_text(json.dumps({"model": {"target_model_path": "org/hub-id"},
                                                    "hidden_states": {"layer_ids": KIMI_IDS}}))
    assert cli(["check-draft", str(draft), str(ds)]) == 2
    assert "pass --num-hidden-layers" in capsys.readouterr().err
    assert cli(["check-draft", str(draft), str(ds), "--num-hidden-layers", "61"]) == 1
    capsys.readouterr()
    for args, needle in (([str(tmp_path / "nodraft"), str(ds)], "no such file"),
                         ([str(draft), str(tmp_path / "model")], "nothing says which layers it holds"),
                         ([str(draft), str(tmp_path / "none")], "not a directory")):
        assert cli(["check-draft", *args]) == 2
        assert needle in capsys.readouterr().err
    (draft / "config.json").write_text("{not json")
    assert cli(["check-draft", str(draft), str(ds), "--num-hidden-layers", "61"]) == 2
    assert "cannot read it as JSON" in capsys.readouterr().err


def test_a_data_set_without_the_final_layer_is_a_mismatch_fix_cannot_repair(tmp_path, capsys):
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "provenance.json").write_text(json.dumps({"provenance": {
        "model": {"num_hidden_layers": KIMI_LAYERS}, "hidden_states": {"layer_ids": [2, 30, 58]}}}))
    draft = tmp_path / "draft"
    draft.mkdir()
    cfg = json.dumps({"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [3, 31]})
    (draft / "config.json").write_text(cfg)
    assert cli(["check-draft", str(draft), str(ds), "--fix"]) == 1
    captured = capsys.readouterr()
    assert "the last stored layer, 58, is not the final decoder layer 60" in captured.out
    assert "not fixed" in captured.err and (draft / "config.json").read_text() == cfg
    assert not (draft / "config.json.bak").exists()


def test_the_arrow_layouts_own_file_names_its_layers(tmp_path, capsys):
    """An Arrow set copied without its manifest (the trainer's view only): ``speccompat_arrow.json``
    gives the layers, the last being the final decoder layer, so the layer count is known."""
    from speccompat.dataset.arrow_format import INFO_NAME, layer_semantics
    from speccompat.dataset.check_draft import dataset_layers

    ds = tmp_path / "arrow"
    ds.mkdir()
    (ds / INFO_NAME).write_text(json.dumps({"format": "speculators-arrow", "rows": [], **layer_semantics(KIMI_IDS)}))
    found = dataset_layers(ds)
    assert (found.layer_ids, found.num_hidden_layers, found.source) == (KIMI_IDS, KIMI_LAYERS, str(ds / INFO_NAME))
    draft = ids_unset_draft(tmp_path)
    assert cli(["check-draft", str(draft), str(ds)]) == 1
    assert "trained on the outputs of layers 2 30 58" in capsys.readouterr().out
    (ds / INFO_NAME).write_text(json.dumps({"layers": "none"}))
    assert cli(["check-draft", str(draft), str(ds)]) == 2
    assert "no layers[].layer" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# P-EAGLE (parallel drafting EAGLE-3): served by vLLM 0.22.0 - 0.33.x, refused from 0.34.0
# ---------------------------------------------------------------------------------------------

#: A speculators-format P-EAGLE draft with the fields vLLM 0.33.0's ``update_peagle`` reads
#: (``transformers_utils/configs/speculators/algos.py:54-87``: ``mask_token_id`` is required).
PEAGLE_DRAFT = {**V04_DRAFT, **V09_EXTRA, "speculators_model_type": "peagle", "architectures": ["PEagleSpeculator"],
                "mask_token_id": 511, "eagle_aux_hidden_state_layer_ids": [3, 31, 59],
                "speculators_config": {**V04_DRAFT["speculators_config"], "algorithm": "peagle"}}


def _draft(tmp_path: Path, name: str, cfg: dict) -> Path:
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return tmp_path / name


@needs_torch
def test_a_peagle_draft_is_refused_from_vllm_034_naming_why_and_served_before(dataset, tmp_path, capsys):
    draft = _draft(tmp_path, "peagle", PEAGLE_DRAFT)
    original = (draft / "config.json").read_bytes()
    for release in ("0.34.0", "0.35.1", "0.34.1.dev7+g1234abc"):
        assert cli(["check-draft", str(draft), str(dataset), "--vllm", release]) == 1
        out = capsys.readouterr().out
        assert (f"MISMATCH: a P-EAGLE draft (parallel drafting EAGLE-3: speculators_model_type 'peagle'): vLLM "
                f"{release} refuses it ('P-EAGLE (parallel drafting EAGLE-3) is not supported.', since 0.34.0); "
                "vLLM 0.22.0 - 0.33.x serve it as EAGLE-3 with parallel drafting") in out
        assert f"served:  nothing: vLLM {release} does not load the draft" in out
        assert "fix:" not in out
    assert cli(["check-draft", str(draft), str(dataset), "--vllm", "0.34.0", "--fix"]) == 1
    assert "not fixed: no config change makes vLLM serve this draft" in capsys.readouterr().err
    assert (draft / "config.json").read_bytes() == original and not (draft / "config.json.bak").exists()
    # the releases that serve it read its ids as for EAGLE-3: right ids are consistent (vLLM 0.32.0 itself, here)
    if importlib.util.find_spec("vllm"):
        assert vllm_served(draft) == (3, 31, 59)
    for release in ("0.22.0", "0.33.0", "0.33.1"):
        assert cli(["check-draft", str(draft), str(dataset), "--vllm", release]) == 0
        assert "consistent: vLLM serves the draft the layers it was trained on" in capsys.readouterr().out
    assert cli(["check-draft", str(draft), str(dataset), "--vllm", "0.21.0"]) == 1
    assert "vLLM 0.21.0 does not know it (P-EAGLE is served from 0.22.0)" in capsys.readouterr().out
    # ... and wrong ids are the usual mismatch, which --fix repairs for those releases
    wrong = _draft(tmp_path, "peagle_wrong", {**PEAGLE_DRAFT, "eagle_aux_hidden_state_layer_ids": [2, 30, 58]})
    assert cli(["check-draft", str(wrong), str(dataset), "--vllm", "0.33.0", "--fix"]) == 0
    assert json.loads((wrong / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [3, 31, 59]


@needs_torch
def test_the_release_defaults_to_the_installed_vllm_and_other_drafts_are_unaffected(dataset, tmp_path, capsys,
                                                                                   monkeypatch):
    from speccompat import detect

    draft = _draft(tmp_path, "peagle", PEAGLE_DRAFT)
    monkeypatch.setenv(detect.VLLM_VERSION_ENV, "0.34.0")  # what detect_vllm reports as installed
    assert cli(["check-draft", str(draft), str(dataset)]) == 1
    assert "vLLM 0.34.0 refuses it" in capsys.readouterr().out
    monkeypatch.setenv(detect.VLLM_VERSION_ENV, "0.33.0")
    assert cli(["check-draft", str(draft), str(dataset)]) == 0
    capsys.readouterr()
    # no vLLM here and none named: the newest releases refuse it, and the message says which serve it
    monkeypatch.delenv(detect.VLLM_VERSION_ENV)
    monkeypatch.setattr(detect, "detect_vllm", lambda: detect.Installed("vllm", None, None, None, "missing"))
    assert cli(["check-draft", str(draft), str(dataset)]) == 1
    out = capsys.readouterr().out
    assert "vLLM >= 0.34.0 refuses it" in out and "pass --vllm with the release that will serve it" in out
    assert "served:  nothing: vLLM (release not known) does not load the draft" in out
    # by architecture (a config in the HF layout), as vLLM 0.33.0's registry lists them (registry.py:698-706)
    hf = _draft(tmp_path, "hf", {"architectures": ["PeagleLlamaForCausalLM"], "model_type": "llama",
                                 "eagle_aux_hidden_state_layer_ids": [3, 31, 59]})
    assert cli(["check-draft", str(hf), str(dataset), "--vllm", "0.34.0"]) == 1
    assert "(parallel drafting EAGLE-3: architecture PeagleLlamaForCausalLM): vLLM 0.34.0 refuses it" in \
        capsys.readouterr().out
    assert cli(["check-draft", str(hf), str(dataset), "--vllm", "0.33.0"]) == 0
    capsys.readouterr()
    qwen = _draft(tmp_path, "hfq", {"architectures": ["PeagleQwen3ForCausalLM"], "model_type": "qwen3",
                                    "eagle_aux_hidden_state_layer_ids": [3, 31, 59]})
    assert cli(["check-draft", str(qwen), str(dataset), "--vllm", "0.23.0"]) == 1  # registered from 0.24.0
    assert "vLLM 0.23.0 does not know it (P-EAGLE is served from 0.24.0); vLLM 0.24.0 - 0.33.x" in \
        capsys.readouterr().out
    assert cli(["check-draft", str(qwen), str(dataset), "--vllm", "0.24.0"]) == 0
    capsys.readouterr()
    # an EAGLE-3 draft is judged as before on every release
    eagle3 = _draft(tmp_path, "eagle3", {**V04_DRAFT, **V09_EXTRA, "eagle_aux_hidden_state_layer_ids": [3, 31, 59]})
    for release in ("0.11.0", "0.33.0", "0.34.0"):
        assert cli(["check-draft", str(eagle3), str(dataset), "--vllm", release]) == 0
    capsys.readouterr()
    assert cli(["check-draft", str(eagle3), str(dataset), "--vllm", "latest"]) == 2
    assert capsys.readouterr().err.strip() == "check-draft: --vllm 'latest' is not a version"


@pytest.mark.static
@pytest.mark.parametrize("release", ["0.21.0", "0.22.0", "0.33.0", "0.34.0"])
def test_peagle_releases_are_what_vllms_own_config_parser_does(release, tmp_path):
    """vLLM's speculators config parser of each boundary release (its ``algos.py``, which imports
    nothing, run from the release's sources as scripts/static_check.py obtains them) loads, maps or
    refuses a P-EAGLE config as :func:`refusal` says."""
    import sys

    from support.static_check import SOURCES, sc

    from speccompat.dataset.check_draft import PEAGLE_REFUSED, refusal

    try:
        root = sc.vllm_sources(release, sc.CACHE, SOURCES)
    except sc.SourcesUnavailable as exc:
        pytest.skip(f"sources of vLLM {release} cannot be obtained (no network?): {exc}")
    spec = importlib.util.spec_from_file_location(f"algos_{release.replace('.', '_')}",
                                      root / "vllm" / "transformers_utils" / "configs" / "speculators" / "algos.py")
    algos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(algos)
    assert "eagle3" in algos.SUPPORTED_SPECULATORS_TYPES  # the parser is the one check-draft describes
    why = refusal(PEAGLE_DRAFT, Version(release))
    if "peagle" not in algos.SUPPORTED_SPECULATORS_TYPES:
        assert why is not None and "does not know it" in why
        return
    hf = dict(PEAGLE_DRAFT["transformer_layer_config"])
    try:
        algos.SUPPORTED_SPECULATORS_TYPES["peagle"](config_dict=json.loads(json.dumps(PEAGLE_DRAFT)),
                                                   pre_trained_config=hf)
    except ValueError as exc:
        assert str(exc) == PEAGLE_REFUSED and why is not None and PEAGLE_REFUSED in why
        return
    assert why is None, why
    assert hf["architectures"][0] in ("PeagleLlamaForCausalLM", "PeagleQwen3ForCausalLM")
    assert hf["eagle_aux_hidden_state_layer_ids"] == PEAGLE_DRAFT["eagle_aux_hidden_state_layer_ids"]
    assert sys.modules.get(spec.name) is None  # nothing registered: the release's module stays local


def test_the_target_models_own_config_is_refused_and_never_rewritten(tmp_path, capsys):
    """The verifier's config.json given as the draft (an easy slip: both directories hold one):
    exit 2 in one line, and ``--fix`` leaves it byte for byte as it was, with no backup beside it."""
    model = model_dir(tmp_path, layers=KIMI_LAYERS)
    ds = tmp_path / "spec"
    ds.mkdir()
    (ds / "data_config.json").write_text(json.dumps({"model": {"target_model_path": str(model)},
                                                    "hidden_states": {"layer_ids": KIMI_IDS}}))
    before = (model / "config.json").read_bytes()
    files = sorted(p.name for p in model.iterdir())
    for target in (model, model / "config.json"):
        assert cli(["check-draft", str(target), str(ds), "--fix"]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert len(err.splitlines()) == 1 and "is it the target model's own config.json?" in err, captured
        assert "DeepseekV3ForCausalLM" in err and captured.out == ""
    assert (model / "config.json").read_bytes() == before
    assert sorted(p.name for p in model.iterdir()) == files  # no backup made


@needs_torch
@pytest.mark.parametrize(("extra", "needle"), [
    ({"eagle_aux_hidden_state_layer_ids": 3}, "eagle_aux_hidden_state_layer_ids must be a list of ints, got 3"),
    ({"eagle_aux_hidden_state_layer_ids": ["3"]}, "must be a list of ints"),
    ({"eagle_aux_hidden_state_layer_ids": [3, 61]}, "aux id(s) [61] are outside 0..60"),
    ({"eagle_aux_hidden_state_layer_ids": [-1, 3]}, "aux id(s) [-1] are outside 0..60"),
    ({"transformer_layer_config": ["llama"]}, "transformer_layer_config must be a JSON object"),
    ({"transformer_layer_config": {"dflash_config": {"target_layer_ids": "2"}}},
     "dflash_config.target_layer_ids must be a list of ints"),
    ({"transformer_layer_config": {"eagle_config": ["x"]}}, "eagle_config must be a JSON object"),
])
def test_a_malformed_draft_config_is_bad_input_exit_2(dataset, tmp_path, capsys, extra, needle):
    """What vLLM could not serve at all is bad input (exit 2, the file named), neither a mismatch
    (exit 1) nor an internal error."""
    draft = _draft(tmp_path, "bad", {**V04_DRAFT, **extra})
    assert cli(["check-draft", str(draft), str(dataset), "--vllm", "0.32.0", "--fix"]) == 2
    err = capsys.readouterr().err
    assert needle in err and str(draft / "config.json") in err and "internal error" not in err, err
    assert not (draft / "config.json.bak").exists()


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_num_hidden_layers_must_be_a_positive_whole_number(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as e:
        cli(["check-draft", str(tmp_path), str(tmp_path), "--num-hidden-layers", value])
    assert e.value.code == 2 and "--num-hidden-layers" in capsys.readouterr().err
