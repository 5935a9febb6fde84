"""Every shipped recipe runs at its own defaults, so a recipe in recipes/ can never break unnoticed (three
of them died of seeded chunked prefill on vLLM-CPU while the suite, at smaller shapes, passed).

Each run keeps its recipe's shapes: its model architecture and chat template, its data, prompts and
environment (multi-turn tool calls in a sandbox), its engine settings (seeded sampling, context,
completion budget, group size, groups per step), its algorithm and its asynchrony. It is shortened
where the length of a run, not its shape, is what costs: 2 steps (`train.steps`), a short warm start
(`model.sft_steps`: the warm start's length changes the weights, not one shape the engine or the
trainer sees), no evaluation (training sends the engine as many requests at once: groups_per_step x
group_size), and every group trained: a policy warm-started this briefly scores almost nothing, and with
the zero-variance filter on a run waits minutes for groups with a reward spread (the run's no-signal
watch is tested in test_no_signal.py; one run here took 158 s for its first batch). The gateway's tool
calls met an untrained policy's replies here first (a tool name that was a JSON object: a 500 for every
such episode). recipes/two_node.yaml places
roles on two nodes: tests/integration/test_two_node.py runs it on a two-node cluster. A sweep's
first point stands for the sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from factory.recipe import expand_sweep, load_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.yaml") if p.name != "two_node.yaml")
SHORTER = ["train.steps=2", "model.sft_steps=30", "eval.before=false", "eval.after=false",
           "algorithm.filter_zero_variance=false", "train.checkpoint_every=0", "train.checkpoint_every_s=0"]


def smoke_recipe(name: str):
    """recipes/`name`, shortened as above (a sweep: its first point)."""
    recipe = load_recipe(REPO / "recipes" / name, SHORTER)
    return expand_sweep(recipe)[0][1] if recipe.sweep else recipe


def test_every_shipped_recipe_but_the_two_node_one_is_smoke_tested():
    assert len(RECIPES) >= 7 and "default.yaml" in RECIPES and "tool_agent.yaml" in RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_a_shipped_recipe_runs_at_its_own_defaults(name, ray_cluster, tmp_path, monkeypatch):
    from factory.run import run

    monkeypatch.chdir(REPO)  # file sources are relative to the current directory, else the repo
    results = run(smoke_recipe(name), tmp_path)  # its short warm start: built by tests/policies.py beside the suite
    assert results["steps"] == 2 and results["samples_trained"] > 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert results["restarts"]["engine"] == 0  # no engine died on the way
