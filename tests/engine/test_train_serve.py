"""From extraction to a served draft (``speccompat.testing.train_serve``): a tiny EAGLE-3 draft trained
by speculators on a ``speccompat extract`` data set is accepted when vLLM serves it, and clearly
more than two controls served the same way: the same draft with its aux layer ids shifted down by
one (a layer mismatch) and an untrained draft of the same shape. The margin is three times the
standard deviation of the per-prompt-set differences, and the trained draft must win every set.

Minutes of CPU (two extractions, two trainings, four serving engines): marked ``train_serve``, outside
the gate; ``nox -s train_serve`` or ``pytest --train-serve -m train_serve``. The figures go to
``SPECCOMPAT_TRAIN_SERVE_OUT`` when set (the nox session: ``benchmarks/results/train-serve-cpu.json``).

``SPECCOMPAT_TRAIN_SERVE_WORK=DIR`` keeps the run's files in DIR (a target and samples already there
are reused). ``SPECCOMPAT_TRAIN_SERVE_MISLABEL=1`` runs it on a data set whose records name each input
layer one above the layer captured: check-draft finds nothing wrong there, and the comparison with the
shifted control fails (docs/train-serve.md shows that run).

``test_online_training_matches_offline``: the same speculators 0.9.0 training, offline on the extracted
set and online against ``speccompat serve`` (``--on-missing generate``), takes equal steps
(``speccompat.testing.train_serve online``, docs/online.md; its figures go to
``SPECCOMPAT_TRAIN_SERVE_ONLINE_OUT``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.train_serve]

MISLABEL = os.environ.get("SPECCOMPAT_TRAIN_SERVE_MISLABEL") == "1"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    pytest.importorskip("datasets", reason="--format speculators-arrow needs `datasets` (speccompat[arrow])")
    from speccompat.testing.train_serve import run, summary

    work = Path(os.environ.get("SPECCOMPAT_TRAIN_SERVE_WORK") or tmp_path_factory.mktemp("train-serve"))
    doc = run(work, lock=os.environ.get("SPECCOMPAT_ENGINE_LOCK"), mislabel=MISLABEL)
    print(summary(doc))
    keep(work / "results.json", "SPECCOMPAT_TRAIN_SERVE_OUT")
    return doc


def keep(results: Path, variable: str) -> None:
    """Copy a run's results file to where the environment variable ``variable`` says, if set."""
    out = os.environ.get(variable)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(results, out)


def test_vllm_counted_every_draft(result):
    """Every engine ran speculative decoding on every prompt set, and vLLM's counters add up."""
    for name, served in result["served"].items():
        assert served["drafts"] > 0, name
        assert served["prompts"] == result["data"]["heldout_sets"] * result["data"]["heldout_per_set"], name
        per_pos = served["per_position"]
        assert len(per_pos) == 3, name
        # a token is accepted at position k+1 only after position k was: the rates cannot rise
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False)), (name, per_pos)
        assert abs(served["mean_accepted_length"] - (1 + sum(per_pos))) < 1e-3, (name, served)


def test_check_draft_on_the_trained_drafts(result):
    checks = result["check_draft"]
    assert checks["trained_09"]["exit"] == 0, checks["trained_09"]["output"]
    assert checks["trained_09_shifted"]["exit"] == 1, checks["trained_09_shifted"]["output"]
    assert "MISMATCH" in checks["trained_09_shifted"]["output"]
    if "trained_04" in checks:
        # speculators 0.4.0.1's trainer writes no eagle_aux_hidden_state_layer_ids: vLLM's default
        # (2, 3, 3) for 6 layers is not what the data set holds until --fix writes the right ids
        assert checks["trained_04_before_fix"]["exit"] == 1, checks["trained_04_before_fix"]["output"]
        assert checks["trained_04_fix"]["exit"] == 0, checks["trained_04_fix"]["output"]
        assert checks["trained_04"]["exit"] == 0, checks["trained_04"]["output"]
        assert result["served"]["trained_04"]["aux_ids"] == result["aux_ids"]


def test_trained_draft_beats_the_shifted_and_the_untrained_draft(result):
    comparisons = result["comparisons"]
    assert result["served"]["trained_09"]["aux_ids"] == result["aux_ids"]
    assert result["served"]["trained_09_shifted"]["aux_ids"] == [a - 1 for a in result["aux_ids"]]
    for name in ("trained_09_vs_shifted", "trained_09_vs_untrained", "trained_04_vs_untrained"):
        if name in comparisons:
            assert comparisons[name]["clearly_better"], (name, comparisons[name])


@pytest.fixture(scope="module")
def online_result(tmp_path_factory):
    pytest.importorskip("datasets", reason="--format speculators-arrow needs `datasets` (speccompat[arrow])")
    from speccompat.testing.train_serve import online

    base = os.environ.get("SPECCOMPAT_TRAIN_SERVE_WORK")
    work = Path(base) / "online" if base else tmp_path_factory.mktemp("train-serve-online")
    doc = online(work, lock=os.environ.get("SPECCOMPAT_ENGINE_LOCK"))
    keep(work / "online-results.json", "SPECCOMPAT_TRAIN_SERVE_ONLINE_OUT")
    return doc


def test_online_training_matches_offline(online_result):
    """speculators 0.9.0 trained from rows alone against ``speccompat serve`` (``--on-missing generate``)
    takes the same steps as trained on the offline set: every logged loss and every draft weight equal."""
    losses = online_result["losses"]
    assert len(losses) >= 3 and losses[0]["step"] == 1, losses
    assert online_result["max_abs_loss_diff"] == 0.0, losses
    assert losses[-1]["offline"] < losses[0]["offline"] / 2, losses  # it trained
    assert online_result["same_draft_weights"]["equal"], online_result["same_draft_weights"]
    assert online_result["server_exit"] == 0 and online_result["left_in_hs_dir"] == []
