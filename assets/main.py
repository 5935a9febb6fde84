"""`python -m assets materialize [RECIPE] [OVERRIDES…]` (`make main`): one recipe through the
whole asset graph, in this process, on the embedded Dagster instance (DAGSTER_HOME=<state>/dagster).

    task_dataset ─▶ base_policy ─▶ rl_run[<name>-<time>] ─▶ evaluation[<name>-<time>]

The recipe is saved in a new run directory named like its rl_runs partition; `main_job` (the same
job the UI shows) materializes the four assets with live progress bars on this terminal, then the
run's summary is printed with how to open the Dagster UI and the MLflow UI and a SQL query to try.
`factory run RECIPE` stays the direct path, without Dagster.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import dagster as dg

from assets.runs import DEFAULT_RECIPE, RL_RUNS_NAME, SAVED_RECIPE, recipe_path, run_dir, safe_name
from factory.recipe import Recipe, RecipeError, load_recipe


def live_definitions() -> dg.Definitions:
    """The code location's definitions with progress drawn on this terminal."""
    from assets.definitions import defs
    from assets.resources import ProgressResource

    return dg.Definitions(assets=defs.assets, asset_checks=defs.asset_checks, jobs=defs.jobs,
                          resources={**(defs.resources or {}), "progress": ProgressResource(live=True)},
                          executor=defs.executor)


def main_run_config(saved: Path) -> dict:
    """Every asset of main_job reads the recipe saved in the run directory; Dagster's console log
    shows warnings only (progress bars and the event log carry the rest)."""
    recipe = {"config": {"recipe": str(saved), "overrides": []}}
    return {"ops": {"task_dataset": recipe, "base_policy": recipe,
                    "rl_run": {"config": {"recipe": str(saved), "overrides": [], "resume_from": ""}}},
            "loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def new_partition(recipe: Recipe) -> str:
    """`<recipe name>-<time>`, like `factory run`'s run directories: each main run is a new run."""
    return f"{safe_name(recipe)}-{time.strftime('%Y%m%d-%H%M%S')}"


def materialize(recipe_file: str, overrides: list[str]) -> int:
    from assets.__main__ import prepare_home

    try:
        recipe = load_recipe(recipe_path(recipe_file), overrides)
    except RecipeError as err:
        print(str(err), file=sys.stderr)
        return 2
    if recipe.sweep:
        print(f"error: {recipe_file} holds a sweep grid: launch it with sweep_job in the Dagster UI "
              f"or `factory sweep {recipe_file}`", file=sys.stderr)
        return 2
    home = prepare_home()
    os.environ["DAGSTER_HOME"] = str(home)
    key = new_partition(recipe)
    directory = run_dir(key)
    directory.mkdir(parents=True)
    saved = directory / SAVED_RECIPE
    saved.write_text(recipe.to_yaml())
    print(f"» materializing {recipe.name} through Dagster (DAGSTER_HOME={home}): "
          f"task_dataset → base_policy → rl_run[{key}] → evaluation[{key}]", file=sys.stderr)

    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions(RL_RUNS_NAME, [key])
        job = live_definitions().resolve_job_def("main_job")
        result = job.execute_in_process(run_config=main_run_config(saved), instance=instance, partition_key=key,
                                        raise_on_error=False)
    if not result.success:
        for event in result.get_step_failure_events():
            data = event.step_failure_data
            message = (data.user_failure_data.description if data.user_failure_data else None) or \
                (data.error.message.strip().splitlines()[-1] if data.error else "failed")
            print(f"error: {event.step_key}: {message}", file=sys.stderr)
        print(f"the run's events and tracebacks: Dagster UI (below), run {result.run_id}", file=sys.stderr)
        print_next_steps(recipe, key, result.run_id)
        return 1

    from factory.cli import print_summary

    print_summary(json.loads((directory / "results.json").read_text()))
    evaluation = result.asset_materializations_for_node("evaluation")
    if evaluation:
        meta = evaluation[0].metadata
        print(f"evaluation asset   : step {meta['step'].value}: {meta['accuracy'].value:.3f} ± "
              f"{meta['stderr'].value:.3f} (n={meta['n'].value}, {meta['source'].value})")
    print_next_steps(recipe, key, result.run_id)
    return 0


def _tracking_uri(recipe: Recipe) -> str:
    from factory.recording.tracking import default_tracking_uri

    return recipe.tracking.uri or default_tracking_uri()


def print_next_steps(recipe: Recipe, key: str, dagster_run_id: str) -> None:
    python = Path(sys.executable)
    venv_bin = python.parent
    here = Path.cwd()

    def shown(path: Path) -> str:  # relative to the working dir when below it
        return str(path.relative_to(here)) if path.is_relative_to(here) else str(path)

    from factory.cli import samples_by_status_query, state_prefix

    query = samples_by_status_query(key)
    lines = ["", "== where to look ==",
             f"Dagster UI (asset graph, this run, sweeps): {shown(python)} -m assets -p 3000",
             f"    then http://127.0.0.1:3000/asset-groups and http://127.0.0.1:3000/runs/{dagster_run_id}"]
    if recipe.tracking.enabled:
        from factory.recording.tracking import ui_hint

        lines += [f"MLflow UI (metrics, plots):  {ui_hint(_tracking_uri(recipe), shown(venv_bin / 'mlflow'))}",
                  f"    (experiment '{recipe.tracking.experiment}', run '{key}')"]
    if recipe.lake.enabled:
        lines += [f'SQL over the lake:  {state_prefix()}{shown(venv_bin / "factory")} lake sql "{query}"']
    print("\n".join(lines))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m assets materialize",
        description="Materialize one recipe's asset graph (tasks → base policy → RL run → evaluation) "
                    "on the embedded Dagster instance, in this process.")
    parser.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE, help=f"recipe YAML (default {DEFAULT_RECIPE})")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50")
    args = parser.parse_args(argv)
    return materialize(args.recipe, args.overrides)
