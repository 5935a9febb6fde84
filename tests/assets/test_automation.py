import json

import dagster as dg
import pytest

from assets.automation import evaluation_requests
from assets.runs import (
    ATTEMPT_TAG, EVALUATION_KEY, PARENT_RUN_TAG, RL_RUN_KEY, RL_RUNS, ROOT_RUN_TAG, SWEEP_RUN_TAG, rl_run_config,
    run_dir,
)
from factory.paths import REPO_ROOT
from factory.recipe import load_recipe
from tests.assets.conftest import FAILING_OVERRIDES


def sensor(defs, name):
    repo = defs.get_repository_def()
    return next(s for s in [*repo.sensor_defs, *repo.schedule_defs] if s.name == name)


def save_recipe(key: str, overrides=FAILING_OVERRIDES) -> None:
    directory = run_dir(key)
    directory.mkdir(parents=True)
    (directory / "recipe.yaml").write_text(load_recipe(REPO_ROOT / "recipes" / "default.yaml", overrides).to_yaml())


def save_checkpoint(key: str, step: int) -> str:
    path = run_dir(key) / "checkpoints" / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"version": step, "step": step}))
    return str(path)


def failed_run(defs, instance, key: str, tags=None) -> dg.DagsterRun:
    """A real failed materialization of one rl_runs partition (the run's model does not exist)."""
    instance.add_dynamic_partitions(RL_RUNS.name, [key])
    result = defs.resolve_job_def("rl_run_job").execute_in_process(
        instance=instance, partition_key=key, run_config=rl_run_config(), tags=tags or {}, raise_on_error=False)
    assert not result.success
    return instance.get_run_by_id(result.run_id)


def on_failure(defs, instance, run: dg.DagsterRun):
    event = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[0].dagster_event
    context = dg.build_run_status_sensor_context(sensor_name="rl_run_recovery", dagster_event=event,
                                                 dagster_instance=instance, dagster_run=run).for_run_failure()
    return sensor(defs, "rl_run_recovery")(context)


def test_recovery_relaunches_from_the_latest_checkpoint(defs, instance):
    save_recipe("r1")
    first = failed_run(defs, instance, "r1", tags={SWEEP_RUN_TAG: "sweep-1"})
    # its relaunch fails as well (both before the checkpoints appear: a run with a checkpoint
    # would resume from it, which takes a real model)
    relaunch_tags = {PARENT_RUN_TAG: first.run_id, ROOT_RUN_TAG: first.run_id, ATTEMPT_TAG: "1",
                     SWEEP_RUN_TAG: "sweep-1"}
    second = failed_run(defs, instance, "r1", tags=relaunch_tags)
    for step in (2, 4):
        latest = save_checkpoint("r1", step)
    (run_dir("r1") / "checkpoints" / "step-000006.tmp").mkdir()  # a save cut short: never resumed from

    request = on_failure(defs, instance, first)
    assert isinstance(request, dg.RunRequest)
    assert request.partition_key == "r1" and request.run_key == f"recover-{first.run_id}"
    assert request.run_config == rl_run_config(run_dir("r1") / "recipe.yaml", resume_from=latest)
    assert request.tags == relaunch_tags

    # the next relaunch keeps the chain's root and counts attempts
    request = on_failure(defs, instance, second)
    assert request.tags == {**relaunch_tags, PARENT_RUN_TAG: second.run_id, ATTEMPT_TAG: "2"}


def test_recovery_stops_at_the_recipes_restart_budget(defs, instance):
    save_recipe("r2")  # train.max_restarts: 3 by default
    run = failed_run(defs, instance, "r2", tags={ATTEMPT_TAG: "3"})
    skip = on_failure(defs, instance, run)
    assert isinstance(skip, dg.SkipReason) and "restart budget of 3 used up" in skip.skip_message
    (run_dir("r2") / "recipe.yaml").write_text(
        load_recipe(REPO_ROOT / "recipes" / "default.yaml", [*FAILING_OVERRIDES, "train.max_restarts=5"]).to_yaml())
    assert on_failure(defs, instance, run).tags[ATTEMPT_TAG] == "4"
    (run_dir("r2") / "recipe.yaml").write_text(
        load_recipe(REPO_ROOT / "recipes" / "default.yaml", [*FAILING_OVERRIDES, "train.max_restarts=0"]).to_yaml())
    assert "restart budget of 0 used up" in on_failure(defs, instance, run).skip_message


@pytest.mark.parametrize("case", ["user_error", "finished"])
def test_recovery_leaves_runs_a_relaunch_cannot_fix(defs, instance, case):
    if case == "user_error":  # no recipe saved for the partition: the asset fails with a user error
        run = failed_run(defs, instance, "r3")
        expected = "the failure needs a fix"
    else:
        save_recipe("r3")
        run = failed_run(defs, instance, "r3")
        (run_dir("r3") / "results.json").write_text("{}")
        expected = "the run finished"
    skip = on_failure(defs, instance, run)
    assert isinstance(skip, dg.SkipReason) and expected in skip.skip_message


def in_progress(instance, run_id: str, asset_key: dg.AssetKey, key: str) -> None:
    instance.add_run(dg.DagsterRun(job_name="job", run_id=run_id, status=dg.DagsterRunStatus.STARTED,
                                   asset_selection=frozenset({asset_key}), tags={"dagster/partition": key}))


def test_evaluations_target_the_latest_checkpoint_of_training_runs(instance):
    in_progress(instance, "training-a", RL_RUN_KEY, "a")
    in_progress(instance, "training-b", RL_RUN_KEY, "b")  # no checkpoint yet
    save_checkpoint("a", 2)
    latest = save_checkpoint("a", 4)
    save_checkpoint("c", 4)  # not training: not evaluated on a schedule

    (request,) = evaluation_requests(instance)
    assert request.partition_key == "a" and request.run_key == "a/step-000004"
    assert request.run_config == {"ops": {"evaluation": {"config": {"checkpoint": latest}}}}

    instance.report_runless_asset_event(dg.AssetMaterialization(
        asset_key=EVALUATION_KEY, partition="a", metadata={"checkpoint": dg.MetadataValue.path(latest)}))
    assert evaluation_requests(instance) == []  # already evaluated
    save_checkpoint("a", 6)
    assert [r.run_key for r in evaluation_requests(instance)] == ["a/step-000006"]
    in_progress(instance, "evaluating-a", EVALUATION_KEY, "a")
    assert evaluation_requests(instance) == []  # one evaluation of a run at a time


def test_evaluation_sensor_and_schedule_request_the_new_checkpoint(defs, instance):
    in_progress(instance, "training-a", RL_RUN_KEY, "a")
    save_checkpoint("a", 2)
    tick = sensor(defs, "checkpoint_evaluation_sensor")(dg.build_sensor_context(instance=instance, definitions=defs))
    scheduled = sensor(defs, "evaluation_schedule")(dg.build_schedule_context(instance=instance))
    for result in (tick, scheduled):
        assert [r.partition_key for r in result] == ["a"]


def test_a_run_failed_by_its_environment_is_not_relaunched(defs, instance, monkeypatch):
    """An environment failing past the recipe's `failures` limits needs a fix, not a restart."""
    import factory.run
    from factory.support.failures import EnvironmentFailure

    def broken_environment(*args, **kwargs):
        raise EnvironmentFailure("environment 'broken': 3 of 3 groups failed, 3 in a row (failures.max_in_a_row=3)")

    monkeypatch.setattr(factory.run, "run", broken_environment)
    save_recipe("r4", ["lake.enabled=false", "tracking.enabled=false"])
    skip = on_failure(defs, instance, failed_run(defs, instance, "r4"))
    assert isinstance(skip, dg.SkipReason)
    assert "the failure needs a fix: environment 'broken': 3 of 3 groups failed" in skip.skip_message


def test_evaluating_a_checkpoint_the_run_deleted_fails_with_a_line_naming_keep_checkpoints(defs, instance):
    """A run with train.keep_checkpoints deletes old checkpoints: an evaluation asked for one of them (queued
    while the run wrote newer ones) fails as a user error that says why and names the newest."""
    save_recipe("k1", [*FAILING_OVERRIDES, "train.keep_checkpoints=2"])
    newest = save_checkpoint("k1", 6)
    gone = str(run_dir("k1") / "checkpoints" / "step-000002")
    instance.add_dynamic_partitions(RL_RUNS.name, ["k1"])
    result = defs.resolve_job_def("evaluation_job").execute_in_process(
        instance=instance, partition_key="k1", raise_on_error=False,
        run_config={"ops": {"evaluation": {"config": {"checkpoint": gone}}}})
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    message = failure.step_failure_data.user_failure_data.description
    assert message == (f"checkpoint: {gone} is gone: the run keeps its newest train.keep_checkpoints=2 "
                       f"(newest now: {newest})")
