"""How to split a small machine's cores between the trainer and the engine: each split, side by side.

Runs the default recipe (held-out evaluation off) for `--steps` steps at each η in `--etas` with
every (trainer threads, engine threads) pair in `--threads` (by default 1 and all cores), and reports
over the steps after `--skip`: the median step, completions generated per second and samples
trained per second, each as a ratio over the 1 + 1 split measured in the same pass. Then what
`threads: auto` resolves to on this machine for each η, and where it ranks (its ratio to the best).

The env worker, the driver, vLLM's API server and Ray share the same cores (see
bench/step_anatomy.py's CPU table), so "all cores" to both sides oversubscribes the machine: that
is what is measured. Results: bench/results/thread_budget.json.

    python bench/thread_budget.py [--steps 50] [--skip 10] [--etas 0 1] [--threads 1 2] [override ...]
"""

from __future__ import annotations

import argparse
import itertools
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


def measure(recipe, skip: int) -> dict:
    """One run: median step, completions generated/s and samples trained/s over the steps after `skip`."""
    from factory.run import run

    walls: list[float] = []
    generated: list[float] = []
    trained: list[float] = []
    last = [time.perf_counter()]

    def on_step(report) -> None:
        now = time.perf_counter()
        walls.append(now - last[0])
        generated.append(report.metrics.get("buffer/finished_samples", 0.0))
        trained.append(report.metrics.get("perf/trained_samples", 0.0))
        last[0] = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        run(recipe, Path(tmp) / "run", on_step=on_step)
    span = sum(walls[skip:])
    return {"median_step_s": statistics.median(walls[skip:]),
            "generated_per_s": (generated[-1] - generated[skip - 1]) / span,
            "trained_per_s": (trained[-1] - trained[skip - 1]) / span}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="thread counts to pair (default: 1 and all)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "thread_budget.json"))
    ap.add_argument("--summarize", action="store_true", help="re-summarise the results file (no runs): after "
                    "the rule in factory/support/threads.py changed")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    args = ap.parse_args()
    if args.summarize:
        import json

        data = json.loads(Path(args.out).read_text())
        data["auto"] = summarize(data["runs"], data["cores"], sorted({r["max_staleness"] for r in data["runs"]}))
        write_results(args.out, {k: v for k, v in data.items() if k not in ("machine", "when")})
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from factory.training.base_policy import ensure_base_policy
    from factory.recipe import load_recipe
    from factory.support.threads import available_cores

    cores = available_cores()
    counts = args.threads or sorted({1, cores})
    base = load_recipe(REPO / "recipes" / "default.yaml", [
        f"train.steps={args.steps}", "eval.before=false", "eval.after=false", "train.checkpoint_every=0",
        "name=bench-thread-budget", *args.overrides])
    ensure_base_policy(base)
    rows = []
    for eta in args.etas:
        for t, e in itertools.product(counts, counts):
            recipe = base.model_copy(deep=True)
            recipe.async_.max_staleness, recipe.train.threads, recipe.rollout.cpus = eta, t, e
            print(f"η={eta} trainer {t} engine {e} ...", flush=True)
            rows.append({"max_staleness": eta, "trainer_threads": t, "engine_threads": e,
                         **measure(recipe, args.skip)})
            print(f"  median step {rows[-1]['median_step_s'] * 1000:.0f} ms, "
                  f"{rows[-1]['generated_per_s']:.0f} generated/s", flush=True)
    write_results(args.out, {"cores": cores, "steps": args.steps, "skip": args.skip, "overrides": args.overrides,
                             "runs": rows, "auto": summarize(rows, cores, args.etas)})
    return 0


def summarize(rows: list[dict], cores: int, etas: list[int]) -> dict:
    """Ratios over the 1 + 1 split at each η (added to `rows`), a table, and for each η what
    `auto` resolves to on this machine against the best split measured."""
    from factory.support.threads import thread_split

    auto = {}
    print(f"\n{cores} cores; ratios over 1 + 1 at the same η")
    print(f"{'η':>2} {'trainer':>8} {'engine':>7} {'step ms':>8} {'gen/s':>7} {'trained/s':>10} "
          f"{'step ×':>7} {'gen ×':>6} {'trained ×':>10}")
    for eta in etas:
        at = [r for r in rows if r["max_staleness"] == eta]
        ref = next(r for r in at if r["trainer_threads"] == r["engine_threads"] == 1)
        for r in at:
            r["step_over_1_1"] = r["median_step_s"] / ref["median_step_s"]
            r["generated_over_1_1"] = r["generated_per_s"] / ref["generated_per_s"]
            r["trained_over_1_1"] = r["trained_per_s"] / ref["trained_per_s"]
            print(f"{eta:>2} {r['trainer_threads']:>8} {r['engine_threads']:>7} {r['median_step_s'] * 1000:>8.0f} "
                  f"{r['generated_per_s']:>7.0f} {r['trained_per_s']:>10.0f} {r['step_over_1_1']:>6.2f}x "
                  f"{r['generated_over_1_1']:>5.2f}x {r['trained_over_1_1']:>9.2f}x")
        best = max(at, key=lambda r: r["trained_per_s"])
        pick = thread_split(cores, engines=1, max_staleness=eta)
        chosen = next((r for r in at if (r["trainer_threads"], r["engine_threads"]) == pick), None)
        auto[str(eta)] = {"auto": list(pick), "best": [best["trainer_threads"], best["engine_threads"]],
                          "auto_over_best_trained": chosen["trained_per_s"] / best["trained_per_s"] if chosen else None}
        print(f"η={eta}: auto → trainer {pick[0]}, engine {pick[1]}; best measured → trainer "
              f"{best['trainer_threads']}, engine {best['engine_threads']}"
              + (f"; auto reaches {auto[str(eta)]['auto_over_best_trained']:.2f} of the best" if chosen else ""))
    return auto


if __name__ == "__main__":
    sys.exit(main())
