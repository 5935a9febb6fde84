"""What every part of the code location shares about RL runs: the `rl_runs` dynamic partitions,
where a partition's run directory is, its saved recipe and latest checkpoint, run tags, and the
one way user errors become Dagster failures.

One partition of `rl_runs` is one RL run. Its key names the run directory
(`<state>/runs/<key>`), the run id in the lake's `run_id` partition and the MLflow run
(`factory.run` tag), so a relaunched partition continues all three.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

import dagster as dg
from pydantic import Field

from factory.paths import REPO_ROOT, runs_dir
from factory.recipe import Recipe, RecipeError, load_recipe
from factory.recording.recorder import checkpoints, latest_checkpoint  # noqa: F401  (assets import them from here)

RL_RUNS_NAME = "rl_runs"
RL_RUNS = dg.DynamicPartitionsDefinition(name=RL_RUNS_NAME)
RL_RUN_KEY = dg.AssetKey("rl_run")
EVALUATION_KEY = dg.AssetKey("evaluation")
CHECKPOINT_KEY = dg.AssetKey("checkpoint")  # reported by rl_run, one materialization per checkpoint written
DEFAULT_RECIPE = "recipes/default.yaml"

# run tags (the "factory/" prefix keeps them apart from Dagster's own "dagster/" tags)
KIND_TAG = "factory/kind"  # rl_run | evaluation | sweep
PARENT_RUN_TAG = "factory/parent_run_id"  # the failed run a recovery run continues
ROOT_RUN_TAG = "factory/root_run_id"  # the first run of a chain of recoveries
ATTEMPT_TAG = "factory/attempt"  # 0 for the first launch, k for the k-th recovery
SWEEP_RUN_TAG = "factory/sweep_run_id"  # the sweep_job run that planned this partition
PARTITION_TAG = "dagster/partition"

RETRYABLE = "factory/retryable"  # Failure metadata: False marks an error that a relaunch repeats

SAVED_RECIPE = "recipe.yaml"  # written by the sweep before the run, and by the run itself
LAUNCH_REQUEST = "launch.json"  # written by the sweep: "launch this partition" (read by a sensor)

_UNSAFE = re.compile(r"[^A-Za-z0-9_.=+-]+")


def user_error(message: str) -> dg.Failure:
    """A failure the user must fix (bad recipe, finished run, missing file): not relaunched."""
    return dg.Failure(description=message, metadata={RETRYABLE: False}, allow_retries=False)


def progress_log(log):
    """`log(message)` (a Dagster log call) that an outage of the event log's database cannot turn into a
    failed run: the line is lost, the run's own metrics, MLflow and the lake keep the record."""
    def call(message: str) -> None:
        try:
            log(message)
        except Exception as err:  # noqa: BLE001  (Dagster raises its storage's error, e.g. psycopg2's)
            print(f"dagster event log unreachable, progress line dropped: {str(err).splitlines()[0][:200]}",
                  file=sys.stderr, flush=True)

    return call


def calls(*callbacks):
    """One callback that calls each of `callbacks` that is not None (e.g. the Dagster log and live bars)."""
    present = [c for c in callbacks if c is not None]

    def call(*args) -> None:
        for callback in present:
            callback(*args)

    return call


def safe_name(recipe: Recipe) -> str:
    """The recipe's name with only characters a directory, a partition key and SQL quotes take."""
    return _UNSAFE.sub("_", recipe.name).strip("_")[:96] or "run"


def partition_key(recipe: Recipe) -> str:
    """`<recipe name>-<8 hex of its fingerprint>`: equal recipes share a key, any change makes a new one."""
    return f"{safe_name(recipe)}-{recipe.fingerprint()[:8]}"


def run_dir(key: str) -> Path:
    if not key or "/" in key or key.startswith("."):
        raise user_error(f"rl_runs partition {key!r}: not usable as a run directory name")
    return runs_dir() / key


def recipe_path(text: str) -> Path:
    """A recipe path as typed in the launchpad: absolute, relative to the working dir, or to the repo."""
    path = Path(text).expanduser()
    if path.is_absolute() or path.exists():
        return path
    return REPO_ROOT / path


def load_recipe_or_fail(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    try:
        return load_recipe(recipe_path(str(path)), list(overrides))
    except RecipeError as err:
        raise user_error(str(err)) from None


def saved_recipe(directory: Path) -> Recipe:
    """The recipe a run directory holds (the sweep saves it before the run; the run rewrites it)."""
    path = directory / SAVED_RECIPE
    if not path.is_file():
        raise user_error(f"{path}: no recipe saved for this run; launch it from sweep_job or give a recipe path")
    return load_recipe_or_fail(path)


def checkpoint_step(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step-"))


def is_finished(directory: Path) -> bool:
    """The run wrote its results (it trained every step and evaluated)."""
    return (directory / "results.json").is_file()


def rl_run_config(recipe: str | Path = "", overrides: Sequence[str] = (), resume_from: str | Path = "") -> dict:
    """Run config for a materialization of `rl_run` (the shape `RLRunConfig` takes)."""
    config = {"recipe": str(recipe), "overrides": list(overrides), "resume_from": str(resume_from or "")}
    return {"ops": {"rl_run": {"config": config}}}


def runs_in_progress(instance: dg.DagsterInstance, asset_key: dg.AssetKey,
                     statuses: tuple[dg.DagsterRunStatus, ...] | None = None) -> dict[str, str]:
    """{partition key: Dagster run id} of unfinished runs that materialize `asset_key`."""
    statuses = statuses or (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED,
                            dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED)
    found = {}
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=list(statuses))):
        key = run.tags.get(PARTITION_TAG)
        if key is not None and asset_key in (run.asset_selection or ()):
            found[key] = run.run_id
    return found


class RecipeConfig(dg.Config):
    """A recipe file and dotted overrides, as the launchpad form shows them."""

    recipe: str = Field(DEFAULT_RECIPE, description="recipe YAML (absolute, or relative to the repo)")
    overrides: list[str] = Field([], description="dotted overrides, e.g. train.steps=50")

    def load(self) -> Recipe:
        return load_recipe_or_fail(self.recipe, self.overrides)
