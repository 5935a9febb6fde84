"""Evaluations: a checkpoint of an RL run (by default its latest) on held-out tasks, while the run
may still be training. Scores go to the lake's `evaluations` table, the run's MLflow run and the
asset's metadata."""

import json
from pathlib import Path

import dagster as dg
from pydantic import Field

from assets.resources import LakeResource, RayResource, TrackingResource
from assets.runs import (
    CHECKPOINT_KEY, EVALUATION_KEY, KIND_TAG, RL_RUN_KEY, RL_RUNS, latest_checkpoint, run_dir, saved_recipe, user_error,
)


class EvaluationConfig(dg.Config):
    checkpoint: str = Field("", description="checkpoint dir; empty: the run's latest")
    suite: str = Field("heldout", description="evaluation suite")
    n: int = Field(0, ge=0, description="tasks to evaluate; 0: the recipe's eval.heldout")
    urls: list[str] = Field([], description="running vLLM servers (http://host:port) to evaluate on instead of "
                            "starting one; each takes the checkpoint's weights, so name none a run is training on")


def evaluate_checkpoint(recipe, checkpoint: Path, suite: str, n: int | None, keep_episodes: bool = False,
                        urls: list[str] | None = None) -> dict:
    """{mean, stderr, n, by_family[, episodes]} of `checkpoint` on `suite` — factory's job, called here only."""
    from factory.runtime.evaluation import evaluate_checkpoint as evaluate

    return evaluate(recipe, checkpoint, suite=suite, n=n, keep_episodes=keep_episodes, urls=urls or ())


def _digest(recipe, suite: str, n: int) -> str:
    """Which tasks an evaluation of `n` on `suite` scores (a seeded sample: the same in every run)."""
    from factory.data.heldout import suite_tasks, tasks_digest

    return tasks_digest(suite_tasks(recipe, suite, n))


@dg.asset(key=EVALUATION_KEY, partitions_def=RL_RUNS, group_name="evaluation",
          # the checkpoint it scores; rl_run too, so that main_job evaluates after training
          deps=[CHECKPOINT_KEY, RL_RUN_KEY],
          kinds={"ray"}, pool="evaluation", op_tags={KIND_TAG: "evaluation"})
def evaluation(context: dg.AssetExecutionContext, config: EvaluationConfig, lake: LakeResource,
               tracking: TrackingResource, ray: RayResource) -> dg.MaterializeResult:
    """Held-out accuracy of one checkpoint of the run (its latest unless configured). A checkpoint
    already evaluated on the same tasks of the suite (e.g. by the run itself after training) is read
    back from the lake instead of evaluated again."""
    key = context.partition_key
    directory = run_dir(key)
    recipe = tracking.configure(lake.configure(saved_recipe(directory)))
    checkpoint = Path(config.checkpoint) if config.checkpoint else latest_checkpoint(directory)
    if checkpoint is None:
        raise user_error(f"run {key} has no checkpoint yet ({directory / 'checkpoints'})")
    state_file = checkpoint / "state.json"
    if not checkpoint.exists() and recipe.train.keep_checkpoints:
        raise user_error(f"checkpoint: {checkpoint} is gone: the run keeps its newest "
                         f"train.keep_checkpoints={recipe.train.keep_checkpoints} (newest now: "
                         f"{latest_checkpoint(directory)})")
    if not state_file.is_file():
        raise user_error(f"checkpoint: {checkpoint} is not a checkpoint (no state.json)")
    state = json.loads(state_file.read_text())
    step, version = int(state.get("step", state["version"])), int(state["version"])

    from factory.lake.query import find_evaluation

    n = config.n or recipe.eval.heldout
    earlier = find_evaluation(key, step, config.suite, lake.catalog(recipe), lake.namespace_for(recipe)) \
        if recipe.lake.enabled else None
    # e.g. the run's own after-training evaluation; a row without a digest scored another subset (a prefix)
    reused = earlier is not None and earlier["n"] == n and earlier.get("tasks_digest") == _digest(recipe, config.suite, n)
    if earlier is not None and reused:
        context.log.info(f"{key} step {step}: already evaluated on {n} {config.suite} tasks; read from the lake")
        result = {"mean": earlier["mean"], "stderr": earlier["stderr"], "n": earlier["n"],
                  "by_family": json.loads(earlier["by_family"] or "{}"), "tasks_digest": earlier["tasks_digest"]}
    else:
        with ray.session():
            result = evaluate_checkpoint(recipe, checkpoint, config.suite, n, keep_episodes=recipe.lake.enabled,
                                         urls=config.urls)
    episodes = result.pop("episodes", None)
    context.log.info(f"{key} step {step}: {config.suite} accuracy {result['mean']:.3f} ± {result['stderr']:.3f}")

    from factory.recording import lineage

    # where the evaluated policy came from: the checkpoint's manifest, plus who evaluated it
    origin = lineage.read_manifest(checkpoint) if (checkpoint / "manifest.json").is_file() else {}
    origin = {**origin, "evaluation_dagster_run_id": context.run_id}
    if recipe.lake.enabled and not reused:  # (a row of this step and suite with another n stays: one per key)
        with lake.writer(recipe, run_id=key) as writer:
            writer.append("evaluations", [{
                "run_id": key, "step": step, "version": version, "suite": config.suite, "n": result["n"],
                "mean": result["mean"], "stderr": result["stderr"], "by_family": json.dumps(result["by_family"]),
                "tasks_digest": result.get("tasks_digest"), "checkpoint": str(checkpoint), "lineage": origin,
            }])
            if episodes:  # each episode in `samples`, status evaluation
                from factory.lake.writer import evaluation_rows

                writer.append("samples", evaluation_rows(key, step, version, config.suite, "evaluation_asset", episodes))
    mlflow_run = tracking.find_run(recipe, key)
    if mlflow_run and not reused:
        tracker = tracking.tracker(recipe)
        tracker.run_id = mlflow_run  # log beside the run's own metrics, without reopening it
        tracker.log_metrics(step, {f"eval/{config.suite}_mean": result["mean"],
                                   f"eval/{config.suite}_stderr": result["stderr"]})
        tracker.flush()
    return dg.MaterializeResult(metadata={
        "accuracy": result["mean"], "stderr": result["stderr"], "n": result["n"], "suite": config.suite,
        "step": step, "checkpoint": dg.MetadataValue.path(str(checkpoint)),
        "by_family": dg.MetadataValue.json(result["by_family"]),
        "source": "the lake (evaluated earlier)" if reused else "evaluated now",
        **({"mlflow_run_id": mlflow_run} if mlflow_run else {}),
        **({"recipe_hash": origin["recipe_hash"], "git_sha": origin["git_sha"],
            "lake_snapshots": dg.MetadataValue.json(origin["lake_snapshots"])} if "recipe_hash" in origin else {}),
    })
