"""The run loop end to end on the real stack (vLLM, Ray, gloo), synchronous and asynchronous."""

from __future__ import annotations

import json

import pytest

from factory.run import run

from .conftest import small_recipe


def trained_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("eta", [0, 2])
def test_no_trained_sample_is_older_than_eta(engine, tmp_path, eta):
    recipe = small_recipe(f"async.max_staleness={eta}", "train.steps=5", "eval.before=false")
    results = run(recipe, tmp_path, engines=[engine])

    rows = trained_rows(tmp_path)
    assert results["samples_trained"] == len(rows) > 0
    steps = sorted({r["trained_step"] for r in rows})
    assert steps == [1, 2, 3, 4, 5]
    for r in rows:
        sampled = [v for v, m in zip(r["versions"], r["loss_mask"]) if m]
        assert sampled, r["sample_id"]
        # the trainer at step k holds version k-1; no sampled token may be more than η behind it
        assert r["trained_version"] - min(sampled) <= eta
        assert r["staleness"] == r["trained_version"] - min(sampled)
    assert len({r["sample_id"] for r in rows}) == len(rows)
    if eta == 0:
        assert {r["staleness"] for r in rows} == {0}
    assert 0.0 <= results["after"]["mean"] <= 1.0 and results["after"]["n"] == recipe.eval.heldout
    assert (tmp_path / "results.json").is_file()
    state = json.loads((tmp_path / "checkpoints" / "step-000005" / "state.json").read_text())
    assert state["version"] == 5 and state["buffer"]["sampler"]["position"] > 0


def test_evaluate_checkpoint_scores_a_saved_policy(engine, tmp_path):
    from factory.evaluate import evaluate_checkpoint

    recipe = small_recipe("train.steps=2", "eval.before=false", "eval.after=false")
    run(recipe, tmp_path, engines=[engine])
    ckpt = tmp_path / "checkpoints" / "step-000002"
    result = evaluate_checkpoint(recipe, ckpt, "heldout", n=48, engines=[engine])
    assert result["n"] == 48 and 0.0 <= result["mean"] <= 1.0
    assert set(result["by_family"]) == {"basic_arithmetic"}
    # rewards lie in [0, 1] (the verifier gives partial credit too): the sample sd is at most 1/2
    assert 0.0 <= result["stderr"] <= 0.5 / 47 ** 0.5 + 1e-12
    assert (result["stderr"] > 0) == (0.0 < result["mean"] < 1.0)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        evaluate_checkpoint(recipe, tmp_path, engines=[engine])
