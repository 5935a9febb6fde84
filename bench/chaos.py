"""Chaos: runs that meet faults at random moments, and what they lost.

K runs of S steps, each run owning its vLLM engine. In each run F faults are injected at random
moments: after a random step, after a random delay (so a fault lands during generation, training or
a weight sync), one of

- `engine_kill`:  SIGKILL of the engine's vLLM server (a crash: CUDA OOM, a segfault);
- `engine_stop`:  SIGSTOP of the server (a hang: the process lives and never answers);
- `worker_kill`:  SIGKILL of an env worker's process;
- `trainer_kill`: SIGKILL of the trainer's process;

and with `--profile production` (the runs on the production stack of infra/stack.py: the lake's
catalog on Postgres and its files on S3, MLflow's server, the stack's Ray head) also SIGKILL of a
service of the stack, which its supervisor restarts:

- `postgres_kill`: the postmaster (the lake's catalog, MLflow's and Dagster's storage);
- `s3_kill`:       the S3 server (the lake's files, MLflow's artifacts);
- `mlflow_kill`:   the MLflow tracking server;
- `daemon_kill`:   the Dagster daemon. A `factory run` started directly does not talk to it: the
                   fault checks that the supervisor brings it back (a new heartbeat in Postgres)
                   and that the run trains on unaffected.

Reported per run and in total, from the run's results and its lake rows:

- finished: the run returned its results (not an exception);
- lost groups: group ids the buffer handed out (`<recipe>-g0000000` on, gap-free) that have no row in
  the lake; duplicated samples: sample ids with more than one row;
- steps redone: step records beyond one per step in metrics.jsonl (a trainer restart redoes the steps
  after its checkpoint);
- seconds to recover: from the fault to the next completed step (p50 and p99); for a service, to
  the later of the run's next completed step and the service answering again (a run trains on
  through an outage, so a step may come first).

Production runs also report the steps missing from the lake's `steps` table and from MLflow's
history of `rollout/reward_mean` (the writes an outage queued or spilled must all land).

    python bench/chaos.py [--runs 4] [--steps 8] [--faults 2] [--seed 0]
    python bench/chaos.py --profile production [--stack-dir DIR]   # DIR: reuse a running stack

The production mode brings a stack up on free ports in a temporary directory and down at the end,
unless `--stack-dir` names a running one. Results in bench/results/chaos.json (embedded) or
bench/results/chaos_production.json (production).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from datetime import datetime, UTC
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402

COMPUTE_KINDS = ("engine_kill", "worker_kill", "engine_stop", "trainer_kill")
SERVICES = {"postgres_kill": "postgres", "s3_kill": "s3", "mlflow_kill": "mlflow", "daemon_kill": "dagster_daemon"}
# each run meets F different kinds, every kind once before any repeats; in production a run's two
# faults are one of its compute and one of the stack's services
KINDS = {"embedded": COMPUTE_KINDS,
         "production": tuple(k for pair in zip(COMPUTE_KINDS, SERVICES) for k in pair)}
OVERRIDES = ["model.sft_steps=120", "data.train_size=2000", "data.heldout_size=300", "train.groups_per_step=4",
             "rollout.group_size=4", "train.checkpoint_every=2", "eval.before=false", "eval.after=false",
             "train.threads=1", "rollout.health.interval_s=2", "rollout.health.timeout_s=3",
             "rollout.health.first_wait_s=5"]


def descendants(root: int) -> set[int]:
    """Pids under `root`: the processes a fault may hit (never another job's Ray or vLLM on this machine)."""

    from factory.rollout.server import process_tree

    return {p.pid for p in process_tree(root)} - {root}


def actor_pids(class_name: str, within: set[int]) -> list[int]:
    import psutil

    found = []
    for pid in within:
        try:
            proc = psutil.Process(pid)
            if " ".join(proc.cmdline()).startswith(f"ray::{class_name}") and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(pid)
        except psutil.NoSuchProcess:
            pass
    return sorted(found)


def target(kind: str, root: int) -> tuple[int, int] | None:
    """(pid, signal) for a compute fault of `kind` among `root`'s descendants, or None when its
    process is not there (being restarted)."""
    import psutil

    within = descendants(root)
    if kind in ("engine_kill", "engine_stop"):
        from factory.rollout.server import owned_servers

        for actor in actor_pids("EngineActor", within):
            # its vLLM server: forked by the zygote (not the actor's child) or spawned by the actor
            for server in owned_servers(actor):
                with contextlib.suppress(psutil.NoSuchProcess):
                    if psutil.Process(server).status() != psutil.STATUS_STOPPED:
                        return server, signal.SIGKILL if kind == "engine_kill" else signal.SIGSTOP
        return None
    pids = actor_pids("EnvWorkerActor" if kind == "worker_kill" else "TrainerActor", within)
    return (random.choice(pids), signal.SIGKILL) if pids else None


class ProductionStack:
    """The infra/stack.py stack the runs use: its supervisor's state, and whether a service answers."""

    def __init__(self, directory: Path, env_file: Path):
        from infra.stack import settings

        self.dir, self.env_file = directory, env_file
        self.values = settings(env_file)

    def state(self) -> dict:
        from infra.stack import read_state

        return read_state(self.dir) or {}

    def service(self, name: str) -> dict:
        return self.state().get("services", {}).get(name, {})

    def answers(self, name: str, since: datetime) -> bool:
        """`name` serves requests again: Postgres a query, S3 and MLflow an HTTP request; the daemon
        (no port) has written a heartbeat to Postgres after `since`."""
        import httpx
        import psycopg2

        v = self.values
        try:
            if name == "s3":
                return httpx.get(v["FACTORY_S3_ENDPOINT"], timeout=2).status_code < 500
            if name == "mlflow":
                return httpx.get(f"{v['MLFLOW_TRACKING_URI']}/health", timeout=2).status_code == 200
            with psycopg2.connect(host=v["FACTORY_PG_HOST"], port=v["FACTORY_PG_PORT"], user=v["FACTORY_PG_USER"],
                                  password=v["FACTORY_PG_PASSWORD"], connect_timeout=2,
                                  dbname="postgres" if name == "postgres" else "dagster") as con, con.cursor() as cur:
                if name == "postgres":
                    cur.execute("SELECT 1")
                    return True
                cur.execute("SELECT max(timestamp) FROM daemon_heartbeats")
                (last,) = cur.fetchone()
                return last is not None and last.replace(tzinfo=UTC) > since
        except (httpx.HTTPError, psycopg2.Error):
            return False

    def mlflow_steps(self, run_name: str, metric: str = "rollout/reward_mean") -> list[int]:
        from mlflow import MlflowClient

        from factory.recording.tracking import RUN_TAG

        client = MlflowClient(self.values["MLFLOW_TRACKING_URI"])
        experiment = client.get_experiment_by_name("factory")
        runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_name}'") \
            if experiment else []
        return sorted(m.step for r in runs for m in client.get_metric_history(r.info.run_id, metric))


@contextlib.contextmanager
def production_stack(reuse: Path | None):
    """A running stack (`reuse`: its --dir), or one brought up on free ports for the bench and down after.
    Points this process (and the runs in it) at the stack: FACTORY_PROFILE=production, FACTORY_ENV_FILE."""
    from infra.stack import alive, down, free_port_settings, read_state, up, write_env_file

    root = None
    if reuse is not None:
        state = read_state(reuse)
        if not state or not alive(state["supervisor"]) or not state["ready"]:
            raise SystemExit(f"--stack-dir {reuse}: no ready stack runs from there (`python -m infra.stack status`)")
        directory, env_file = reuse, Path(state["env_file"])
    else:
        # Postgres runs as the `postgres` account, which must enter the data dir's parents
        root = Path(tempfile.mkdtemp(prefix="factory-chaos-stack-"))
        root.chmod(0o755)
        directory, env_file = root / "stack", write_env_file(root / ".env", free_port_settings())
        started = time.monotonic()
        up(env_file, directory)
        print(f"stack up in {time.monotonic() - started:.0f} s ({directory})", flush=True)
    os.environ.update({"FACTORY_PROFILE": "production", "FACTORY_ENV_FILE": str(env_file)})
    for key in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "DAGSTER_HOME"):  # the env file's, not the caller's
        os.environ.pop(key, None)
    try:
        yield ProductionStack(directory, env_file)
    finally:
        if root is not None:
            down(directory)
            shutil.rmtree(root, ignore_errors=True)


def read_lake(query: str, timeout_s: float = 120) -> list[dict]:
    """Rows of `query` over the lake, retried while a service the last fault hit is still coming back."""
    from factory.lake.query import sql

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return sql(query).to_pylist()
        except Exception:  # noqa: BLE001  (an outage at read time; past the deadline it is raised)
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def lake_fates(run_id: str, recipe_name: str) -> dict[str, int]:
    """What the lake holds of run `run_id`: its groups, the group ids the buffer handed out
    (`<recipe>-g0000000` on, gap-free) that have no row (lost), its samples and those with more than
    one row (duplicated)."""
    rows = read_lake(f"SELECT group_id, sample_id FROM samples WHERE run_id = '{run_id}' AND status <> 'evaluation'")
    prefix = f"{recipe_name}-g"
    indices = sorted({int(r["group_id"][len(prefix):]) for r in rows if r["group_id"].startswith(prefix)})
    ids = [r["sample_id"] for r in rows]
    return {"groups": len(indices), "lost_groups": (indices[-1] + 1 - len(indices)) if indices else 0,
            "samples": len(ids), "duplicated_samples": len(ids) - len(set(ids))}


def one_run(recipe, run_dir: Path, faults: list[tuple[int, float, str]], root: int,
            stack: ProductionStack | None) -> dict:
    """Run `recipe` with `faults` = [(after step, delay s, kind)]; `root`: the pid whose descendants
    the compute faults may hit. Returns what happened."""
    from infra.stack import alive
    from factory.run import run

    pending = sorted(faults)
    injected: list[dict] = []
    lock = threading.Lock()
    done = threading.Event()

    def service_back(fault: dict, name: str, before: dict, since: datetime) -> None:
        """Record when the supervisor has `name` back (restarted, ready) and it answers again."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            now = stack.service(name)
            if (now.get("restarts", 0) > before["restarts"] and now.get("ready") and alive(now.get("pid"))
                    and stack.answers(name, since)):
                with lock:
                    fault["service_back_s"] = time.monotonic() - fault["t"]
                    fault["restarts"] = now["restarts"] - before["restarts"]
                return
            time.sleep(0.2)

    def fire(kind: str, step: int) -> None:
        deadline = time.monotonic() + 120  # its process may be restarting after the fault before: wait for it
        hit, before = None, {}
        while time.monotonic() < deadline and not done.is_set():
            if kind in SERVICES:
                before = stack.service(SERVICES[kind])
                hit = (before["pid"], signal.SIGKILL) if before.get("ready") and alive(before.get("pid")) else None
            else:
                hit = target(kind, root)
            if hit is not None:
                break
            time.sleep(2)
        with lock:
            if hit is None:
                injected.append({"kind": kind, "after_step": step, "skipped": "no such process within 120 s"})
                return
            since = datetime.now(UTC)
            os.kill(*hit)
            fault = {"kind": kind, "after_step": step, "t": time.monotonic(), "step_s": None,
                     **({"service_back_s": None} if kind in SERVICES else {})}
            injected.append(fault)
        if kind in SERVICES:
            service_back(fault, SERVICES[kind], before, since)

    def on_step(report) -> None:
        now = time.monotonic()
        with lock:
            for f in injected:
                if "t" in f and f["step_s"] is None:
                    f["step_s"] = now - f["t"]
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
    if stack is not None:  # a service fault's recovery may still be under way: let it be measured
        end = time.monotonic() + 300
        while any(f.get("service_back_s", 0) is None for f in injected) and time.monotonic() < end:
            time.sleep(1)
    for f in injected:  # recovered: the next step, and for a service also the service answering again
        parts = [f.get("step_s"), *([f["service_back_s"]] if "service_back_s" in f else [])]
        f["recovered_s"] = max(parts) if "t" in f and None not in parts else None
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (run_dir / "metrics.jsonl").exists() else []
    steps = [m["step"] for m in metrics]
    out = {"finished": error is None, "error": error, "seconds": time.monotonic() - t0, "faults": injected,
           **lake_fates(run_dir.name, recipe.name), "steps_redone": len(steps) - len(set(steps)),
           "restarts": {**results.get("restarts", {}), "trainer": results.get("trainer_restarts", 0)}}
    if stack is not None:
        want = set(range(1, recipe.train.steps + 1))
        lake_steps = [r["step"] for r in read_lake(f"SELECT step FROM steps WHERE run_id = '{run_dir.name}'")]
        mlflow_steps = stack.mlflow_steps(run_dir.name)
        out.update({"lake_steps_missing": sorted(want - set(lake_steps)),
                    "lake_steps_duplicated": len(lake_steps) - len(set(lake_steps)),
                    "mlflow_steps_missing": sorted(want - set(mlflow_steps)),
                    "outage_s": {k: max((m.get(k, 0.0) for m in metrics), default=0.0)
                                 for k in ("lake/outage_s", "tracking/outage_s")}})
    return out


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def summary(runs: list[dict]) -> dict:
    faults = [f for r in runs for f in r["faults"]]
    recovered = [f["recovered_s"] for f in faults if f.get("recovered_s") is not None]
    total = {
        "runs": len(runs), "finished": sum(r["finished"] for r in runs),
        "faults_injected": sum(1 for f in faults if "t" in f),
        "faults_skipped": sum(1 for f in faults if "skipped" in f),
        "lost_groups": sum(r["lost_groups"] for r in runs),
        "duplicated_samples": sum(r["duplicated_samples"] for r in runs),
        "steps_redone": sum(r["steps_redone"] for r in runs),
        "recover_s_p50": statistics.median(recovered) if recovered else None,
        "recover_s_p99": percentile(recovered, 0.99),
    }
    if any("mlflow_steps_missing" in r for r in runs):
        total["lake_steps_missing"] = sum(len(r["lake_steps_missing"]) for r in runs)
        total["mlflow_steps_missing"] = sum(len(r["mlflow_steps_missing"]) for r in runs)
    by_kind: dict[str, dict] = {}
    for f in faults:
        k = by_kind.setdefault(f["kind"], {"injected": 0, "recovered_s": [], "service_back_s": []})
        k["injected"] += "t" in f
        if f.get("recovered_s") is not None:
            k["recovered_s"].append(round(f["recovered_s"], 1))
        if f.get("service_back_s") is not None:
            k["service_back_s"].append(round(f["service_back_s"], 1))
    total["by_kind"] = by_kind
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--faults", type=int, default=2, help="faults per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", choices=["embedded", "production"], default="embedded")
    parser.add_argument("--stack-dir", type=Path, default=None,
                        help="production: a running stack's --dir to reuse (default: bring one up and down)")
    parser.add_argument("--out", default=None, help="default: bench/results/chaos.json (embedded), "
                                                    "chaos_production.json (production)")
    args = parser.parse_args()
    args.out = args.out or str(REPO / "bench" / "results" /
                               ("chaos.json" if args.profile == "embedded" else "chaos_production.json"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from factory.recipe import load_recipe
    from factory.runtime.cluster import local_ray

    rng = random.Random(args.seed)
    random.seed(args.seed)
    kinds_of = KINDS[args.profile]
    runs = []
    with (production_stack(args.stack_dir) if args.profile == "production" else contextlib.nullcontext()) as stack, \
            local_ray(), tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        # compute faults hit only this bench's actors: the stack's (its supervisor's descendants) or
        # the local Ray this process started
        root = stack.state()["supervisor"] if stack is not None else os.getpid()
        for k in range(args.runs):
            # every kind once before any repeats, then at random; after a random step, within 3 s
            kinds = [kinds_of[(k * args.faults + i) % len(kinds_of)] for i in range(args.faults)]
            faults = sorted((rng.randint(1, args.steps - 1), rng.uniform(0.0, 3.0), kind) for kind in kinds)
            recipe = load_recipe(REPO / "recipes" / "default.yaml", OVERRIDES + [f"train.steps={args.steps}"])
            run_dir = Path(tmp) / f"chaos-{int(time.time())}-{k}"
            print(f"run {k + 1}/{args.runs}: faults {faults}", flush=True)
            out = one_run(recipe, run_dir, faults, root, stack)
            print(json.dumps({k2: v for k2, v in out.items() if k2 != "faults"}), flush=True)
            print(json.dumps(out["faults"]), flush=True)
            runs.append(out)
    total = summary(runs)
    print("\n| runs finished | faults injected | lost groups | duplicated samples | steps redone | "
          "recover p50 s | recover p99 s |\n|---|---|---|---|---|---|---|")
    p50, p99 = total["recover_s_p50"], total["recover_s_p99"]
    print(f"| {total['finished']}/{total['runs']} | {total['faults_injected']} | {total['lost_groups']} | "
          f"{total['duplicated_samples']} | {total['steps_redone']} | {p50 and round(p50, 1)} | {p99 and round(p99, 1)} |")
    print(json.dumps(total["by_kind"]))
    before = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
    write_results(args.out, {"args": {**vars(args), "stack_dir": args.stack_dir and str(args.stack_dir)},
                             "total": total, "runs": runs,
                             # bench/partitions.py's runs on the two-node cluster, kept beside these
                             **({"partitions": before["partitions"]} if "partitions" in before else {})})


if __name__ == "__main__":
    main()
