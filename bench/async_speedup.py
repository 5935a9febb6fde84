"""Synchronous against asynchronous training on a heavy-tailed environment, side by side: the same
recipe at each η and partial-rollout mode, against one shared vLLM server, timed to train the same samples.

The same small recipe runs at each η (0 synchronous, 1 one-step off-policy, k asynchronous) and,
for η > 0, each partial-rollout mode (wait, abort_resume, inflight), against one shared vLLM
server. The environment's episodes take `fast_s` after the model replies, except a fraction
`slow_fraction` that take `slow_s` (about 20× longer): the long tail that synchronous training
waits for. Prints time to train N samples, the speed-up over the first row, the trainer's idle
fraction and the held-out accuracy after training; writes bench/results/async_speedup.json.

Before the first timed row a short untimed run warms the engine (vLLM's first batches after
start-up are slow), so no row pays for it. The trainer's idle fraction is reported over the whole
run and after the first batch: an asynchronous run first waits for its pipeline to fill
(`fill s`, the wait for the first batch), then for nothing if generation keeps up.

    python bench/async_speedup.py [--steps 40] [--etas 0 1 4] [--modes wait abort_resume inflight] [--repeats 2]

`--repeats N` runs the whole grid N times, one pass after another, and reports each row's median
(held-out accuracy: the mean): a machine that slows down or speeds up mid-benchmark then
affects every row alike instead of the rows that happened to run late.

`--scheduling` runs the long-tail scheduling comparison instead (results to
bench/results/scheduling.json): synchronous (η = 0) steps with fewer slots than groups per step
(4 vs 8), slowness a property of the task (some prompts always take ~20× longer) and a small
task set so prompts recur — FIFO, longest-first (predicted from the run's own history),
over-provisioning by half a step, and both.
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

HEAVY_TAIL = ["environment.latency.fast_s=0.05", "environment.latency.slow_s=1.0",
              "environment.latency.slow_fraction=0.1"]


SCHEDULING = {
    "fifo": [],
    "longest_first": ["async.schedule=longest_first"],
    "overprovision": ["async.overprovision=4"],
    "longest_first+overprovision": ["async.schedule=longest_first", "async.overprovision=4"],
}
SCHEDULING_WORKLOAD = ["environment.latency.per_task=true", "data.train_size=48", "async.max_inflight_groups=4"]


def bench_recipe(eta: int, steps: int, mode: str = "wait", heldout: int = 0, extra: list[str] = ()):
    from factory.recipe import load_recipe

    return load_recipe(REPO / "recipes" / "default.yaml", HEAVY_TAIL + list(extra) + [
        f"async.max_staleness={eta}", f"train.steps={steps}", "train.checkpoint_every=0",
        f"rollout.partial_rollout={mode}", "eval.before=false", f"eval.after={str(heldout > 0).lower()}",
        f"eval.heldout={max(heldout, 1)}", "name=bench-async",
    ])


MEDIAN_OF = ("samples_trained", "train_seconds", "samples_per_s", "trainer_idle_fraction", "first_batch_wait_seconds",
             "trainer_idle_fraction_after_first_batch", "weight_sync_seconds")


def summarize(rows: list[dict]) -> list[dict]:
    """One row per configuration, in first-run order: medians over its repeats, the mean held-out
    accuracy (its stderr: that of a mean of independent estimates), and the speed-up in samples/s
    over the first configuration (η = 0)."""
    by_config: dict[tuple, list[dict]] = {}
    for r in rows:
        by_config.setdefault((r["max_staleness"], r["partial_rollout"], r["scheduling"]), []).append(r)
    out = []
    for (eta, mode, sched), runs in by_config.items():
        row = {"max_staleness": eta, "partial_rollout": mode, "scheduling": sched, "repeats": len(runs)}
        row.update({k: statistics.median(r[k] for r in runs) for k in MEDIAN_OF})
        accs = [r for r in runs if r["heldout_accuracy"] is not None]
        row["heldout_accuracy"] = statistics.fmean(r["heldout_accuracy"] for r in accs) if accs else None
        row["heldout_stderr"] = (sum(r["heldout_stderr"] ** 2 for r in accs) ** 0.5 / len(accs)) if accs else None
        row["speedup_vs_first"] = row["samples_per_s"] / (out[0]["samples_per_s"] if out else row["samples_per_s"])
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 1, 4])
    ap.add_argument("--modes", nargs="+", default=["wait", "abort_resume", "inflight"],
                    help="partial-rollout modes to run at each η > 0 (η = 0 runs wait only)")
    ap.add_argument("--heldout", type=int, default=500, help="held-out tasks scored after each run (0: none)")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the grid; rows report medians")
    ap.add_argument("--scheduling", action="store_true", help="compare long-tail scheduling at η = 0 instead")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "async_speedup.json"))
    args = ap.parse_args()
    if args.scheduling and args.out.endswith("async_speedup.json"):
        args.out = str(REPO / "bench" / "results" / "scheduling.json")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import ray

    from factory.training.base_policy import ensure_base_policy
    from factory.run import run
    from factory.runtime.actors import EngineActor
    from factory.runtime.cluster import local_ray

    base = bench_recipe(args.etas[0], args.steps)
    policy = ensure_base_policy(base)  # every row starts from the default recipe's warm start
    rows = []
    with local_ray(), tempfile.TemporaryDirectory() as tmp:
        engine = EngineActor.remote("vllm", str(policy), base.rollout, str(Path(tmp) / "vllm.log"))
        ray.get(engine.start.remote())
        stamp = time.strftime("bench-%Y%m%d-%H%M%S")
        run(bench_recipe(0, 2, extra=[f"model.path={policy}"]), Path(tmp) / f"{stamp}-warm-up", engines=[engine])
        if args.scheduling:
            grid = [(0, "wait", name) for name in SCHEDULING]
        else:
            grid = [(eta, mode, "fifo") for eta in args.etas for mode in (["wait"] if eta == 0 else args.modes)]
        for rep, (eta, mode, sched) in ((r, g) for r in range(args.repeats) for g in grid):
            # the small task set would otherwise warm-start a policy of its own
            extra = SCHEDULING_WORKLOAD + SCHEDULING[sched] + [f"model.path={policy}"] if args.scheduling else []
            recipe = bench_recipe(eta, args.steps, mode, args.heldout, extra)
            t0 = time.perf_counter()
            # a run's id is its directory's name: unique per invocation, or the lake and MLflow would
            # take a row for a restart of the same row of an earlier benchmark
            res = run(recipe, Path(tmp) / f"{stamp}-eta{eta}-{mode}-{sched}-r{rep}", engines=[engine])
            after = res.get("after") or {}
            rows.append({
                "max_staleness": eta, "partial_rollout": mode, "scheduling": sched, "steps": args.steps, "repeat": rep,
                "samples_trained": res["samples_trained"],
                "heldout_accuracy": after.get("mean"), "heldout_stderr": after.get("stderr"),
                "train_seconds": res["train_seconds"], "wall_seconds": time.perf_counter() - t0,
                "samples_per_s": res["samples_trained"] / res["train_seconds"],
                "trainer_idle_fraction": res["trainer_idle_fraction"],
                "first_batch_wait_seconds": res["first_batch_wait_seconds"],
                "trainer_idle_fraction_after_first_batch": res["trainer_idle_fraction_after_first_batch"],
                "weight_sync_seconds": res["weight_sync_seconds"],
            })
            print(f"η={eta} {mode} {sched}: {res['samples_trained']} samples in {res['train_seconds']:.1f}s "
                  f"(idle {res['trainer_idle_fraction']:.0%})", flush=True)
        ray.get(engine.stop.remote())

    summary = summarize(rows)
    label = "scheduling" if args.scheduling else "mode"
    print(f"\n{'η':>3} {label:>27} {'samples':>8} {'train s':>8} {'samples/s':>10} {'speedup':>8} "
          f"{'trainer idle':>13} {'fill s':>7} {'idle after':>11} {'held-out':>14}   (median of {args.repeats})")
    for r in summary:
        acc = "" if r["heldout_accuracy"] is None else f"{r['heldout_accuracy']:.3f} ± {r['heldout_stderr']:.3f}"
        name = r["scheduling"] if args.scheduling else r["partial_rollout"]
        print(f"{r['max_staleness']:>3} {name:>27} {r['samples_trained']:>8.0f} {r['train_seconds']:>8.1f} "
              f"{r['samples_per_s']:>10.1f} {r['speedup_vs_first']:>7.2f}x {r['trainer_idle_fraction']:>12.1%} "
              f"{r['first_batch_wait_seconds']:>7.1f} {r['trainer_idle_fraction_after_first_batch']:>10.1%} {acc:>14}")
    workload = HEAVY_TAIL + (SCHEDULING_WORKLOAD if args.scheduling else [])
    write_results(args.out, {"workload": {"latency": workload, "recipe": "recipes/default.yaml"},
                             "repeats": args.repeats, "summary": summary, "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
