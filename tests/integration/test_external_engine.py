"""Server mode (slime's): a recipe names running engines by URL; the run attaches to them, syncs its
weights into them and leaves them running. The engine here is the session's vLLM server, which this
run did not start (it is started like `factory serve` starts one)."""

from __future__ import annotations

import json

import httpx
import pytest
import ray

from factory.rollout.vllm import EngineStartError
from factory.run import run

from .conftest import small_recipe

pytestmark = pytest.mark.integration


def test_a_recipe_naming_engine_urls_trains_on_an_engine_it_did_not_start(engine, tmp_path):
    url = ray.get(engine.url.remote())
    recipe = small_recipe(f"rollout.urls=[{url}]", "train.steps=2", "eval.before=false", "eval.heldout=16",
                          "lake.enabled=false", "tracking.enabled=false")
    results = run(recipe, tmp_path)  # no engines handed in: the run attaches to the URL
    assert results["samples_trained"] > 0 and results["engine_requests"][0] > 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    # the attached engine took every step's weights (plus the run's own at the start), the last one
    # before the run ended (a step's metrics may predate its own update: rollout.overlap_sync)
    assert results["engine_updates"] == [recipe.train.steps + 1]
    assert results["engine_versions"] == [recipe.train.steps]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # left running
    assert results["after"]["n"] == 16


def test_a_url_where_no_engine_answers_is_a_plain_error(ray_cluster, tmp_path):
    recipe = small_recipe("rollout.urls=[http://127.0.0.1:9]", "train.steps=1", "eval.before=false",
                          "lake.enabled=false", "tracking.enabled=false")
    with pytest.raises(EngineStartError, match=r"rollout.urls: no vLLM server answers at http://127.0.0.1:9 "):
        run(recipe, tmp_path)
