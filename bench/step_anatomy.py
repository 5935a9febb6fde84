"""Where each second of a default step goes, and how far the step is above its floor.

Runs the default recipe (η = 1, lake and MLflow on as the recipe has them, held-out evaluation off)
for `--steps` steps and measures, over the steps after `--skip` (start-up and the pipeline fill):

- **the driver's step**, phase by phase (the run loop's helpers, timed here from outside):
  waiting for the batch; the trainer call — the trainer's own prepare / forward / backward /
  optimizer seconds (`perf/trainer_*_s`) and the Ray round trip around them; weight sync — drain,
  transfer (inside the vLLM worker: receiving the bytes, and vLLM's reload that re-packs them;
  around it the /collective_rpc call and the trainer's broadcast) and reopen; recording; the
  buffer's and engines' metrics; the step's log line (jsonl + MLflow); the rest.
- **CPU seconds per step of every process**: trainer, vLLM API server (HTTP + tokenisation-free
  token I/O), vLLM engine (EngineCore + Worker: the model's compute), env worker (episodes, reward,
  gateway), buffer, engine actor, driver, Ray's own processes.
- **the floor**: generation = the vLLM engine's CPU seconds per step, training = the trainer's (one
  thread each: CPU ≈ compute time; their wall times also hold the waits for a core). Async (η ≥ 1):
  max of the two; sync: their sum. `overhead_share` = (median step − floor) / median step. Goal:
  ≤ 0.15. `plumbing_cpu_s_per_step`: every other process's CPU (env worker, engine actor, vLLM's
  API server, driver, buffer, Ray) — on 2 cores it competes with the model for the same cores.
- **weight sync against the wire**: after the runs, a raw gloo broadcast of the same buckets between
  the trainer and a receiver that does nothing with them (bench/weight_sync.py's `raw_gloo`).
  `end_to_end_over_raw`: a sync's drain + transfer + reopen over that; `transfer_over_raw`: the
  transfer alone; `blocked_over_raw`: what the driver waited.

Two runs side by side: `rollout.overlap_sync` on (the default: the update runs while the driver
records the step and the trainer takes the next) and off (the loop waits for the engines to reopen).

Prints a table, writes bench/results/step_anatomy.json and a plot beside it (step_anatomy.png).

    python bench/step_anatomy.py [--steps 80] [--skip 10] [override ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402
from throughput import cpu_between, processes  # noqa: E402

GOAL = 0.15  # overhead above the floor, as a share of the step
VARIANTS = (("overlap", True), ("blocking", False))  # rollout.overlap_sync: the default first
DRIVER_PHASES = ("_next_batch", "_score_and_train", "publish_weights", "_record_samples", "_observe", "_checkpoint",
                 "log_step")
TRAINER_PARTS = ("prepare", "forward", "backward", "optimizer")


def role(cmd: str) -> str:
    """A process's role from its command line (finer than throughput's: vLLM's API server vs engine)."""
    if "vllm.entrypoints" in cmd:
        return "vllm_api_server"
    if "VLLM::" in cmd or "multiprocessing.spawn" in cmd:
        return "vllm_engine"  # EngineCore (scheduling) and Worker (the model)
    if "ray::" in cmd:
        return cmd.split("ray::", 1)[1].split()[0].split(".")[0]
    return "ray_other"  # raylet, GCS, dashboard, log monitor


def time_driver(spent: dict[str, float]) -> None:
    """Accumulate the seconds the run loop spends in each of DRIVER_PHASES (and in the recorder's
    log_step) into `spent`; the loop looks these names up at call time, so wrapping them here works."""
    import factory.run as run_module
    from factory.recording.recorder import RunRecorder
    from factory.runtime.weights import WeightPublisher

    def wrap(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0

        setattr(owner, name, timed)

    for name in ("_next_batch", "_score_and_train", "_record_samples", "_observe", "_checkpoint"):
        wrap(run_module, name, name)
    wrap(WeightPublisher, "publish", "publish_weights")
    wrap(RunRecorder, "log_step", "log_step")


def raw_gloo_seconds(policy: Path, recipe, repeats: int = 10) -> tuple[float, int]:
    """Median seconds of a raw gloo broadcast of the run's buckets (trainer → a receiver that keeps
    nothing), with the Ray calls that start it, as bench/weight_sync.py measures it; and its bytes."""
    import ray

    from factory.runtime.actors import TrainerActor
    from factory.runtime.cluster import local_ray
    from weight_sync import RawReceiver

    with local_ray():
        trainer = TrainerActor.remote(str(policy), recipe.algorithm, recipe.train, recipe.rollout)
        plan = ray.get(trainer.plan_json.remote())
        receiver = RawReceiver.remote()
        host, port = ray.get(trainer.open_broadcast.remote(2, "gloo"))
        ray.get([trainer.join_broadcast.remote(), receiver.init.remote(host, port, plan)])
        seconds, sent = [], 0
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            sent = ray.get([trainer.broadcast.remote(), receiver.receive.remote()])[0]
            seconds.append(time.perf_counter() - t0)
        ray.kill(receiver)
        ray.kill(trainer)
    return statistics.median(seconds[2:]), sent


def per_step(steps: list[dict], key: str) -> list[float]:
    return [s.get(key, 0.0) for s in steps]


def deltas(steps: list[dict], before: dict, key: str) -> list[float]:
    """Per-step increments of a cumulative metric."""
    out, prev = [], before.get(key, 0.0)
    for s in steps:
        out.append(s.get(key, 0.0) - prev)
        prev = s.get(key, 0.0)
    return out


def anatomy(records: list[dict], before: dict, cpu: dict[str, float], n: int, max_staleness: int) -> dict:
    """The report over the measured steps (`records`: one per step, `before`: the record before them)."""
    med = statistics.median
    step_s = [r["wall_s"] for r in records]
    metrics = [r["metrics"] for r in records]
    phase = {name: [r["phases"].get(name, 0.0) for r in records] for name in DRIVER_PHASES}
    trainer = {part: per_step(metrics, f"perf/trainer_{part}_s") for part in TRAINER_PARTS}
    trainer_busy = per_step(metrics, "perf/trainer_step_s")
    train_call = [p for p in phase["_score_and_train"]]
    receive = deltas(metrics, before["metrics"], "weightsync/engine_receive_s_total")
    load = deltas(metrics, before["metrics"], "weightsync/engine_load_s_total")
    rpc = deltas(metrics, before["metrics"], "weightsync/engine_rpc_s_total")
    transfer = per_step(metrics, "weightsync/transfer_s")
    busy = deltas(metrics, before["metrics"], "rollout/engine_busy_s")
    generated = deltas(metrics, before["metrics"], "buffer/finished_samples")
    named = sum(sum(v) for v in phase.values())
    rest = [w - sum(phase[k][i] for k in phase) for i, w in enumerate(step_s)]
    driver = {
        "step": med(step_s),
        "wait_for_batch": med(phase["_next_batch"]),
        "trainer_call": med(train_call),
        **{f"trainer_{p}": med(v) for p, v in trainer.items()},
        "trainer_ray_overhead": med([c - b for c, b in zip(train_call, trainer_busy)]),
        "weight_sync": med(phase["publish_weights"]),  # what the driver waits (overlapped: closing admission)
        "sync_end_to_end": med([m.get("weightsync/drain_s", 0.0) + m.get("weightsync/transfer_s", 0.0)
                                + m.get("weightsync/reopen_s", 0.0) for m in metrics]),
        "sync_drain": med(per_step(metrics, "weightsync/drain_s")),
        "sync_transfer": med(transfer),
        "sync_transfer_worker_receive": med(receive),
        "sync_transfer_worker_reload": med(load),
        "sync_transfer_rpc_overhead": med([r - a - b for r, a, b in zip(rpc, receive, load)]),
        "sync_transfer_outside_rpc": med([t - r for t, r in zip(transfer, rpc)]),  # Ray call, engine actor
        "sync_reopen": med(per_step(metrics, "weightsync/reopen_s")),
        "record_samples": med(phase["_record_samples"]),
        "observe_metrics": med(phase["_observe"]),
        "log_step": med(phase["log_step"]),
        "checkpoint": statistics.fmean(phase["_checkpoint"]),  # every checkpoint_every steps: a mean
        "rest": med(rest),
    }
    cpu_per_step = {k: v / n for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])}
    # both sides as CPU seconds (one thread each here): their wall times include waiting for a core
    generation = cpu_per_step.get("vllm_engine", 0.0)
    training = cpu_per_step.get("TrainerActor", 0.0)
    floor = max(generation, training) if max_staleness > 0 else generation + training
    return {
        "steps_measured": n,
        "driver_s_median": driver,
        "driver_named_share": named / sum(step_s),
        "cpu_s_per_step": cpu_per_step,
        "cpu_s_per_step_total": sum(cpu_per_step.values()),
        "generation_s_per_step": generation,
        "engine_busy_s_per_step_client_view": statistics.fmean(busy),
        "training_s_per_step": training,
        "trainer_busy_wall_s_per_step": statistics.fmean(trainer_busy),
        "plumbing_cpu_s_per_step": sum(v for k, v in cpu_per_step.items() if k not in ("vllm_engine", "TrainerActor")),
        "completions_generated_per_step": statistics.fmean(generated),
        "completions_generated_per_s": sum(generated) / sum(step_s),
        "floor_s": floor,
        "floor_kind": "async: max(generation, training)" if max_staleness > 0 else "sync: generation + training",
        "overhead_s": driver["step"] - floor,
        "overhead_share": (driver["step"] - floor) / driver["step"],
    }


def print_report(rep: dict) -> None:
    d = rep["driver_s_median"]
    print(f"\nthe driver's step (median over {rep['steps_measured']} steps), ms:")
    for k, v in d.items():
        indent = "    " if k.startswith(("trainer_", "sync_")) else "  "
        print(f"{indent}{k:<34}{v * 1000:8.1f}")
    print("\nCPU seconds per step, by process (2 cores = 2 s per wall second):")
    for k, v in rep["cpu_s_per_step"].items():
        print(f"  {k:<34}{v * 1000:8.1f} ms")
    print(f"  {'total':<34}{rep['cpu_s_per_step_total'] * 1000:8.1f} ms")
    print(f"\ngeneration {rep['generation_s_per_step'] * 1000:.0f} ms/step (engine CPU), training "
          f"{rep['training_s_per_step'] * 1000:.0f} ms/step (trainer CPU), plumbing "
          f"{rep['plumbing_cpu_s_per_step'] * 1000:.0f} ms/step (everything else's CPU);\n"
          f"floor ({rep['floor_kind']}) {rep['floor_s'] * 1000:.0f} ms; "
          f"step {d['step'] * 1000:.0f} ms; overhead {rep['overhead_s'] * 1000:.0f} ms = {rep['overhead_share']:.0%} "
          f"of the step (goal ≤ {GOAL:.0%})")
    print(f"weight sync end to end {d['sync_end_to_end'] * 1000:.1f} ms, transfer {d['sync_transfer'] * 1000:.1f} ms, "
          f"the driver waited {d['weight_sync'] * 1000:.1f} ms; raw gloo {rep['raw_gloo_s'] * 1000:.1f} ms: "
          f"{rep['end_to_end_over_raw']:.1f}x / {rep['transfer_over_raw']:.1f}x / {rep['blocked_over_raw']:.2f}x")


def plot(rep: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    d = rep["driver_s_median"]
    parts = [("wait for batch", d["wait_for_batch"]), ("trainer: compute", d["trainer_call"] - d["trainer_ray_overhead"]),
             ("trainer: Ray", d["trainer_ray_overhead"]), ("sync: drain", d["sync_drain"]),
             ("sync: transfer", d["sync_transfer"]), ("sync: reopen", d["sync_reopen"]),
             ("record + metrics + log", d["record_samples"] + d["observe_metrics"] + d["log_step"]),
             ("rest", max(d["rest"], 0.0))]
    fig = Figure(figsize=(10, 4.2))
    ax1, ax2 = fig.subplots(2, 1)
    left = 0.0
    for label, v in parts:
        ax1.barh(0, v * 1000, left=left, label=label)
        left += v * 1000
    ax1.axvline(rep["floor_s"] * 1000, color="k", ls="--", lw=1)
    ax1.text(rep["floor_s"] * 1000, 0.45, " floor", va="bottom")
    ax1.set_yticks([])
    ax1.set_title("the driver's step, median (ms)")
    ax1.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    left = 0.0
    for label, v in rep["cpu_s_per_step"].items():
        ax2.barh(0, v * 1000, left=left, label=label)
        left += v * 1000
    ax2.set_yticks([])
    ax2.set_title("CPU per step by process (ms)")
    ax2.legend(ncol=5, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--skip", type=int, default=10, help="first steps left out (start-up, pipeline fill)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "step_anatomy.json"))
    ap.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    args = ap.parse_args()
    if args.steps <= args.skip + 5:
        ap.error("--steps must exceed --skip by more than 5")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from factory.training.base_policy import ensure_base_policy
    from factory.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes" / "default.yaml", [
        f"train.steps={args.steps}", "eval.before=false", "eval.after=false", "name=bench-step-anatomy",
        *args.overrides])
    policy = ensure_base_policy(recipe)
    spent: dict[str, float] = defaultdict(float)
    time_driver(spent)
    reports = {}
    for name, overlap in VARIANTS:
        print(f"\n== {name}: rollout.overlap_sync={str(overlap).lower()}", flush=True)
        reports[name] = measure(recipe.model_copy(update={"rollout": recipe.rollout.model_copy(
            update={"overlap_sync": overlap})}), args, spent)
    raw_s, sync_bytes = raw_gloo_seconds(policy, recipe)
    for name, rep in reports.items():
        d = rep["driver_s_median"]
        rep.update(raw_gloo_s=raw_s, sync_bytes=sync_bytes, end_to_end_over_raw=d["sync_end_to_end"] / raw_s,
                   transfer_over_raw=d["sync_transfer"] / raw_s, blocked_over_raw=d["weight_sync"] / raw_s)
        print(f"\n######## {name}")
        print_report(rep)
    first, second = (reports[n] for n, _ in VARIANTS)
    comparison = {"step_blocking_over_overlap": second["driver_s_median"]["step"] / first["driver_s_median"]["step"],
                  "completions_per_s_overlap_over_blocking": first["completions_generated_per_s"]
                  / second["completions_generated_per_s"]}
    print(f"\n{comparison}")
    out = Path(args.out)
    plot(reports[VARIANTS[0][0]], out.with_suffix(".png"))
    write_results(out, {"variants": reports, "comparison": comparison, "goal_overhead_share": GOAL, "settings": {
        "steps": args.steps, "skip": args.skip, "overrides": args.overrides,
        "max_staleness": recipe.async_.max_staleness, "engine": recipe.rollout.engine,
        "partial_rollout": recipe.rollout.partial_rollout, "trainer_threads": recipe.train.threads,
        "engine_threads": recipe.rollout.cpus, "env_workers": recipe.environment.workers}})
    return 0


def measure(recipe, args, spent: dict[str, float]) -> dict:
    """One run of `recipe`, timed step by step; its anatomy over the steps after --skip."""
    import tempfile

    from factory.run import run

    records: list[dict] = []
    snapshots: dict[int, dict] = {}
    last = [time.perf_counter()]

    def on_step(report) -> None:
        now = time.perf_counter()
        records.append({"step": report.step, "wall_s": now - last[0], "phases": dict(spent),
                        "metrics": dict(report.metrics)})
        spent.clear()
        if report.step in (args.skip, args.steps):
            snapshots[report.step] = processes(role)
        if report.step % 20 == 0:
            print(f"step {report.step}: {1000 * (now - last[0]):.0f} ms", flush=True)
        last[0] = time.perf_counter()  # the report's own cost is not the loop's

    spent.clear()
    with tempfile.TemporaryDirectory() as tmp:
        run(recipe, Path(tmp) / "run", on_step=on_step)
    measured = records[args.skip:]
    return anatomy(measured, records[args.skip - 1], cpu_between(snapshots[args.skip], snapshots[args.steps]),
                   len(measured), recipe.async_.max_staleness)


if __name__ == "__main__":
    sys.exit(main())
