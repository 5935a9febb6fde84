"""`factory run` with rollout.engine=sglang: the run starts a real SGLang server (infra/sglang-venv.sh's
venv on CPU, a test set-up; see factory/rollout/sglang.py), trains the tiny model against it, and
broadcasts its weights into it. At η = 0 every batch was sampled right after a sync, so the trainer's
recomputed logprobs of the sampled tokens must match the engine's within bf16 tolerance."""

from __future__ import annotations

import json

import pytest

from factory.run import run

from .conftest import small_recipe
from .test_weight_sync import BF16_MEAN_TOL

pytestmark = pytest.mark.integration


def test_factory_run_trains_against_a_real_sglang_server(ray_cluster, policy, tmp_path):
    recipe = small_recipe("rollout.engine=sglang", "rollout.weight_sync=broadcast", "async.max_staleness=0",
                          "train.steps=3", "train.lr=1e-3", "eval.before=false", "eval.heldout=16",
                          "lake.enabled=false", "tracking.enabled=false", f"model.path={policy}")
    results = run(recipe, tmp_path)  # starts, uses and stops its own SGLang engine
    assert results["samples_trained"] > 0 and results["engine_requests"][0] > 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert results["engine_updates"] == [recipe.train.steps]  # one broadcast per step, the last before the end
    assert results["engine_versions"] == [recipe.train.steps]
    for s in steps:  # steps 2 and 3 were sampled on weights the trainer broadcast into SGLang
        assert s["staleness/max"] == 0
        assert s["train/logprob_abs_diff"] < BF16_MEAN_TOL, s
    assert 0.0 <= results["after"]["mean"] <= 1.0 and results["after"]["n"] == 16
