import json

import dagster as dg

from assets.runs import ATTEMPT_TAG, LAUNCH_REQUEST, RL_RUN_KEY, RL_RUNS, SWEEP_RUN_TAG, run_dir, saved_recipe
from tests.assets.conftest import SWEEP_RECIPE


def run_sweep(defs, instance, **config):
    return defs.resolve_job_def("sweep_job").execute_in_process(
        instance=instance, run_config={"ops": {"plan_sweep": {"config": config}}}, raise_on_error=False)


def launcher(defs):
    return next(s for s in defs.get_repository_def().sensor_defs if s.name == "rl_run_launcher")


def test_sweep_plans_one_partition_per_grid_point(defs, instance):
    # the recipe's own 2 x 2 grid, extended by a third axis from the launchpad: 8 runs
    result = run_sweep(defs, instance, recipe=str(SWEEP_RECIPE), overrides=["train.steps=20"],
                       grid=["train.lr=1e-5,5e-5"])
    assert result.success
    keys = result.output_for_node("plan_sweep")
    assert len(keys) == len(set(keys)) == 8
    assert list(instance.get_dynamic_partitions(RL_RUNS.name)) == keys
    points = set()
    for key in keys:
        recipe = saved_recipe(run_dir(key))
        assert recipe.train.steps == 20 and not recipe.sweep
        assert key.startswith(recipe.name) and recipe.name.startswith("sweep_loss_staleness-loss=")
        points.add((recipe.algorithm.loss, recipe.async_.max_staleness, recipe.train.lr))
        assert json.loads((run_dir(key) / LAUNCH_REQUEST).read_text())["sweep_run_id"] == result.run_id
    assert points == {(loss, eta, lr) for loss in ("ppo_clip", "reinforce") for eta in (0, 2) for lr in (1e-5, 5e-5)}

    # the same sweep again plans the same partitions (keys are content hashes), not new ones
    again = run_sweep(defs, instance, recipe=str(SWEEP_RECIPE), overrides=["train.steps=20"],
                      grid=["train.lr=1e-5,5e-5"])
    assert again.output_for_node("plan_sweep") == keys
    assert len(instance.get_dynamic_partitions(RL_RUNS.name)) == 8


def test_launcher_requests_each_planned_run_once_per_sweep(defs, instance):
    result = run_sweep(defs, instance, recipe=str(SWEEP_RECIPE))
    keys = result.output_for_node("plan_sweep")
    instance.add_dynamic_partitions(RL_RUNS.name, ["added-by-hand"])  # no launch request: left alone

    requests = launcher(defs)(dg.build_sensor_context(instance=instance, definitions=defs))
    assert [r.partition_key for r in requests] == keys
    for request in requests:
        assert request.run_key == f"{request.partition_key}@{result.run_id}"
        assert request.tags == {SWEEP_RUN_TAG: result.run_id, ATTEMPT_TAG: "0"}
        config = request.run_config["ops"]["rl_run"]["config"]
        assert config == {"recipe": str(run_dir(request.partition_key) / "recipe.yaml"), "overrides": [],
                          "resume_from": ""}

    # a finished run and a run in progress are not requested again
    (run_dir(keys[0]) / "results.json").write_text("{}")
    instance.add_run(dg.DagsterRun(job_name="rl_run_job", run_id="r-in-progress", status=dg.DagsterRunStatus.STARTED,
                                   asset_selection=frozenset({RL_RUN_KEY}), tags={"dagster/partition": keys[1]}))
    requests = launcher(defs)(dg.build_sensor_context(instance=instance, definitions=defs))
    assert [r.partition_key for r in requests] == keys[2:]


def test_an_empty_grid_plans_the_recipe_as_one_run(defs, instance):
    result = run_sweep(defs, instance, recipe="recipes/default.yaml", overrides=["train.steps=3"])
    (key,) = result.output_for_node("plan_sweep")
    assert key.startswith("default-") and saved_recipe(run_dir(key)).train.steps == 3


def test_a_bad_grid_fails_with_the_field_named(defs, instance):
    result = run_sweep(defs, instance, recipe=str(SWEEP_RECIPE), grid=["algorithm.loss=ppo_clip,no_such_loss"])
    assert not result.success
    message = result.get_step_failure_events()[0].step_failure_data.user_failure_data.description
    assert "algorithm.loss: unknown policy loss 'no_such_loss'" in message
    assert instance.get_dynamic_partitions(RL_RUNS.name) == []
