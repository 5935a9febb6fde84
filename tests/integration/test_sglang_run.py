"""`factory run` with rollout.engine=sglang against a real SGLang server (infra/sglang-venv.sh's venv on
CPU, a test set-up; see factory/rollout/sglang.py): the session's (tests/conftest.py `sglang_engine`),
given to each run as its engine. The run trains the tiny model against it and broadcasts its weights
into it (the run's own weights first: the server holds whatever the last user left in it).

At η = 0 every batch was sampled right after a sync, so the trainer's recomputed logprobs of the
sampled tokens must match the engine's within bf16 tolerance. At η = 1 (the default recipe) the
engine drains and updates while it generates the next step's groups: an update right behind the drain
must not find SGLang still holding the requests it has just answered."""

from __future__ import annotations

import json

import pytest
import ray

from factory.run import run

from .conftest import FILTER_ON, small_recipe
from .test_weight_sync import BF16_MEAN_TOL

pytestmark = pytest.mark.integration

SGLANG = ("rollout.engine=sglang", "rollout.weight_sync=broadcast", "rollout.kv_cache_gb=1", "eval.before=false",
          "lake.enabled=false", "tracking.enabled=false")


def _updates(engine) -> float:
    return ray.get(engine.metrics.remote())["weightsync/updates"]


def test_factory_run_trains_against_a_real_sglang_server(sglang_engine, policy, tmp_path):
    # every group is trained (TEST_OVERRIDES): after one step at this rate the policy answered each prompt
    # one way, and the zero-variance filter had SGLang sample ~7,900 completions (77 s) for step 2
    recipe = small_recipe(*SGLANG, "async.max_staleness=0", "train.steps=3", "train.lr=1e-3", "eval.heldout=16",
                          f"model.path={policy}")
    before = _updates(sglang_engine)
    results = run(recipe, tmp_path, engines=[sglang_engine])
    assert results["samples_trained"] > 0 and results["engine_requests"][0] > 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # the run's own weights first, then one broadcast per step, the last before the end
    assert results["engine_updates"] == [before + recipe.train.steps + 1]
    assert results["engine_versions"] == [recipe.train.steps]
    for s in steps:  # every step was sampled on weights the trainer broadcast into SGLang
        assert s["staleness/max"] == 0
        assert s["train/logprob_abs_diff"] < BF16_MEAN_TOL, s
    assert 0.0 <= results["after"]["mean"] <= 1.0 and results["after"]["n"] == 16


def test_default_recipe_runs_20_steps_on_sglang_at_eta_1(sglang_engine, policy, tmp_path):
    recipe = small_recipe(*SGLANG, "train.steps=20", "train.checkpoint_every=100", "eval.after=false",
                          FILTER_ON, f"model.path={policy}")
    assert recipe.async_.max_staleness == 1 and recipe.rollout.partial_rollout == "wait"  # the default recipe's
    before = _updates(sglang_engine)
    results = run(recipe, tmp_path, engines=[sglang_engine])

    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 21))
    B, G = recipe.train.groups_per_step, recipe.rollout.group_size
    assert results["samples_trained"] == 20 * B * G
    # the engine's weights advance with the trainer: each step's batch is at most η versions behind it
    versions = [s["rollout/engine_version"] for s in steps]
    assert versions == sorted(versions) and all(v >= step - 1 for step, v in enumerate(versions, 1)), versions
    assert all(s["staleness/max"] <= 1 for s in steps)
    assert results["engine_updates"] == [before + 20 + 1] and results["engine_versions"] == [20]

    # every group that finished has one fate: trained, still queued, filtered, rejected or purged
    counts = results["buffer"]
    fates = sum(counts[f"buffer/{k}"] for k in ("consumed", "queued", "filtered", "rejected_groups", "purged_groups"))
    assert counts["buffer/consumed"] == 20 * B and counts["buffer/failed"] == 0
    assert G * fates == counts["buffer/finished_samples"], counts
