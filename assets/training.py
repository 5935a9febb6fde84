"""RL runs: one `rl_runs` partition per run, materialized by `factory.run.run`.

A materialization of a partition whose run directory already holds checkpoints (and no results)
continues from the latest one — so a relaunch after a crash, by hand or by the recovery sensor,
resumes the same run directory, lake partition and MLflow run.
"""

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from collections.abc import Iterator

import dagster as dg
from pydantic import Field

from assets.policy import base_policy
from factory import paths
from assets.sandboxes import sandbox_image
from assets.resources import LakeResource, ProgressResource, RayResource, TrackingResource
from assets.runs import (
    CHECKPOINT_KEY, KIND_TAG, LAUNCH_REQUEST, PARENT_RUN_TAG, RL_RUN_KEY, RL_RUNS, SWEEP_RUN_TAG, calls,
    checkpoint_step, checkpoints, is_finished, latest_checkpoint, load_recipe_or_fail, progress_log, run_dir,
    saved_recipe, user_error,
)

# Checkpoints are their own node in the asset graph (rl_run ─▶ checkpoint ─▶ evaluation): rl_run reports
# a materialization of its partition for each checkpoint it wrote, with the checkpoint's manifest as
# metadata, so an evaluation leads in the UI to the exact checkpoint, recipe, code and lake snapshot.
checkpoint = dg.AssetSpec(CHECKPOINT_KEY, deps=[RL_RUN_KEY], partitions_def=RL_RUNS, group_name="training",
                          kinds={"pytorch"}, description="A checkpoint of an RL run (reported by rl_run; metadata: "
                          "step, path, recipe hash, git sha, base policy, lake snapshot ids)")


def checkpoint_event(key: str, path: Path) -> dg.AssetMaterialization:
    from factory.recording import lineage

    manifest = lineage.read_manifest(path) if (path / "manifest.json").is_file() else {}
    return dg.AssetMaterialization(CHECKPOINT_KEY, partition=key, metadata={
        "step": checkpoint_step(path), "path": dg.MetadataValue.path(str(path)),
        **{k: str(manifest[k]) for k in ("recipe_hash", "git_sha", "git_dirty", "base_policy_fingerprint",
                                          "mlflow_run_id", "dagster_run_id") if manifest.get(k) is not None},
        **({"lake_snapshots": dg.MetadataValue.json(manifest["lake_snapshots"])} if manifest else {}),
    })


class RLRunConfig(dg.Config):
    recipe: str = Field("", description="recipe YAML; empty: the recipe saved in the run dir by sweep_job")
    overrides: list[str] = Field([], description="dotted overrides, e.g. async.max_staleness=2")
    resume_from: str = Field("", description="checkpoint dir to resume from; empty: the run dir's latest, if any")


@contextmanager
def exclusive(directory: Path) -> Iterator[None]:
    """Hold a lock on the run directory: two processes must never train into one run."""
    with ExitStack() as stack:
        try:
            stack.enter_context(paths.exclusive(directory / ".lock", wait=False))
        except paths.Locked as held:
            raise user_error(f"{directory}: another process is training this run (pid {held.holder})") from None
        yield


def _accuracy(results: dict, key: str) -> dict:
    evaluation = results.get(key)
    if not evaluation:
        return {}
    return {f"accuracy_{key}": evaluation["mean"], f"accuracy_{key}_stderr": evaluation["stderr"],
            f"accuracy_{key}_n": evaluation["n"]}


# every sandbox image is upstream of the runs (a run's metadata names the one its environment used)
@dg.asset(key=RL_RUN_KEY, partitions_def=RL_RUNS, group_name="training",
          deps=[base_policy, dg.AssetDep(sandbox_image, partition_mapping=dg.AllPartitionMapping())],
          kinds={"ray", "pytorch"}, pool="trainer", op_tags={KIND_TAG: "rl_run"})
def rl_run(context: dg.AssetExecutionContext, config: RLRunConfig, lake: LakeResource,
           tracking: TrackingResource, ray: RayResource, progress: ProgressResource) -> dg.MaterializeResult:
    """One RL run (`factory.run.run`): trains the recipe, evaluates before/after, records to lake and MLflow."""
    from factory.recording import lineage
    from factory.run import run

    key = context.partition_key
    directory = run_dir(key)
    recipe = load_recipe_or_fail(config.recipe, config.overrides) if config.recipe else saved_recipe(directory)
    if recipe.sweep:
        raise user_error(f"{config.recipe}: holds a sweep grid; launch it with sweep_job (one partition per point)")
    if is_finished(directory):
        raise user_error(f"run {key} already finished ({directory / 'results.json'}); "
                         "add a new partition (sweep_job) to train again")
    resume = Path(config.resume_from) if config.resume_from else latest_checkpoint(directory)
    if resume is not None and not (resume / "state.json").is_file():
        raise user_error(f"resume_from: {resume} is not a checkpoint (no state.json)")
    recipe = tracking.configure(lake.configure(recipe))
    every = max(1, recipe.train.steps // 20)
    info = progress_log(context.log.info)  # a Postgres restart mid-run must not fail the run through its log

    def log_step(report) -> None:
        if report.step % every == 0 or report.step == recipe.train.steps:
            m = report.metrics
            info(f"step {report.step}/{recipe.train.steps} "
                             f"reward {m.get('rollout/reward_mean', 0):.3f} "
                             f"{m.get('perf/generated_samples_per_s', 0):.0f} generated / "
                             f"{m.get('perf/trained_samples_per_s', 0):.0f} trained samples/s (last 20 steps) "
                             f"staleness max {m.get('staleness/max', 0):.0f}")

    sft_every = max(1, recipe.model.sft_steps // 10)

    def log_sft_step(step: int, total: int, loss: float) -> None:
        if step % sft_every == 0 or step == total:
            info(f"SFT warm start step {step}/{total} loss {loss:.4f}")

    if resume is not None:
        context.log.info(f"resuming {key} from {resume} (step {checkpoint_step(resume)})")
    # lineage: who launched this attempt, recorded with the run (lake `runs` row, MLflow tags, manifests)
    request = directory / LAUNCH_REQUEST
    planned = json.loads(request.read_text()) if request.is_file() else {}
    lineage.set_context(dagster_run_id=context.run_id, sweep_run_id=context.run.tags.get(SWEEP_RUN_TAG),
                        parent_run_id=context.run.tags.get(PARENT_RUN_TAG),
                        mlflow_parent_run_id=planned.get("mlflow_parent_run_id"))
    from factory.support.failures import EnvironmentFailure

    with exclusive(directory), ray.session(), progress.bars(recipe.train.steps) as bars:
        try:
            results = run(recipe, directory, resume_from=resume,
                          on_step=calls(log_step, bars and bars.on_step),
                          on_phase=calls(info, bars and bars.on_phase),
                          on_sft_step=calls(log_sft_step, bars and bars.on_sft_step))
        except EnvironmentFailure as err:  # the environment needs a fix: relaunching would fail the same way
            raise user_error(str(err)) from err

    metadata = {
        "run_dir": dg.MetadataValue.path(str(directory)),
        "recipe": recipe.name,
        "fingerprint": recipe.fingerprint(),
        "max_staleness": recipe.async_.max_staleness,
        **_accuracy(results, "before"),
        **_accuracy(results, "after"),
        "samples_trained": results.get("samples_trained"),
        "train_seconds": round(results.get("train_seconds", 0.0), 1),
        "total_seconds": round(results.get("total_seconds", 0.0), 1),
        "trainer_idle_fraction": results.get("trainer_idle_fraction"),
        "resumed_from": str(resume) if resume else "",
    }
    if "delta" in results:
        metadata.update(delta=results["delta"], delta_stderr=results["delta_stderr"],
                        improved_beyond_2se=results["improved_beyond_2se"])
    mlflow_run = tracking.find_run(recipe, key)
    if mlflow_run:
        metadata["mlflow_run_id"] = mlflow_run
    from factory.envs.base import environment_factory

    if getattr(environment_factory(recipe.environment.name), "uses_sandbox", False):
        sandbox = recipe.environment.sandbox
        metadata["sandbox_image"] = f"{sandbox.image} (backend {sandbox.backend})"
    last = latest_checkpoint(directory)
    if last is not None and (last / "manifest.json").is_file():  # where the final policy came from
        manifest = lineage.read_manifest(last)
        metadata.update({"checkpoint": dg.MetadataValue.path(str(last)), "recipe_hash": manifest["recipe_hash"],
                         "git_sha": manifest["git_sha"], "git_dirty": str(manifest["git_dirty"]),
                         "base_policy_fingerprint": manifest["base_policy_fingerprint"] or "",
                         "lake_snapshots": dg.MetadataValue.json(manifest["lake_snapshots"])})
    start = checkpoint_step(resume) if resume is not None else 0
    for path in checkpoints(directory):
        if checkpoint_step(path) > start:  # those of this attempt (the resumed one was reported before)
            context.log_event(checkpoint_event(key, path))
    context.log.info(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict)}, default=str))
    return dg.MaterializeResult(metadata={k: v for k, v in metadata.items() if v is not None})
