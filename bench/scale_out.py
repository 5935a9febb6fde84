"""Scale-out: the same short RL run on one node and on two, and the weight-sync bandwidth between nodes.

Parts, in one invocation (each node of the two-node cluster is a network namespace on this machine,
joined to the other by a veth pair: infra/cluster/netns.sh; node 2 cannot see node 1's files):

1. `single` / `cluster`: one short GRPO run of the default recipe's tiny policy (copied under the run's
   FACTORY_HOME, so on the cluster node 2 gets it only over the network), (a) on one node with a local
   Ray (`factory run recipes/default.yaml`), (b) on the cluster (`netns.sh run factory run
   recipes/two_node.yaml`: trainer and buffer on node 1, vLLM engine and env worker on node 2).
   Per run: samples/s (samples_trained / train_seconds), mean weight-sync seconds per step and its
   transfer phase, bytes per sync per engine, trainer idle fraction (and completions generated per
   second: the buffer drops zero-variance groups, so it generates more than it trains on).
2. `bandwidth`: inside the cluster, a Ray actor on node 1 (rank 0, the trainer's own rendezvous:
   `WeightBroadcaster(host=<node 1>, world_size=2)`) and one on node 2 (rank 1, `WeightReceiver` joining
   from its own address). Per tensor set — the tiny policy's named shapes and a Llama-shaped set of
   random bf16 tensors of `--params` parameters — (i) a raw gloo broadcast of one flat tensor of the same
   total bytes on that group, (ii) `WeightBroadcaster.broadcast` of the bucketed plan (`--bucket-mb`),
   each timed over `--repeats` (median; each repeat starts after a one-element broadcast that lines the
   ranks up, and counts the slower rank). GB/s = 1e9 bytes/s; goal: bucketed/raw >= 0.80.
   Diagnostics beside them (what the gap is made of): `raw_fresh` (raw, received into a newly allocated
   tensor each time, as WeightReceiver does per bucket), `pack_s` (pack_bucket alone, no network), and
   `pipelined` (not factory code: the sender packs bucket i+1 into a reused buffer while bucket i is on
   the wire, the receiver receives into buffers allocated once). Variants run interleaved, round by round.
   The end-to-end sync into vLLM of run 1(b) is set against the raw time for the same bytes.

Order: 1(a), then the cluster comes up, 2 (on a quiet cluster), 1(b). The cluster is torn down in any
case (`netns.sh down`) and `ip netns list` and the veth are checked afterwards (`teardown_clean`).
Writes bench/results/scale_out.json (with the load averages: the machine is shared).

    python bench/scale_out.py [--steps 10] [--params 100e6] [--repeats 11] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402

NETNS = REPO / "infra" / "cluster" / "netns.sh"
PYTHON = sys.executable
NAME = f"sb{os.getpid() % 100000}"  # namespace prefix; veth names "<NAME>-h" stay under 15 characters
SUBNET = f"10.251.{os.getpid() % 250}"  # apart from the integration test's 10.250.x
# the policy the integration tests build (cached under .state/models): the default recipe's model at test size
POLICY_OVERRIDES = ["model.sft_steps=120", "data.train_size=2000", "data.heldout_size=300"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


OTHERS: set[str] = set()  # busy processes not of this benchmark, seen while it ran


def ns_pids() -> set[int]:
    """Every process of this benchmark's cluster (both namespaces), while it is up."""
    pids: set[int] = set()
    for ns in (f"{NAME}-head", f"{NAME}-node2"):
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        pids |= {int(x) for x in out.stdout.split()}
    return pids


def busy_others(min_cpu: float = 20.0) -> list[str]:
    """Other processes using >= min_cpu % of a core over one second (not this benchmark, its children or
    its cluster's processes); their command lines are also kept in OTHERS for the results."""
    import psutil

    from factory.rollout.server import process_tree

    mine = {p.pid for p in process_tree(os.getpid())} | ns_pids()
    procs = [p for p in psutil.process_iter(["name", "cmdline"]) if p.pid not in mine]
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(1.0)
    busy = []
    for p in procs:
        try:
            if p.cpu_percent(None) >= min_cpu:
                cmd = " ".join(p.info["cmdline"] or [p.info["name"] or "?"])
                busy.append(cmd[:80])
        except psutil.Error:
            pass
    OTHERS.update(busy)
    return busy


# ---------------------------------------------------------------- part 1: the same run on one and two nodes

def run_overrides(policy: Path, steps: int, groups: int, group_size: int) -> list[str]:
    return [*POLICY_OVERRIDES, f"model.path={policy}", f"train.steps={steps}", f"train.groups_per_step={groups}",
            f"rollout.group_size={group_size}", "train.checkpoint_every=0", "train.threads=1",
            "eval.before=false", "eval.after=false", "tracking.enabled=false", "lake.enabled=false"]


def follow(cmd: list[str], env: dict, log_path: Path, metrics: Path | None, label: str, timeout: float) -> int:
    """Run `cmd` with its output in `log_path`; print its phase lines and each step as it lands."""
    seen = 0
    shown = 0
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.time() + timeout
        sampled = time.time()
        try:
            while True:
                rc = proc.poll()
                lines = log_path.read_text(errors="replace").splitlines()
                for line in lines[shown:]:
                    if line.lstrip().startswith(("»", "error", "cluster up", "[bw]")) or "Error" in line:
                        log(f"  {label}: {line.strip()[:160]}")
                shown = len(lines)
                if metrics is not None and metrics.is_file():
                    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
                    for m in rows[seen:]:
                        log(f"  {label}: step {m['step']:>3}  sync {m.get('weightsync/seconds', 0.0) * 1000:6.1f} ms  "
                            f"{m['perf/samples_per_s']:5.1f} samples/s  idle {m['perf/trainer_idle_fraction']:.2f}")
                    seen = len(rows)
                if rc is not None:
                    return rc
                if time.time() - sampled > 30:  # who else is using the cores
                    busy_others()
                    sampled = time.time()
                if time.time() > deadline:
                    proc.kill()
                    proc.wait()
                    log(f"  {label}: timed out after {timeout:.0f} s")
                    return 124
                time.sleep(1.0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise


def summarize_run(run_dir: Path, label: str, wall: float, load_before: list[float]) -> dict:
    results = json.loads((run_dir / "results.json").read_text())
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]

    def mean(key: str) -> float:  # over the steps that report it (an overlapped sync reports a step later)
        return statistics.mean(s[key] for s in steps if key in s)

    def median(key: str) -> float:
        return statistics.median(s[key] for s in steps if key in s)

    done = [s["perf/samples_per_s"] * s["perf/elapsed_s"] for s in steps]  # samples trained by the end of each step
    return {
        "setup": label, "nodes": results["nodes"], "steps": len(steps),
        # without the pipeline fill (engine warm-up, the first groups): from step 1's end to the last's
        "samples_per_s_after_step_1": (done[-1] - done[0]) / (steps[-1]["perf/elapsed_s"] - steps[0]["perf/elapsed_s"])
        if len(steps) > 1 else None,
        "samples_trained": results["samples_trained"], "train_seconds": results["train_seconds"],
        "samples_per_s": results["samples_trained"] / results["train_seconds"],
        "sync_s_mean": mean("weightsync/seconds"), "sync_s_median": median("weightsync/seconds"),
        "transfer_s_mean": mean("weightsync/transfer_s"), "transfer_s_median": median("weightsync/transfer_s"),
        "drain_s_mean": mean("weightsync/drain_s"), "reopen_s_mean": mean("weightsync/reopen_s"),
        "bytes_per_sync": steps[-1].get("weightsync/bytes"),
        "weight_sync_seconds_total": results["weight_sync_seconds"],
        "trainer_idle_fraction": results["trainer_idle_fraction"],
        "trainer_idle_fraction_after_first_batch": results["trainer_idle_fraction_after_first_batch"],
        "first_batch_wait_seconds": results["first_batch_wait_seconds"],
        "engine_requests": results["engine_requests"],
        # completions the engine served per second of training: samples_trained leaves out the groups the
        # buffer dropped (zero-variance groups; filter_zero_variance) and what was still in flight at the end
        "completions_generated_per_s": sum(results["engine_requests"]) / results["train_seconds"],
        "groups_filtered": steps[-1].get("buffer/filtered"), "total_seconds": results["total_seconds"],
        "wall_s": wall, "loadavg_before": load_before, "loadavg_after": load(),
    }


def single_node(policy: Path, args, work: Path) -> dict:
    home = work / "single-home"
    shutil.copytree(policy, home / "models" / "policy")
    run_dir = home / "runs" / "single"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(FACTORY_HOME=str(home), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [PYTHON, "-m", "factory.cli", "run", str(REPO / "recipes" / "default.yaml"),
           *run_overrides(home / "models" / "policy", args.steps, args.groups, args.group_size), "--run-dir", str(run_dir)]
    log(f"1(a) one node, local Ray: {' '.join(cmd[1:5])} ... ({args.steps} steps)")
    t0, l0 = time.perf_counter(), load()
    rc = follow(cmd, env, work / "single.log", run_dir / "metrics.jsonl", "1a", args.run_timeout)
    if rc != 0:
        raise RuntimeError(f"single-node run failed (rc {rc}); last lines:\n{tail(work / 'single.log')}")
    return summarize_run(run_dir, "one node (local Ray)", time.perf_counter() - t0, l0)


def cluster_run(policy_home: Path, env: dict, args, work: Path) -> dict:
    run_dir = policy_home / "runs" / "two-node"
    cmd = ["bash", str(NETNS), "run", PYTHON, "-m", "factory.cli", "run", str(REPO / "recipes" / "two_node.yaml"),
           *run_overrides(policy_home / "models" / "policy", args.steps, args.groups, args.group_size),
           "--run-dir", str(run_dir)]
    log(f"1(b) two nodes: netns.sh run factory run recipes/two_node.yaml ... ({args.steps} steps)")
    t0, l0 = time.perf_counter(), load()
    rc = follow(cmd, env, work / "cluster.log", run_dir / "metrics.jsonl", "1b", args.run_timeout)
    if rc != 0:
        raise RuntimeError(f"two-node run failed (rc {rc}); last lines:\n{tail(work / 'cluster.log')}")
    return summarize_run(run_dir, "two nodes (netns veth)", time.perf_counter() - t0, l0)


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.is_file() else "(no log)"


# ---------------------------------------------------------------- part 2: bandwidth between the nodes

def tiny_shapes(policy: Path) -> list[tuple[str, list[int]]]:
    """The policy's named shapes, as the trainer sends them (its safetensors header; no weights read)."""
    from safetensors import safe_open

    with safe_open(str(policy / "model.safetensors"), framework="pt") as f:
        return [(k, list(f.get_slice(k).get_shape())) for k in f.keys()]


def llama_shapes(params: float, vocab: int = 32000, layers: int = 12) -> list[tuple[str, list[int]]]:
    """A Llama-shaped parameter set of about `params` parameters: `layers` blocks, the hidden size solved
    from 2·V·h + L·12·h² ≈ params (intermediate ≈ 8h/3), both rounded to multiples of 64."""
    a, b = 12 * layers, 2 * vocab
    h = max(64, round((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a) / 64) * 64)
    i = max(64, round(8 * h / 3 / 64) * 64)
    shapes = [("model.embed_tokens.weight", [vocab, h])]
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes += [(p + "input_layernorm.weight", [h]),
                   *[(p + f"self_attn.{x}_proj.weight", [h, h]) for x in "qkvo"],
                   (p + "post_attention_layernorm.weight", [h]),
                   (p + "mlp.gate_proj.weight", [i, h]), (p + "mlp.up_proj.weight", [i, h]),
                   (p + "mlp.down_proj.weight", [h, i])]
    return shapes + [("model.norm.weight", [h]), ("lm_head.weight", [vocab, h])]


def bandwidth_driver(args) -> int:
    """Runs on node 1 under `netns.sh run` (RAY_ADDRESS set); writes its rows to --bw-out.

    The variants of one tensor set are timed in rounds, each round running every variant once (in a
    rotating order), so that the load of a shared machine drifts over all of them alike."""
    import ray
    import torch

    from factory.model.weightsync import BucketPlan, pack_bucket, unpack_bucket

    @ray.remote(num_cpus=0)
    class Peer:
        """Rank 0 (sender, on the trainer node) or rank 1 (receiver, on the rollout node)."""

        def __init__(self):
            self.ip = ray.util.get_node_ip_address()
            self.plan, self.tensors, self.flat, self.bufs, self.numels = None, {}, None, [], []

        def node_ip(self) -> str:
            return self.ip

        def open(self) -> tuple[str, int]:
            from factory.model.weightsync import WeightBroadcaster

            self.sender = WeightBroadcaster(host=self.ip, world_size=2)
            return self.sender.host, self.sender.port

        def connect(self) -> None:
            self.sender.connect()
            self.group, self.rank = self.sender.group, 0

        def join(self, host: str, port: int) -> None:
            from factory.model.weightsync import WeightReceiver

            empty = BucketPlan("bfloat16", []).to_json()
            self.receiver = WeightReceiver(host, port, 1, 2, empty, local_host=self.ip)
            self.group, self.rank = self.receiver.group, 1

        def set_plan(self, plan_json: str) -> float:
            """Rank 0 makes random bf16 tensors of the plan's shapes; both make the raw path's flat tensor of
            the plan's total bytes (rank 1 also takes the plan for receiving). An empty plan frees them."""
            self.plan = BucketPlan.from_json(plan_json)
            self.tensors, self.flat, self.bufs = {}, None, []
            self.numels = [self.plan.bucket_numel(i) for i in range(len(self.plan.buckets))]
            t0 = time.perf_counter()
            if self.numels:
                self.flat = torch.empty(sum(self.numels), dtype=torch.bfloat16)
                self.flat.fill_(1.0)  # touched: the raw path receives into warm pages
            if self.rank == 0 and self.numels:
                g = torch.Generator().manual_seed(0)
                self.tensors = {n: torch.randn(s, generator=g, dtype=torch.bfloat16) for b in self.plan.buckets
                                for n, s in b}
                self.bufs = [torch.empty(max(self.numels), dtype=torch.bfloat16) for _ in range(2)]
            elif self.rank == 1:
                self.receiver.plan = self.plan
                self.bufs = [torch.zeros(n, dtype=torch.bfloat16) for n in self.numels]  # warm, one per bucket
            return time.perf_counter() - t0

        def _line_up(self) -> None:
            self.group.broadcast(torch.zeros(1), 0).wait()

        def once(self, kind: str) -> tuple[float, list[float]]:
            """One timed broadcast of the current set from rank 0 to rank 1; returns (seconds, sums of the
            first and last tensor as this rank holds them: equal on both ranks when the data is intact).

            raw        one flat tensor of the same bytes, the same (warm) tensor every time: the floor
            raw_fresh  the same, rank 1 receiving into a newly allocated tensor (as WeightReceiver does)
            bucketed   factory.model.weightsync: WeightBroadcaster.broadcast / WeightReceiver.receive
            pipelined  diagnostic, not factory code: rank 0 packs into two reused buffers, bucket i+1 while
                       bucket i is on the wire (one broadcast in flight at a time); rank 1 receives into
                       buffers allocated (and touched) once, one per bucket"""
            got: list = []
            flat = self.flat
            if kind == "raw_fresh" and self.rank == 1:
                flat = torch.empty(sum(self.numels), dtype=torch.bfloat16)
            self._line_up()
            t0 = time.perf_counter()
            if kind in ("raw", "raw_fresh"):
                self.group.broadcast(flat, 0).wait()
            elif self.rank == 1 and kind == "bucketed":
                got = self.receiver.receive()
            elif self.rank == 1:
                for i, buf in enumerate(self.bufs):
                    self.group.broadcast(buf, 0).wait()
                    got.extend(unpack_bucket(self.plan, i, buf))
            elif kind == "bucketed":
                self.sender.broadcast(self.plan, self.tensors)
            else:
                def pack(i: int) -> torch.Tensor:
                    out = self.bufs[i % 2][: self.numels[i]]
                    return torch.cat([self.tensors[n].reshape(-1) for n, _ in self.plan.buckets[i]], out=out)

                work = self.group.broadcast(pack(0), 0)
                for i in range(1, len(self.numels)):
                    nxt = pack(i)
                    work.wait()
                    work = self.group.broadcast(nxt, 0)
                work.wait()
            seconds = time.perf_counter() - t0
            if kind.startswith("raw"):
                return seconds, [float(flat[:1000].float().sum()), float(flat[-1000:].float().sum())]
            named = got if self.rank == 1 else list(self.tensors.items())
            return seconds, [float(named[0][1].float().sum()), float(named[-1][1].float().sum())]

        def pack_only(self, repeats: int) -> float:
            """Rank 0: median seconds `pack_bucket` takes for the whole plan, no network (what the bucketed
            path does in series with the sends)."""
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                for i in range(len(self.plan.buckets)):
                    pack_bucket(self.plan, i, self.tensors).contiguous()
                times.append(time.perf_counter() - t0)
            return statistics.median(times[1:])

    ray.init(logging_level="ERROR", log_to_driver=True)
    print(f"[bw] connected to the cluster; nodes {sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])}",
          flush=True)
    sender = Peer.options(resources={"trainer": 1}).remote()
    receiver = Peer.options(resources={"rollout": 1}).remote()
    ips = ray.get([sender.node_ip.remote(), receiver.node_ip.remote()])
    print(f"[bw] rank 0 on {ips[0]}, rank 1 on {ips[1]}", flush=True)
    host, port = ray.get(sender.open.remote())
    ray.get([sender.connect.remote(), receiver.join.remote(host, port)])
    print(f"[bw] weight group formed: rendezvous {host}:{port} (the trainer's WeightBroadcaster)", flush=True)

    kinds = ["raw", "bucketed", "raw_fresh", "pipelined"]
    sets = [("tiny policy", tiny_shapes(Path(args.policy))),
            (f"llama ~{args.params / 1e6:.0f}M", llama_shapes(args.params))]
    rows = []
    for name, shapes in sets:
        plan = BucketPlan.for_state(shapes, "bfloat16", int(args.bucket_mb * (1 << 20)))
        total = plan.total_bytes
        made = ray.get([sender.set_plan.remote(plan.to_json()), receiver.set_plan.remote(plan.to_json())])[0]
        print(f"[bw] {name}: {total // 2 / 1e6:.1f}M params, {total / 1e6:.1f} MB, {len(plan.buckets)} buckets "
              f"(tensors made in {made:.1f} s); {args.repeats} rounds of {', '.join(kinds)}", flush=True)
        times: dict[str, list[float]] = {k: [] for k in kinds}
        intact: dict[str, bool] = {k: True for k in kinds}
        for r in range(args.repeats + 1):  # round 0: warm-up, not counted
            order = kinds[r % len(kinds):] + kinds[: r % len(kinds)]
            for kind in order:
                (s_sec, s_sum), (r_sec, r_sum) = ray.get([sender.once.remote(kind), receiver.once.remote(kind)])
                intact[kind] &= all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-3) for a, b in zip(s_sum, r_sum))
                if r:
                    times[kind].append(max(s_sec, r_sec))  # the slower rank: the transfer is done on both
        pack_s = ray.get(sender.pack_only.remote(args.repeats))
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"set": name, "params": total // 2, "bytes": total, "buckets": len(plan.buckets),
               "bucket_mb": args.bucket_mb, "repeats": args.repeats}
        for k in kinds:
            row.update({f"{k}_s": times[k], f"{k}_s_median": med[k], f"{k}_gb_per_s": total / med[k] / 1e9,
                        f"{k}_data_intact": intact[k]})
        row.update(bucketed_over_raw=med["raw"] / med["bucketed"], meets_0_80=med["raw"] / med["bucketed"] >= 0.80,
                   pipelined_over_raw=med["raw"] / med["pipelined"], pack_s_median=pack_s)
        rows.append(row)
        print(f"[bw] {name}: raw {row['raw_gb_per_s']:.2f} GB/s ({med['raw'] * 1000:.1f} ms), bucketed "
              f"{row['bucketed_gb_per_s']:.2f} GB/s ({med['bucketed'] * 1000:.1f} ms): ratio "
              f"{row['bucketed_over_raw']:.2f}; raw into a fresh buffer {med['raw_fresh'] * 1000:.1f} ms, packing "
              f"alone {pack_s * 1000:.1f} ms, pipelined sender {med['pipelined'] * 1000:.1f} ms; data intact: "
              f"{all(intact.values())}", flush=True)
        empty = BucketPlan("bfloat16", []).to_json()
        ray.get([sender.set_plan.remote(empty), receiver.set_plan.remote(empty)])  # free the tensors
    Path(args.bw_out).write_text(json.dumps({"nodes": ips, "rendezvous": f"{host}:{port}", "rows": rows}))
    ray.shutdown()
    return 0


# ---------------------------------------------------------------- the cluster's life

def netns_clean(name: str) -> dict:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {"namespaces_left": [line.split()[0] for line in ns.splitlines() if line.startswith(f"{name}-")],
            "veth_left": f"{name}-" in links}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="RL steps per run")
    ap.add_argument("--groups", type=int, default=4, help="train.groups_per_step")
    ap.add_argument("--group-size", type=int, default=4, help="rollout.group_size")
    ap.add_argument("--params", type=float, default=100e6, help="parameters of the Llama-shaped set (bf16: 2 bytes each)")
    ap.add_argument("--bucket-mb", type=float, default=16)
    ap.add_argument("--repeats", type=int, default=11, help="timed broadcasts per row (median), after one warm-up")
    ap.add_argument("--parts", nargs="+", default=["single", "cluster", "bandwidth"],
                    choices=["single", "cluster", "bandwidth"])
    ap.add_argument("--policy", help="a HF policy dir (default: the test-size policy of the default recipe, cached)")
    ap.add_argument("--run-timeout", type=float, default=900)
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 steps, 10M parameters, 3 repeats")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "scale_out.json"))
    ap.add_argument("--bandwidth-driver", action="store_true", help=argparse.SUPPRESS)  # inside the cluster
    ap.add_argument("--bw-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.params, args.repeats = min(args.steps, 3), min(args.params, 10e6), min(args.repeats, 3)
    if args.bandwidth_driver:
        return bandwidth_driver(args)
    if os.geteuid() != 0:
        print("scale_out: needs root (network namespaces, mounts)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    if args.policy:
        policy = Path(args.policy)
    else:
        from factory.training.base_policy import ensure_base_policy
        from factory.recipe import load_recipe

        policy = ensure_base_policy(load_recipe(REPO / "recipes" / "default.yaml", POLICY_OVERRIDES))
    args.policy = str(policy)
    log(f"policy {policy}; load average {load()} on {os.cpu_count()} cores; busy besides: {busy_others() or 'none'}")

    work = Path(tempfile.mkdtemp(prefix="sbw", dir="/tmp"))
    started = time.time()
    out: dict = {"settings": {k: v for k, v in vars(args).items() if k not in ("bandwidth_driver", "bw_out")},
                 "loadavg_start": load(), "runs": [], "bandwidth": None}
    ok = True
    try:
        if "single" in args.parts:
            out["runs"].append(single_node(policy, args, work))
        if "cluster" in args.parts or "bandwidth" in args.parts:
            cluster_dir = tempfile.mkdtemp(prefix="sb", dir="/tmp")  # short: Ray's socket paths fit 107 bytes
            home = Path(tempfile.mkdtemp(prefix="sbh", dir="/tmp"))  # node 2 sees an empty tmpfs here
            shutil.copytree(policy, home / "models" / "policy")
            env = dict(os.environ, FACTORY_HOME=str(home), CLUSTER_NAME=NAME, CLUSTER_SUBNET=SUBNET,
                       CLUSTER_DIR=cluster_dir, PYTHON=PYTHON)
            env.pop("RAY_ADDRESS", None)
            out["cluster"] = {"name": NAME, "subnet": SUBNET}
            try:
                log(f"cluster up: {NAME}, {SUBNET}.1 (trainer) <-veth-> {SUBNET}.2 (rollout)")
                t0 = time.perf_counter()
                up = subprocess.run(["bash", str(NETNS), "up"], env=env, capture_output=True, text=True, timeout=240)
                if up.returncode != 0:
                    raise RuntimeError(f"netns.sh up failed:\n{up.stdout[-2000:]}{up.stderr[-4000:]}")
                out["cluster"]["up_s"] = time.perf_counter() - t0
                log(f"  {up.stdout.strip().splitlines()[0]} ({out['cluster']['up_s']:.1f} s)")
                if "bandwidth" in args.parts:
                    log(f"2. bandwidth over the veth: tiny policy + Llama-shaped {args.params / 1e6:.0f}M bf16, "
                        f"{args.bucket_mb:g} MB buckets, {args.repeats} repeats")
                    bw_out = work / "bandwidth.json"
                    cmd = ["bash", str(NETNS), "run", PYTHON, str(Path(__file__).resolve()), "--bandwidth-driver",
                           "--policy", str(policy), "--params", str(args.params), "--bucket-mb", str(args.bucket_mb),
                           "--repeats", str(args.repeats), "--bw-out", str(bw_out)]
                    l0 = load()
                    rc = follow(cmd, env, work / "bandwidth.log", None, "2", args.run_timeout)
                    if rc != 0:
                        raise RuntimeError(f"bandwidth driver failed (rc {rc}):\n{tail(work / 'bandwidth.log')}")
                    out["bandwidth"] = json.loads(bw_out.read_text())
                    out["bandwidth"].update(loadavg_before=l0, loadavg_after=load())
                if "cluster" in args.parts:
                    out["runs"].append(cluster_run(home, env, args, work))
            finally:
                log("cluster down")
                down = subprocess.run(["bash", str(NETNS), "down"], env=env, capture_output=True, text=True, timeout=180)
                clean = netns_clean(NAME)
                out["cluster"].update(down_rc=down.returncode, **clean,
                                      teardown_clean=down.returncode == 0 and not clean["namespaces_left"]
                                      and not clean["veth_left"])
                log(f"  ip netns list: {'clean' if out['cluster']['teardown_clean'] else clean} "
                    f"({down.stdout.strip() or down.stderr.strip()[-300:]})")
                shutil.rmtree(cluster_dir, ignore_errors=True)
                shutil.rmtree(home, ignore_errors=True)
    except Exception as err:  # noqa: BLE001 — record what did not work, print it, still write the file
        ok = False
        out["error"] = str(err)
        print(f"\nscale_out: {err}", file=sys.stderr)
    finally:
        keep_logs = not ok
        if keep_logs:
            print(f"logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    # the end-to-end sync into vLLM (run 1b) against the raw collective for the same bytes
    two = next((r for r in out["runs"] if r["setup"].startswith("two")), None)
    tiny = next((r for r in (out["bandwidth"] or {}).get("rows", []) if r["set"] == "tiny policy"), None)
    if two and tiny:
        out["e2e_vs_raw"] = {"bytes": two["bytes_per_sync"], "raw_s": tiny["raw_s_median"],
                             "transfer_s_mean": two["transfer_s_mean"], "sync_s_mean": two["sync_s_mean"],
                             "transfer_over_raw": two["transfer_s_mean"] / tiny["raw_s_median"],
                             "sync_over_raw": two["sync_s_mean"] / tiny["raw_s_median"],
                             "same_bytes": two["bytes_per_sync"] == tiny["bytes"]}
    if len(out["runs"]) == 2:
        out["two_over_one_samples_per_s"] = out["runs"][1]["samples_per_s"] / out["runs"][0]["samples_per_s"]
    out["loadavg_end"] = load()
    marks = [out["loadavg_start"], out["loadavg_end"], *[r[k] for r in out["runs"] for k in ("loadavg_before", "loadavg_after")]]
    if out["bandwidth"]:
        marks += [out["bandwidth"]["loadavg_before"], out["bandwidth"]["loadavg_after"]]
    peak = max(m[0] for m in marks)  # the 1-minute averages
    busy_others()
    out["other_busy_processes"] = sorted(OTHERS)
    others = out["other_busy_processes"]
    out["load_note"] = (f"shared machine: 1-min load average up to {peak:.1f} on {os.cpu_count()} cores during the "
                        "benchmark (its own runs count in it: Ray, vLLM, trainer; busy processes of others seen at the "
                        f"checkpoints: {', '.join(others) or 'none'}); timings are noisy"
                        if peak > (os.cpu_count() or 1) else f"load average at most {peak:.1f} on {os.cpu_count()} cores")
    out["wall_s"] = time.time() - started

    print(f"\n{'run':>24} {'samples/s':>9} {'after step 1':>12} {'sync ms':>8} {'transfer ms':>11} {'bytes/sync':>11} "
          f"{'idle':>6} {'1st batch s':>11}")
    for r in out["runs"]:
        print(f"{r['setup']:>24} {r['samples_per_s']:>9.2f} {r['samples_per_s_after_step_1'] or 0:>12.2f} "
              f"{r['sync_s_mean'] * 1000:>8.1f} {r['transfer_s_mean'] * 1000:>11.1f} {r['bytes_per_sync']:>11.0f} "
              f"{r['trainer_idle_fraction']:>6.2f} {r['first_batch_wait_seconds']:>11.1f}")
    if out["bandwidth"]:
        print(f"\n{'tensor set':>16} {'MB':>7} {'buckets':>7} {'raw GB/s':>9} {'bucketed GB/s':>13} {'ratio':>6}"
              f" {'raw fresh GB/s':>14} {'pack ms':>8} {'pipelined GB/s':>14}")
        for r in out["bandwidth"]["rows"]:
            print(f"{r['set']:>16} {r['bytes'] / 1e6:>7.1f} {r['buckets']:>7} {r['raw_gb_per_s']:>9.2f} "
                  f"{r['bucketed_gb_per_s']:>13.2f} {r['bucketed_over_raw']:>6.2f} {r['raw_fresh_gb_per_s']:>14.2f} "
                  f"{r['pack_s_median'] * 1000:>8.1f} {r['pipelined_gb_per_s']:>14.2f}"
                  f"{'' if r['meets_0_80'] else '  (ratio < 0.80)'}")
    if "e2e_vs_raw" in out:
        e = out["e2e_vs_raw"]
        print(f"\nsync into vLLM over the veth ({e['bytes'] / 1e6:.1f} MB): {e['sync_s_mean'] * 1000:.1f} ms end to end, "
              f"transfer phase {e['transfer_s_mean'] * 1000:.1f} ms; raw gloo for the same bytes {e['raw_s'] * 1000:.1f} ms "
              f"({e['sync_over_raw']:.0f}x / {e['transfer_over_raw']:.0f}x)")
    print(out["load_note"])
    write_results(args.out, out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
