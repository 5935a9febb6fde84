"""Partitions: runs on the two-node cluster that lose their network, or a node, mid-run.

The two-node cluster of infra/cluster/netns.sh (root: network namespaces): node 1 holds the driver,
trainer and buffer, node 2 the vLLM engine and the env worker (recipes/two_node.yaml). K runs of S
steps, each hit once, after a random step, by one of (in turn)

- `partition_15`, `partition_45`: the link between the nodes down for 15 s or 45 s, then up;
- `node_back`: every process of node 2 killed at once, a new node 2 started 15 s later.

Reported per run and in total: finished (exit 0), lost groups and duplicated samples (from the lake,
as bench/chaos.py counts them), restarts, and two times: `stall_s`, from the fault to the next
completed step, and `recover_s`, from the link coming back (or the new node joining) to the next
completed step: what the fault cost beyond its own length.

    python bench/partitions.py [--runs 3] [--steps 10] [--seed 0]

Results: the "partitions" entry of bench/results/chaos.json (the rest of the file is bench/chaos.py's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from chaos import lake_fates  # noqa: E402

KINDS = ("partition_45", "node_back", "partition_15")
OVERRIDES = ["model.sft_steps=120", "data.train_size=2000", "data.heldout_size=300", "train.groups_per_step=4",
             "rollout.group_size=4", "train.checkpoint_every=0", "eval.before=false", "eval.after=false",
             "train.threads=1", "tracking.enabled=false", "lake.enabled=true", "rollout.kv_cache_gb=1",
             "algorithm.filter_zero_variance=false"]  # every group trained: the time measured is the fault's alone


def policy_dir() -> Path:
    """The default recipe's base policy at the bench's warm start (built once into the state dir)."""
    from factory.training.base_policy import ensure_base_policy
    from factory.recipe import load_recipe

    return ensure_base_policy(load_recipe(REPO / "recipes" / "default.yaml", OVERRIDES))


def one_run(nodes, name: str, steps: int, kind: str, after: int) -> dict:
    cmd = [sys.executable, "-m", "factory.cli", "run", str(REPO / "recipes" / "two_node.yaml"), *OVERRIDES,
           f"train.steps={steps}", f"model.path={nodes.home / 'models' / 'policy'}",
           "--run-dir", str(nodes.home / "runs" / name)]
    run = nodes.start_run(cmd, nodes.home / "runs" / name, nodes.home / f"{name}.log")
    run.wait_for_step(after)
    t0 = time.monotonic()
    if kind.startswith("partition_"):
        nodes.partition(float(kind.split("_")[1]))
    else:
        nodes.kill_node2()
        time.sleep(15)
        nodes.start_node2()
    back = time.monotonic()
    next_step = None
    while run.proc.poll() is None and next_step is None:
        if run.steps() > after:
            next_step = time.monotonic()
        time.sleep(0.2)
    if next_step is None and run.steps() > after:
        next_step = time.monotonic()
    code = run.finish()
    out = {"kind": kind, "after_step": after, "finished": code == 0, "error": None if code == 0 else run.tail(400),
           "stall_s": None if next_step is None else round(next_step - t0, 1),
           # the next step may land before the link is back (its groups were done): then 0
           "recover_s": None if next_step is None else round(max(0.0, next_step - back), 1)}
    if code == 0:
        out["restarts"] = run.results()["restarts"]
    os.environ["FACTORY_HOME"] = str(nodes.home)  # the run's lake: node 1's state dir
    out.update(lake_fates(name, "two_node"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "chaos.json"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from infra.cluster.control import TwoNodes

    rng = random.Random(args.seed)
    policy = policy_dir()
    runs = []
    with tempfile.TemporaryDirectory(prefix="partitions-") as tmp:
        home = Path(tmp) / "home"
        shutil.copytree(policy, home / "models" / "policy")
        nodes = TwoNodes(home)
        print(nodes.up().strip(), flush=True)
        try:
            for k in range(args.runs):
                kind = KINDS[k % len(KINDS)]
                if kind == "node_back" and len(nodes.pids("node2")) == 0:
                    nodes.start_node2()
                after = rng.randint(2, max(2, args.steps - 4))
                print(f"run {k + 1}/{args.runs}: {kind} after step {after}", flush=True)
                out = one_run(nodes, f"partitions-{k}", args.steps, kind, after)
                print(json.dumps(out), flush=True)
                runs.append(out)
        finally:
            nodes.down()
    recovered = [r["recover_s"] for r in runs if r["recover_s"] is not None]
    total = {"runs": len(runs), "finished": sum(r["finished"] for r in runs),
             "lost_groups": sum(r["lost_groups"] for r in runs),
             "duplicated_samples": sum(r["duplicated_samples"] for r in runs),
             "recover_s_median": statistics.median(recovered) if recovered else None,
             "recover_s_max": max(recovered) if recovered else None}
    print("\n| kind | finished | stall s | recover s | lost groups | duplicated samples |\n|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['kind']} | {r['finished']} | {r['stall_s']} | {r['recover_s']} | {r['lost_groups']} | "
              f"{r['duplicated_samples']} |")
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {}
    data["partitions"] = {"args": vars(args), "total": total, "runs": runs,
                          "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                          "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    print(f"\nwrote {out} (partitions)")


if __name__ == "__main__":
    main()
