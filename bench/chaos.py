"""Chaos: runs that meet faults at random moments, and what they lost.

K runs of S steps on the embedded profile, each run owning its vLLM engine. In each run F faults are
injected at random moments: after a random step, after a random delay (so a fault lands during
generation, training or a weight sync), one of

- `engine_kill`:  SIGKILL of the engine's vLLM server (a crash: CUDA OOM, a segfault);
- `engine_stop`:  SIGSTOP of the server (a hang: the process lives and never answers);
- `worker_kill`:  SIGKILL of an env worker's process;
- `trainer_kill`: SIGKILL of the trainer's process.

Reported per run and in total, from the run's results and its lake rows:

- finished: the run returned its results (not an exception);
- lost groups: group ids the buffer handed out (`<recipe>-g0000000` on, gap-free) that have no row in
  the lake; duplicated samples: sample ids with more than one row;
- steps redone: step records beyond one per step in metrics.jsonl (a trainer restart redoes the steps
  after its checkpoint);
- seconds to recover: from the fault to the next completed step (p50 and p99).

The production services' faults (Postgres, the S3 server, the MLflow server, the Dagster daemon) need
the production stack and are not injected here; tests/infra kills Postgres and S3 mid-run.

    python bench/chaos.py [--runs 4] [--steps 8] [--faults 2] [--seed 0]

Results in bench/results/chaos.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402

KINDS = ("engine_kill", "worker_kill", "engine_stop", "trainer_kill")  # each run meets two different kinds
OVERRIDES = ["model.sft_steps=120", "data.train_size=2000", "data.heldout_size=300", "train.groups_per_step=4",
             "rollout.group_size=4", "train.checkpoint_every=2", "eval.before=false", "eval.after=false",
             "train.threads=1", "rollout.health.interval_s=2", "rollout.health.timeout_s=3",
             "rollout.health.first_wait_s=5"]


def actor_pids(class_name: str) -> list[int]:
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline", "status"])
            if " ".join(p.info["cmdline"] or []).startswith(f"ray::{class_name}")
            and p.info["status"] != psutil.STATUS_ZOMBIE]


def target(kind: str) -> tuple[int, int] | None:
    """(pid, signal) for a fault of `kind`, or None when its process is not there (being restarted)."""
    import psutil

    if kind in ("engine_kill", "engine_stop"):
        for actor in actor_pids("EngineActor"):
            for child in psutil.Process(actor).children():
                if "vllm" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_STOPPED:
                    return child.pid, signal.SIGKILL if kind == "engine_kill" else signal.SIGSTOP
        return None
    pids = actor_pids("EnvWorkerActor" if kind == "worker_kill" else "TrainerActor")
    return (random.choice(pids), signal.SIGKILL) if pids else None


def one_run(recipe, run_dir: Path, faults: list[tuple[int, float, str]]) -> dict:
    """Run `recipe` with `faults` = [(after step, delay s, kind)]; returns what happened."""
    from factory.lake.query import sql
    from factory.run import run

    pending = sorted(faults)
    injected: list[dict] = []
    lock = threading.Lock()
    done = threading.Event()

    def fire(kind: str, step: int) -> None:
        deadline = time.monotonic() + 120  # its process may be restarting after the fault before: wait for it
        while (hit := target(kind)) is None and time.monotonic() < deadline and not done.is_set():
            time.sleep(2)
        with lock:
            if hit is None:
                injected.append({"kind": kind, "after_step": step, "skipped": "no such process within 120 s"})
                return
            os.kill(*hit)
            injected.append({"kind": kind, "after_step": step, "t": time.monotonic(), "recovered_s": None})

    def on_step(report) -> None:
        now = time.monotonic()
        with lock:
            for f in injected:
                if "t" in f and f["recovered_s"] is None:
                    f["recovered_s"] = now - f["t"]
        while pending and pending[0][0] <= report.step:
            step, delay, kind = pending.pop(0)
            threading.Timer(delay, fire, (kind, step)).start()

    t0 = time.monotonic()
    error = None
    results: dict = {}
    try:
        results = run(recipe, run_dir, on_step=on_step)
    except Exception as err:  # noqa: BLE001  (a run that did not finish is the measurement)
        error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        traceback.print_exc()
    done.set()
    rows = sql(f"SELECT group_id, sample_id FROM samples WHERE run_id = '{run_dir.name}' "
               "AND status <> 'evaluation'").to_pylist()
    prefix = f"{recipe.name}-g"
    indices = sorted({int(r["group_id"][len(prefix):]) for r in rows if r["group_id"].startswith(prefix)})
    lost = (indices[-1] + 1 - len(indices)) if indices else 0
    ids = [r["sample_id"] for r in rows]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    return {"finished": error is None, "error": error, "seconds": time.monotonic() - t0, "faults": injected,
            "groups": len(indices), "lost_groups": lost, "samples": len(ids),
            "duplicated_samples": len(ids) - len(set(ids)), "steps_redone": len(steps) - len(set(steps)),
            "restarts": {**results.get("restarts", {}), "trainer": results.get("trainer_restarts", 0)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--faults", type=int, default=2, help="faults per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "chaos.json"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from factory.recipe import load_recipe
    from factory.runtime.cluster import local_ray

    rng = random.Random(args.seed)
    random.seed(args.seed)
    runs = []
    with local_ray(), tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        for k in range(args.runs):
            # every kind once before any repeats, then at random; after a random step, within 3 s
            kinds = [KINDS[(k * args.faults + i) % len(KINDS)] for i in range(args.faults)]
            faults = sorted((rng.randint(1, args.steps - 1), rng.uniform(0.0, 3.0), kind) for kind in kinds)
            recipe = load_recipe(REPO / "recipes" / "default.yaml", OVERRIDES + [f"train.steps={args.steps}"])
            run_dir = Path(tmp) / f"chaos-{int(time.time())}-{k}"
            print(f"run {k + 1}/{args.runs}: faults {faults}", flush=True)
            out = one_run(recipe, run_dir, faults)
            print(json.dumps({k2: v for k2, v in out.items() if k2 != "faults"}), flush=True)
            runs.append(out)
    recovered = sorted(f["recovered_s"] for r in runs for f in r["faults"] if f.get("recovered_s") is not None)
    total = {
        "runs": len(runs), "finished": sum(r["finished"] for r in runs),
        "faults_injected": sum(1 for r in runs for f in r["faults"] if "t" in f),
        "faults_skipped": sum(1 for r in runs for f in r["faults"] if "skipped" in f),
        "lost_groups": sum(r["lost_groups"] for r in runs),
        "duplicated_samples": sum(r["duplicated_samples"] for r in runs),
        "steps_redone": sum(r["steps_redone"] for r in runs),
        "recover_s_p50": statistics.median(recovered) if recovered else None,
        "recover_s_p99": recovered[min(len(recovered) - 1, int(0.99 * len(recovered)))] if recovered else None,
    }
    print("\n| runs finished | faults injected | lost groups | duplicated samples | steps redone | "
          "recover p50 s | recover p99 s |\n|---|---|---|---|---|---|---|")
    p50, p99 = total["recover_s_p50"], total["recover_s_p99"]
    print(f"| {total['finished']}/{total['runs']} | {total['faults_injected']} | {total['lost_groups']} | "
          f"{total['duplicated_samples']} | {total['steps_redone']} | {p50 and round(p50, 1)} | {p99 and round(p99, 1)} |")
    write_results(args.out, {"args": vars(args), "total": total, "runs": runs})


if __name__ == "__main__":
    main()
