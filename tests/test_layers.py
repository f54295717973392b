"""Layer ids (speccompat.layers): speculators' defaults checked against the model, and the
generator's patch refusing a colliding default before speculators' own __init__ runs."""

from __future__ import annotations

import json

import pytest
from support.dataset_fakes import model_dir


def test_layer_id_defaults_are_checked_against_the_model(tmp_path):
    from speccompat.layers import LayerIdsError, check_generator_layer_ids, resolve_layer_ids

    assert resolve_layer_ids(None, 61) == [2, 30, 58, 60]
    assert resolve_layer_ids(None, 8) == [2, 4, 5, 7]
    with pytest.raises(LayerIdsError, match=r"\[2, 3, 3, 5\] for this model's 6 decoder layers"):
        resolve_layer_ids(None, 6)
    with pytest.raises(LayerIdsError, match=r"outside the model's decoder layers \[0, 5\]"):
        resolve_layer_ids([1, 6], 6)
    model = model_dir(tmp_path)  # 6 layers
    with pytest.raises(LayerIdsError, match=r"\[2, 3, 3, 5\]"):
        check_generator_layer_ids(str(model), None)
    check_generator_layer_ids(str(model), [1, 2, 4, 5])
    kimi = model_dir(tmp_path / "kimi", text_config={"num_hidden_layers": 61})
    cfg = json.loads((kimi / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (kimi / "config.json").write_text(json.dumps(cfg))
    check_generator_layer_ids(str(kimi), None)  # text_config: 61 layers, default fine


def test_the_generator_patch_rejects_a_colliding_default_before_speculators_init_runs(tmp_path):
    from speccompat.generator import wrap_init

    model = model_dir(tmp_path)  # 6 layers: speculators' default would be [2, 3, 3, 5]
    called = []
    with pytest.raises(ValueError, match=r"\[2, 3, 3, 5\]"):
        wrap_init(lambda *a, **k: called.append(1), None, (str(model),), {})
    with pytest.raises(ValueError, match=r"\[2, 3, 3, 5\]"):
        wrap_init(lambda *a, **k: called.append(1), None, (), {"model_path": str(model), "layer_ids": None})
    assert called == []
    wrap_init(lambda *a, **k: called.append(1), None, (str(model), [1, 2, 4, 5]), {})
    assert called == [1]
