"""Throughput that holds: generated and trained samples/s early and late in a default run.

Runs the default recipe (400 steps, lake and MLflow on as the recipe has them, held-out
evaluation off) and reads its metrics.jsonl: samples generated (every finished sample,
filtered ones included: `buffer/finished_samples`) and trained (`perf/trained_samples`) per
second over the first and the last window of steps (1–100 and 301–400), their ratios
`generated_last_over_first` and `trained_last_over_first` (goal: generated ≥ 0.9), and
`buffer/filtered` at the end. Trained samples/s may fall while generation holds: as accuracy
rises the zero-variance filter drops more groups, so less of what is generated is trained.

To tell a real slowdown from that, each window also reports where the driver's step time went
(waiting for a batch, weight sync, the rest: trainer step and recording), the recorder's own
time per step (timed here around its methods), lake commits, engine batch sizes, the mean
generate/episode seconds of trained samples, resident memory of the run's processes and the
machine's load. Writes bench/results/throughput.json.

    python bench/throughput.py [--steps 400] [--window 100] [--run-dir DIR] [override ...]
"""

from __future__ import annotations

import argparse
import json
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

GOAL = 0.9  # generated samples/s in the last window ≥ 90% of the first
RECORDER_METHODS = ("log_batch", "log_discarded", "log_step", "flush")


def bench_recipe(steps: int, overrides: list[str]):
    from factory.recipe import load_recipe

    return load_recipe(REPO / "recipes" / "default.yaml", [
        f"train.steps={steps}", "eval.before=false", "eval.after=false", "name=bench-throughput", *overrides])


def time_recorder(spent: dict[str, float]) -> None:
    """Accumulate the seconds the run's RunRecorder spends in each of RECORDER_METHODS into `spent`."""
    from factory.recording.recorder import RunRecorder

    for name in RECORDER_METHODS:
        original = getattr(RunRecorder, name)

        def timed(self, *args, _original=original, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t0

        setattr(RunRecorder, name, timed)


def role_of(cmd: str) -> str:
    """vllm (the API server and its EngineCore / Worker processes), a Ray actor's class, or ray_other."""
    if "vllm" in cmd.lower():
        return "vllm"
    if "ray::" in cmd:
        return cmd.split("ray::", 1)[1].split()[0].split(".")[0]
    return "ray_other"


def processes(role=role_of) -> dict[int, tuple[str, float, float]]:
    """{pid: (role, resident MiB, CPU seconds so far)} of this process ("driver") and its descendants,
    each named by `role(command line)`."""
    import psutil

    from factory.rollout.server import process_tree

    me = psutil.Process()
    out: dict[int, tuple[str, float, float]] = {}
    for p in process_tree(me.pid):  # vLLM servers included: forked by the zygote, they are not our children
        try:
            with p.oneshot():
                rss = p.memory_info().rss / 2**20
                cpu = p.cpu_times()
                cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out[p.pid] = ("driver" if p.pid == me.pid else role(cmd), rss, cpu.user + cpu.system)
    return out


def by_role(procs: dict[int, tuple[str, float, float]]) -> dict[str, float]:
    """Resident MiB per role."""
    out: dict[str, float] = {}
    for role, rss, _ in procs.values():
        out[role] = out.get(role, 0.0) + rss
    return out


def cpu_between(a: dict[int, tuple[str, float, float]], b: dict[int, tuple[str, float, float]]) -> dict[str, float]:
    """CPU seconds per role spent between two `processes()` snapshots (a process new in `b` counts from 0)."""
    out: dict[str, float] = {}
    for pid, (role, _, cpu) in b.items():
        out[role] = out.get(role, 0.0) + cpu - (a[pid][2] if pid in a else 0.0)
    return out


def window_report(steps: list[dict], probes: dict[int, dict], samples: dict[int, list[dict]], first: int,
                  last: int) -> dict:
    """Rates and where the time went over steps first…last (1-based, inclusive)."""
    from factory.support.throughput import window_rates

    end = steps[last - 1]
    before = steps[first - 2] if first > 1 else {}
    rates = window_rates(steps, first, last, "perf/elapsed_s", {
        "generated_samples_per_s": "buffer/finished_samples", "trained_samples_per_s": "perf/trained_samples"})
    n = last - first + 1
    seconds = end["perf/elapsed_s"] - before.get("perf/elapsed_s", 0.0)

    def delta(key: str) -> float:
        return end.get(key, 0.0) - before.get(key, 0.0)

    def waited(m: dict) -> float:
        return m.get("perf/trainer_idle_fraction", 0.0) * m.get("perf/elapsed_s", 0.0)

    generated = delta("buffer/finished_samples")
    trained = delta("perf/trained_samples")
    commits = delta("lake/commits")
    commit_s = end.get("lake/commit_s_mean", 0.0) * end.get("lake/commits", 0.0) - (
        before.get("lake/commit_s_mean", 0.0) * before.get("lake/commits", 0.0))
    wait = waited(end) - waited(before)
    sync = sum(m.get("weightsync/blocked_s", 0.0) for m in steps[first - 1:last])  # the driver's wait
    rec_first, rec_last = probes.get(first - 1, {}), probes[last]
    recorder = {k: (rec_last["recorder"].get(k, 0.0) - rec_first.get("recorder", {}).get(k, 0.0)) / n
                for k in RECORDER_METHODS}
    trained_samples = [s for step in range(first, last + 1) for s in samples.get(step, [])]
    timings = [s.get("timings") or {} for s in trained_samples]
    batches = delta("rollout/engine_http_batches")
    return {
        "steps": [first, last], "seconds": seconds, **rates,
        "generated_samples": generated, "trained_samples": trained,
        "trained_share_of_generated": trained / generated if generated else None,
        "filtered_groups": delta("buffer/filtered"),
        "reward_mean": statistics.fmean(m["rollout/reward_mean"] for m in steps[first - 1:last]),
        "step_s": seconds / n, "wait_s_per_step": wait / n, "weight_sync_s_per_step": sync / n,
        "rest_s_per_step": (seconds - wait - sync) / n,  # trainer step, recording, metrics calls
        "recorder_s_per_step": recorder,
        "lake_commits": commits, "lake_commit_s_mean": commit_s / commits if commits else None,
        "lake_rows": delta("lake/rows"),
        "engine_requests_per_http_batch": delta("rollout/engine_requests") / batches if batches else None,
        "engine_tokens_per_request": (delta("rollout/engine_tokens") / delta("rollout/engine_requests")
                                      if delta("rollout/engine_requests") else None),
        "trained_sample_generate_s_mean": statistics.fmean(t.get("generate_s", 0.0) for t in timings) if timings else None,
        "trained_sample_episode_s_mean": statistics.fmean(t.get("episode_s", 0.0) for t in timings) if timings else None,
        "rss_mib_at_end": by_role(rec_last["procs"]),
        # CPU seconds per generated sample, per role: how much work a sample costs, which the machine's
        # load (other jobs taking the cores) changes far less than the wall-clock rates above
        "cpu_ms_per_generated_sample": _cpu_per_sample(steps, probes, first, last),
        "load_1min_mean": statistics.fmean(probes[s]["load_1min"] for s in range(first, last + 1) if s in probes),
    }


def _cpu_per_sample(steps: list[dict], probes: dict[int, dict], first: int, last: int) -> dict[str, float]:
    """ms of CPU per generated sample per role over steps first…last; the first window starts after
    step 1 (before it the processes were starting up)."""
    start = first - 1 if first > 1 else 1
    cpu = cpu_between(probes[start]["procs"], probes[last]["procs"])
    samples = steps[last - 1]["buffer/finished_samples"] - steps[start - 1]["buffer/finished_samples"]
    return {role: 1000 * s / samples for role, s in sorted(cpu.items())} if samples else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--window", type=int, default=100, help="steps per reported window (first and last)")
    ap.add_argument("--run-dir", help="where the run writes (default: a temporary directory, removed after)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "throughput.json"))
    ap.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    args = ap.parse_args()
    if args.steps < 2 * args.window:
        ap.error(f"--steps must be at least twice --window ({args.window})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from factory.training.base_policy import ensure_base_policy
    from factory.run import run

    recipe = bench_recipe(args.steps, args.overrides)
    ensure_base_policy(recipe)  # built (or found cached) before the clock starts
    spent: dict[str, float] = {}
    time_recorder(spent)
    probes: dict[int, dict] = {0: {"recorder": {}, "procs": processes(), "load_1min": os.getloadavg()[0]}}

    def on_step(report) -> None:
        probe = {"recorder": dict(spent), "load_1min": os.getloadavg()[0]}
        if report.step % 10 == 0 or report.step in (1, args.window, args.steps - args.window, args.steps):
            probe["procs"] = processes()
        probes[report.step] = probe
        if report.step % 50 == 0:
            m = report.metrics
            print(f"step {report.step}: generated {m['perf/generated_samples_per_s']:.1f}/s, trained "
                  f"{m['perf/trained_samples_per_s']:.1f}/s (window), filtered {m['buffer/filtered']:.0f} groups, "
                  f"reward {m['rollout/reward_mean']:.2f}", flush=True)

    stamp = time.strftime("bench-throughput-%Y%m%d-%H%M%S")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.run_dir) if args.run_dir else Path(tmp) / stamp  # its name is the run's id
        t0 = time.perf_counter()
        results = run(recipe, run_dir, on_step=on_step)
        wall = time.perf_counter() - t0
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        samples: dict[int, list[dict]] = {}
        for line in (run_dir / "samples.jsonl").read_text().splitlines():
            if line.strip():
                s = json.loads(line)
                samples.setdefault(s["trained_step"], []).append({"timings": s.get("timings")})

    steps = [m for m in steps if "perf/elapsed_s" in m]  # one line per step, in order
    n, w = len(steps), args.window
    first = window_report(steps, probes, samples, 1, w)
    last = window_report(steps, probes, samples, n - w + 1, n)
    ratio = {k: last[k] / first[k] for k in ("generated_samples_per_s", "trained_samples_per_s")}
    summary = {
        "generated_last_over_first": ratio["generated_samples_per_s"],
        "trained_last_over_first": ratio["trained_samples_per_s"],
        "goal_generated_last_over_first": GOAL,
        "meets_goal": ratio["generated_samples_per_s"] >= GOAL,
        "filtered_groups_at_end": steps[-1]["buffer/filtered"],
        "generated_samples_at_end": steps[-1]["buffer/finished_samples"],
        "trained_samples_at_end": steps[-1]["perf/trained_samples"],
        "train_seconds": results["train_seconds"], "wall_seconds": wall,
    }
    print(f"\n{'steps':>9} {'generated/s':>12} {'trained/s':>10} {'trained share':>14} {'step s':>7} {'wait s':>7} "
          f"{'sync s':>7} {'rest s':>7} {'record s':>9} {'commit ms':>10} {'req/batch':>10} {'load':>5}")
    for r in (first, last):
        commit = f"{1000 * r['lake_commit_s_mean']:.0f}" if r["lake_commit_s_mean"] else "-"
        per_batch = f"{r['engine_requests_per_http_batch']:.1f}" if r["engine_requests_per_http_batch"] else "-"
        print(f"{r['steps'][0]:>4}-{r['steps'][1]:<4} {r['generated_samples_per_s']:>12.1f} "
              f"{r['trained_samples_per_s']:>10.1f} {r['trained_share_of_generated']:>14.0%} {r['step_s']:>7.3f} "
              f"{r['wait_s_per_step']:>7.3f} {r['weight_sync_s_per_step']:>7.3f} {r['rest_s_per_step']:>7.3f} "
              f"{sum(r['recorder_s_per_step'].values()):>9.3f} {commit:>10} {per_batch:>10} {r['load_1min_mean']:>5.1f}")
    roles = sorted(set(first["cpu_ms_per_generated_sample"]) | set(last["cpu_ms_per_generated_sample"]))
    print("CPU ms per generated sample, first → last window: " + ", ".join(
        f"{role} {first['cpu_ms_per_generated_sample'].get(role, 0):.1f} → {last['cpu_ms_per_generated_sample'].get(role, 0):.1f}"
        for role in roles))
    print(f"generated last/first {summary['generated_last_over_first']:.2f} (goal ≥ {GOAL}), trained last/first "
          f"{summary['trained_last_over_first']:.2f}; {summary['filtered_groups_at_end']:.0f} groups filtered by "
          f"step {n}")
    write_results(args.out, {"workload": {"recipe": "recipes/default.yaml", "steps": args.steps, "window": w,
                                          "overrides": ["eval.before=false", "eval.after=false", *args.overrides]},
                             **summary, "first": first, "last": last,
                             "memory_mib": {s: by_role(p["procs"]) for s, p in probes.items()
                                            if "procs" in p and s % 50 == 0},
                             "per_step": {k: [m.get(k) for m in steps] for k in (
                                 "perf/generated_samples_per_s", "perf/trained_samples_per_s", "buffer/filtered")}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
