"""The evaluation asset reads a checkpoint's evaluation back from the lake when it exists."""

import json

import dagster as dg

from assets.evaluation import evaluation
from assets.resources import resources_for
from assets.runs import RL_RUNS, run_dir
from factory.data.heldout import suite_tasks, tasks_digest
from factory.lake import TrajectoryWriter
from factory.paths import REPO_ROOT
from factory.recipe import load_recipe


def test_an_evaluated_checkpoint_is_read_from_the_lake(instance):
    key = "evaluated"
    directory = run_dir(key)
    recipe = load_recipe(REPO_ROOT / "recipes" / "default.yaml", ["eval.heldout=64"])
    directory.mkdir(parents=True)
    (directory / "recipe.yaml").write_text(recipe.to_yaml())
    checkpoint = directory / "checkpoints" / "step-000004"
    checkpoint.mkdir(parents=True)  # no weights: evaluating it for real would fail
    (checkpoint / "state.json").write_text(json.dumps({"version": 4, "step": 4}))
    digest = tasks_digest(suite_tasks(recipe, "heldout"))
    with TrajectoryWriter(run_id=key) as writer:  # what the run's own after-training evaluation wrote
        writer.append("evaluations", [{"run_id": key, "step": 4, "version": 4, "suite": "heldout", "n": 64,
                                       "mean": 0.25, "stderr": 0.05, "by_family": {"basic_arithmetic": 0.25},
                                       "tasks_digest": digest}])
    instance.add_dynamic_partitions(RL_RUNS.name, [key])

    result = dg.materialize([evaluation], instance=instance, partition_key=key, resources=resources_for())
    metadata = result.asset_materializations_for_node("evaluation")[0].metadata
    assert (metadata["accuracy"].value, metadata["n"].value, metadata["step"].value) == (0.25, 64, 4)
    assert metadata["source"].value == "the lake (evaluated earlier)"
    assert metadata["by_family"].value == {"basic_arithmetic": 0.25}


def test_an_evaluation_of_other_tasks_is_not_reused(instance):
    """A row of the same n but without this subset's digest (written when a subset was the split's
    prefix) scored other tasks: the checkpoint is evaluated again (here: it has no weights, so it fails)."""
    key = "prefix-era"
    directory = run_dir(key)
    recipe = load_recipe(REPO_ROOT / "recipes" / "default.yaml", ["eval.heldout=64"])
    directory.mkdir(parents=True)
    (directory / "recipe.yaml").write_text(recipe.to_yaml())
    checkpoint = directory / "checkpoints" / "step-000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text(json.dumps({"version": 4, "step": 4}))
    with TrajectoryWriter(run_id=key) as writer:
        writer.append("evaluations", [{"run_id": key, "step": 4, "version": 4, "suite": "heldout", "n": 64,
                                       "mean": 0.25, "stderr": 0.05, "by_family": {}}])
    instance.add_dynamic_partitions(RL_RUNS.name, [key])

    result = dg.materialize([evaluation], instance=instance, partition_key=key, resources=resources_for(),
                            raise_on_error=False)
    assert not result.success
    failure = result.failure_data_for_node("evaluation")
    assert "not a model directory" in str(failure.error)
