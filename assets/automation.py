"""What runs by itself: evaluations of active runs' checkpoints (a schedule and a sensor) and the
recovery of failed RL runs from their last checkpoint (a run-failure sensor). Each is a small
factory taking the job it launches."""

from pathlib import Path

import dagster as dg

from assets.runs import (
    ATTEMPT_TAG, EVALUATION_KEY, KIND_TAG, PARENT_RUN_TAG, PARTITION_TAG, RETRYABLE, RL_RUN_KEY, ROOT_RUN_TAG,
    SAVED_RECIPE, SWEEP_RUN_TAG, is_finished, latest_checkpoint, load_recipe_or_fail, rl_run_config, run_dir,
    runs_in_progress,
)

# ---- evaluations -----------------------------------------------------------------------------


def last_evaluated_checkpoint(instance: dg.DagsterInstance, key: str) -> str | None:
    """The checkpoint path of the newest `evaluation` materialization of partition `key`."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=EVALUATION_KEY, asset_partitions=[key]), limit=1).records
    if not records:
        return None
    materialization = records[0].asset_materialization
    checkpoint = materialization.metadata.get("checkpoint") if materialization is not None else None
    return None if checkpoint is None else str(checkpoint.value)


def evaluation_requests(instance: dg.DagsterInstance) -> list[dg.RunRequest]:
    """One evaluation of the latest checkpoint of every RL run now training, unless already
    evaluated or being evaluated."""
    training = runs_in_progress(instance, RL_RUN_KEY, statuses=(dg.DagsterRunStatus.STARTED,))
    evaluating = runs_in_progress(instance, EVALUATION_KEY)
    requests = []
    for key in sorted(training):
        checkpoint = latest_checkpoint(run_dir(key))
        if key in evaluating or checkpoint is None or last_evaluated_checkpoint(instance, key) == str(checkpoint):
            continue
        requests.append(dg.RunRequest(
            run_key=f"{key}/{checkpoint.name}", partition_key=key, tags={KIND_TAG: "evaluation"},
            run_config={"ops": {"evaluation": {"config": {"checkpoint": str(checkpoint)}}}},
        ))
    return requests


def _evaluations_or_skip(instance: dg.DagsterInstance):
    return evaluation_requests(instance) or dg.SkipReason("no training run has a new checkpoint")


def build_evaluation_schedule(job, cron: str = "0 * * * *") -> dg.ScheduleDefinition:
    @dg.schedule(name="evaluation_schedule", job=job, cron_schedule=cron,
                 default_status=dg.DefaultScheduleStatus.RUNNING,
                 description="Evaluates the latest checkpoint of every RL run in progress (hourly).")
    def evaluation_schedule(context: dg.ScheduleEvaluationContext):
        return _evaluations_or_skip(context.instance)

    return evaluation_schedule


def build_checkpoint_sensor(job, interval_s: int = 60) -> dg.SensorDefinition:
    @dg.sensor(name="checkpoint_evaluation_sensor", job=job, minimum_interval_seconds=interval_s,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Evaluates each new checkpoint of an RL run in progress, while it keeps training.")
    def checkpoint_evaluation_sensor(context: dg.SensorEvaluationContext):
        return _evaluations_or_skip(context.instance)

    return checkpoint_evaluation_sensor


# ---- recovery --------------------------------------------------------------------------------


def user_error_of(instance: dg.DagsterInstance, run_id: str) -> str | None:
    """The message of a step failure in the run marked not retryable (a user error), if any."""
    for record in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
        data = record.dagster_event.step_failure_data if record.dagster_event else None
        failure = data.user_failure_data if data is not None else None
        flag = failure.metadata.get(RETRYABLE) if failure is not None else None
        if failure is not None and flag is not None and flag.value is False:
            return failure.description or "user error"
    return None


def max_restarts(directory: Path) -> int:
    """The run's restart budget: `train.max_restarts` of the recipe saved in its directory."""
    return load_recipe_or_fail(directory / SAVED_RECIPE).train.max_restarts


def build_recovery_sensor(job) -> dg.SensorDefinition:
    """Relaunch a failed run of `job` (the rl_run job) from its partition's latest checkpoint."""

    @dg.run_failure_sensor(name="rl_run_recovery", monitored_jobs=[job], request_job=job,
                           default_status=dg.DefaultSensorStatus.RUNNING, minimum_interval_seconds=10,
                           description="Relaunches a failed RL run from its last checkpoint, up to its restart budget.")
    def rl_run_recovery(context: dg.RunFailureSensorContext):
        failed = context.dagster_run
        key = failed.tags.get(PARTITION_TAG)
        if key is None:
            return dg.SkipReason(f"run {failed.run_id} has no rl_runs partition")
        directory = run_dir(key)
        reason = user_error_of(context.instance, failed.run_id)
        if reason is not None:
            return dg.SkipReason(f"{key}: not relaunched, the failure needs a fix: {reason}")
        if is_finished(directory):
            return dg.SkipReason(f"{key}: the run finished (results.json); only a later step failed")
        if not (directory / SAVED_RECIPE).is_file():
            return dg.SkipReason(f"{key}: no recipe saved in {directory}: nothing to relaunch")
        attempt = int(failed.tags.get(ATTEMPT_TAG, "0")) + 1
        try:
            budget = max_restarts(directory)
        except dg.Failure as err:  # the saved recipe no longer loads: a relaunch would fail the same way
            return dg.SkipReason(f"{key}: not relaunched: {err.description}")
        if attempt > budget:
            return dg.SkipReason(f"{key}: restart budget of {budget} used up; last failed run {failed.run_id}")
        checkpoint = latest_checkpoint(directory)
        context.log.info(f"relaunching {key} (attempt {attempt}/{budget}) from "
                         f"{checkpoint or 'the start: no checkpoint yet'}")
        tags = {PARENT_RUN_TAG: failed.run_id, ROOT_RUN_TAG: failed.tags.get(ROOT_RUN_TAG, failed.run_id),
                ATTEMPT_TAG: str(attempt)}
        if SWEEP_RUN_TAG in failed.tags:
            tags[SWEEP_RUN_TAG] = failed.tags[SWEEP_RUN_TAG]
        return dg.RunRequest(run_key=f"recover-{failed.run_id}", partition_key=key, tags=tags,
                             run_config=rl_run_config(directory / SAVED_RECIPE, resume_from=checkpoint or ""))

    return rl_run_recovery
