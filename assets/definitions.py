"""The code location's entry point: `dagster dev -m assets.definitions` (or `python -m assets`).

    task_dataset ─▶ base_policy ─▶ rl_run[rl_runs] ─▶ checkpoint[rl_runs] ─▶ evaluation[rl_runs]
    sandbox_image[name] ─────────▶   + samples checks
      + sandbox_health

Jobs: main_job (one recipe through the whole graph: `python -m assets materialize`), sweep_job
(recipe × grid → rl_runs partitions), rl_run_job, evaluation_job. Sensors:
rl_run_launcher (starts what a sweep planned), checkpoint_evaluation_sensor, rl_run_recovery
(failed run → relaunch from the last checkpoint). Schedule: evaluation_schedule (hourly).
Resources point where the profile says ($FACTORY_PROFILE: embedded | production), see `factory.support.profile`.
"""

from __future__ import annotations

import dagster as dg

from assets.automation import build_checkpoint_sensor, build_evaluation_schedule, build_recovery_sensor
from assets.checks import samples_checks
from assets.data import task_dataset
from assets.evaluation import evaluation
from assets.policy import base_policy
from assets.resources import resources_for
from assets.runs import EVALUATION_KEY, KIND_TAG, RL_RUN_KEY, RL_RUNS
from assets.sandboxes import sandbox_health, sandbox_image
from assets.sweeps import build_launch_sensor, sweep_job
from assets.training import checkpoint, rl_run

# RL runs are relaunched by rl_run_recovery (from their last checkpoint, with ancestry tags), never
# by Dagster's generic run retries, which would race it.
rl_run_job = dg.define_asset_job(
    "rl_run_job", selection=dg.AssetSelection.assets(RL_RUN_KEY), partitions_def=RL_RUNS,
    tags={KIND_TAG: "rl_run", "dagster/max_retries": "0"},
    description="Train one rl_runs partition, then check its samples in the lake.",
)
main_job = dg.define_asset_job(
    "main_job", selection=dg.AssetSelection.assets(task_dataset, base_policy, RL_RUN_KEY, EVALUATION_KEY),
    tags={KIND_TAG: "rl_run", "dagster/max_retries": "0"},
    description="One recipe end to end (the README's main command, `python -m assets materialize`): "
                "tasks → base policy → RL run (one rl_runs partition) → evaluation.",
)
evaluation_job = dg.define_asset_job(
    "evaluation_job", selection=dg.AssetSelection.assets(EVALUATION_KEY), partitions_def=RL_RUNS,
    tags={KIND_TAG: "evaluation"}, description="Evaluate a checkpoint of one rl_runs partition.",
)

defs = dg.Definitions(
    assets=[task_dataset, base_policy, rl_run, checkpoint, evaluation, sandbox_image],
    asset_checks=[*samples_checks(), sandbox_health],
    jobs=[main_job, sweep_job, rl_run_job, evaluation_job],
    sensors=[build_launch_sensor(rl_run_job), build_checkpoint_sensor(evaluation_job),
             build_recovery_sensor(rl_run_job)],
    schedules=[build_evaluation_schedule(evaluation_job)],
    resources=resources_for(),
    # each job's steps run in its run worker's process: one process per run (no step subprocesses
    # to orphan when a worker dies), and the run worker is the RL run's process (assets.launcher)
    executor=dg.in_process_executor,
)
