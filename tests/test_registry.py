"""The Registry helper and the rollout engine registry's recipe-time checks."""

from __future__ import annotations

import pytest

from factory.recipe import RecipeError, recipe_from_dict
from factory.core.registry import Registry
from factory.rollout.engines import ENGINES


def test_a_registry_refuses_a_second_entry_under_a_taken_name():
    reg: Registry[int] = Registry("widget")
    reg.register("a", 1)
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        reg.register("a", 2)
    assert reg["a"] == 1 and "a" in reg and list(reg) == ["a"] and reg.get("b") is None
    with pytest.raises(KeyError, match=r"unknown widget 'b'; choose one of \['a'\]"):
        reg["b"]
    with pytest.raises(ValueError, match=r"unknown widget 'b'; choose one of \['a'\]"):
        reg.check("b")  # what a recipe field validator raises


def test_engine_names_in_the_recipe_and_its_schema_come_from_the_registry():
    from factory.recipe import json_schema

    engine = json_schema()["$defs"]["RolloutSection"]["properties"]["engine"]
    assert engine["enum"] == ENGINES.names() and {"vllm", "hf", "sglang"} <= set(ENGINES.names())


@pytest.mark.parametrize("rollout, message", [
    ({"engine": "hf", "partial_rollout": "inflight"},
     "rollout.partial_rollout: 'inflight' is not supported by rollout.engine=hf (it supports wait)"),
    ({"engine": "sglang", "keep_sampling_mask": True, "top_k": 5},
     "rollout.keep_sampling_mask: rollout.engine=sglang does not report the sampler's candidate sets"),
    ({"engine": "sglang", "weight_sync": "lora", "urls": []},
     "rollout.weight_sync: 'lora' is not supported by rollout.engine=sglang"),
    ({"engine": "hf", "urls": ["http://127.0.0.1:8000"]}, "rollout.urls: rollout.engine=hf cannot attach"),
    ({"urls": ["127.0.0.1:8000"]}, "rollout.urls: expected http(s)://HOST:PORT"),
    ({"urls": ["http://127.0.0.1:1"], "num_engines": 2}, "rollout.num_engines: 2 engines but 1 urls"),
])
def test_recipe_check_rejects_an_engine_that_cannot_serve_the_recipe(rollout, message):
    with pytest.raises(RecipeError) as caught:
        recipe_from_dict({"rollout": rollout}, "r.yaml")
    assert str(caught.value).startswith(f"r.yaml: {message}"), str(caught.value)
    assert "\n" not in str(caught.value)


def test_lora_needs_an_engine_that_serves_adapters():
    with pytest.raises(RecipeError, match="rollout.weight_sync: 'lora' is not supported by rollout.engine=hf"):
        recipe_from_dict({"rollout": {"engine": "hf", "weight_sync": "lora"}, "train": {"lora": {"enabled": True}}})


def test_placement_amounts_must_be_positive_and_urls_give_the_engine_count():
    with pytest.raises(RecipeError, match=r"placement.engine: .*must be > 0"):
        recipe_from_dict({"placement": {"engine": {"rollout": 0}}})
    r = recipe_from_dict({"rollout": {"urls": ["http://127.0.0.1:9/", "http://127.0.0.1:10"]}})
    assert r.rollout.urls == ["http://127.0.0.1:9", "http://127.0.0.1:10"]


def test_the_recipe_schema_lists_every_registry_so_editors_autocomplete_them():
    from factory.algo import ADVANTAGES, CORRECTIONS, KL_ESTIMATORS, POLICY_LOSSES
    from factory.algo.losses import AGGREGATIONS
    from factory.recipe import json_schema
    from factory.rollout.engines import ENGINES
    from factory.training.scoring import SCORERS

    defs = json_schema()["$defs"]
    algorithm = defs["AlgorithmSection"]["properties"]
    assert algorithm["loss"]["enum"] == POLICY_LOSSES.names() and "ppo_clip" in algorithm["loss"]["enum"]
    assert algorithm["advantage"]["enum"] == ADVANTAGES.names()
    assert algorithm["aggregation"]["enum"] == AGGREGATIONS.names()
    assert algorithm["kl_estimator"]["enum"] == KL_ESTIMATORS.names()
    assert defs["OffPolicyCorrection"]["properties"]["name"]["enum"] == CORRECTIONS.names()
    assert defs["DistillSection"]["properties"]["scorer"]["enum"] == SCORERS.names()
    assert defs["RolloutSection"]["properties"]["engine"]["enum"] == ENGINES.names()


def test_importing_the_recipe_imports_no_component_and_a_registry_fills_on_its_first_read():
    import subprocess
    import sys

    code = ("import sys, factory.recipe; "
            "components = ('factory.rollout', 'factory.envs', 'factory.rewards', 'factory.algo', 'factory.training'); "
            "assert not [m for m in sys.modules if m.startswith(components)], sys.modules; "
            "from factory.core import registries; "
            "assert 'vllm' in registries.ENGINES and 'factory.rollout.engines' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
