"""Sweeps: a recipe and a grid, picked in the launchpad, become one `rl_runs` partition per grid
point; a sensor then launches an RL run for each partition the sweep asked for.

    sweep_job (plan_sweep op)                          rl_run_launcher (sensor, every 10 s)
      recipe × grid ─▶ expand_sweep ─▶ per point:        per partition with launch.json, not
        <runs>/<key>/recipe.yaml, launch.json  ─────▶    finished, not running: RunRequest
        add partition <key> to rl_runs                   (run_key = key@sweep run: once per sweep)

An empty grid plans one run of the recipe as it is: sweep_job is also how a single run is launched.
"""

import json
import time

import dagster as dg
import yaml
from pydantic import Field

from assets.runs import (
    ATTEMPT_TAG, DEFAULT_RECIPE, KIND_TAG, LAUNCH_REQUEST, RL_RUN_KEY, RL_RUNS_NAME, SAVED_RECIPE, SWEEP_RUN_TAG,
    is_finished, load_recipe_or_fail, partition_key, rl_run_config, run_dir, runs_in_progress, user_error,
)
from factory.recipe import RecipeError, expand_sweep, parse_override


class SweepConfig(dg.Config):
    recipe: str = Field(DEFAULT_RECIPE, description="recipe YAML (absolute, or relative to the repo)")
    overrides: list[str] = Field([], description="dotted overrides applied to every grid point, e.g. train.steps=50")
    grid: list[str] = Field([], description=(
        'one axis per line: FIELD.PATH=V1,V2,... (values read as YAML: 3e-4, true, ppo_clip), or '
        'FIELD.PATH=[V1, V2] for values that contain commas; the grid is the product of the axes '
        "and extends the recipe's own sweep section"))


def parse_grid(axes: list[str]) -> dict[str, list]:
    """["algorithm.loss=ppo_clip,reinforce", "async.max_staleness=0,2"] -> {path: [values]}."""
    grid: dict[str, list] = {}
    for axis in axes:
        path, sep, raw = axis.partition("=")
        path, raw = path.strip(), raw.strip()
        if not sep or not path or not raw:
            raise user_error(f"grid: {axis!r}: expected FIELD.PATH=V1,V2 (e.g. async.max_staleness=0,1,2)")
        if raw.startswith("["):
            try:
                values = yaml.safe_load(raw)
            except yaml.YAMLError:
                values = None
            if not isinstance(values, list) or not values:
                raise user_error(f"grid: {axis!r}: the value list {raw} is not a non-empty YAML list")
        else:
            values = [parse_override(f"{path}={v.strip()}")[1] for v in raw.split(",") if v.strip()]
        if path in grid:
            raise user_error(f"grid: {path!r} appears twice; give one line per field")
        grid[path] = values
    return grid


def _mlflow_parent_run(context, recipe, grid: dict, points: int) -> str | None:
    """The sweep as a parent MLflow run; each RL run of it becomes a child (tag mlflow.parentRunId)."""
    if not recipe.tracking.enabled:
        return None
    from factory.recording.tracking import RunTracker

    tracker = RunTracker(recipe.tracking.uri, recipe.tracking.experiment)
    run_id = tracker.start(f"sweep-{context.run_id[:8]}", params={"grid": {k: list(v) for k, v in grid.items()}},
                           tags={"factory.sweep_run_id": context.run_id, "factory.points": str(points)})
    tracker.end("FINISHED")  # the planning; the children carry the training
    return run_id


@dg.op(tags={KIND_TAG: "sweep"})
def plan_sweep(context: dg.OpExecutionContext, config: SweepConfig) -> list[str]:
    """Expand recipe × grid and add one rl_runs partition per point (the launcher sensor starts them)."""
    recipe = load_recipe_or_fail(config.recipe, config.overrides)
    grid = {**recipe.sweep, **parse_grid(config.grid)}
    try:
        recipe.sweep = grid
        points = expand_sweep(recipe)
    except (RecipeError, ValueError) as err:
        raise user_error(f"{config.recipe}: {err}") from None

    parent = _mlflow_parent_run(context, recipe, grid, len(points))
    keys, lines = [], []
    for point, sub in points:
        key = partition_key(sub)
        directory = run_dir(key)
        if is_finished(directory):
            status = "finished earlier: not relaunched"
        else:
            directory.mkdir(parents=True, exist_ok=True)
            if not (directory / SAVED_RECIPE).is_file():
                (directory / SAVED_RECIPE).write_text(sub.to_yaml())
            request = {"sweep_run_id": context.run_id, "point": point, "recipe": config.recipe,
                       "overrides": list(config.overrides), "requested_at": time.time(),
                       "mlflow_parent_run_id": parent}
            (directory / LAUNCH_REQUEST).write_text(json.dumps(request, indent=2, default=str))
            status = "requested"
        keys.append(key)
        lines.append(f"| {key} | {json.dumps(point, default=str)} | {status} |")
    context.instance.add_dynamic_partitions(RL_RUNS_NAME, keys)
    context.log.info(f"sweep of {len(keys)} run(s): {', '.join(keys)}")
    context.add_output_metadata({
        "runs": len(keys),
        "partitions": dg.MetadataValue.md("| partition | grid point | status |\n|---|---|---|\n" + "\n".join(lines)),
        "grid": dg.MetadataValue.json({k: list(v) for k, v in grid.items()}),
    })
    return keys


@dg.job(tags={KIND_TAG: "sweep"}, description="Plan a sweep: one rl_runs partition per grid point of recipe × grid.")
def sweep_job():
    plan_sweep()


def build_launch_sensor(job, interval_s: int = 10) -> dg.SensorDefinition:
    """A sensor that launches `job` (the rl_run job) for each partition a sweep requested."""

    @dg.sensor(name="rl_run_launcher", job=job, minimum_interval_seconds=interval_s,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Launches an RL run for each rl_runs partition sweep_job requested (once per sweep).")
    def rl_run_launcher(context: dg.SensorEvaluationContext):
        running = runs_in_progress(context.instance, RL_RUN_KEY)
        requests = []
        for key in context.instance.get_dynamic_partitions(RL_RUNS_NAME):
            try:
                directory = run_dir(key)
            except dg.Failure:
                continue  # a partition added by hand whose name is no directory: nothing was requested
            request_file = directory / LAUNCH_REQUEST
            if not request_file.is_file() or is_finished(directory) or key in running:
                continue
            request = json.loads(request_file.read_text())
            requests.append(dg.RunRequest(
                run_key=f"{key}@{request['sweep_run_id']}", partition_key=key,
                run_config=rl_run_config(directory / SAVED_RECIPE),
                tags={SWEEP_RUN_TAG: request["sweep_run_id"], ATTEMPT_TAG: "0"},
            ))
        return requests or dg.SkipReason("no requested rl_runs partition waits for a launch")

    return rl_run_launcher
