"""A real two-node Ray run on one machine (infra/cluster/netns.sh): two network namespaces joined by a
veth pair, node 1 (trainer, buffer, driver) and node 2 (rollout engine, env worker), node 2 with a
private empty view of the state directory. The policy, the weights and the checkpoints can only have
crossed over the network. Tear-down must leave no namespace, veth or Ray process behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from .conftest import REPO, TEST_OVERRIDES

pytestmark = pytest.mark.integration

SCRIPT = REPO / "infra" / "cluster" / "netns.sh"
NAME = f"fx{os.getpid() % 100000}"  # namespace and veth names (veth names: at most 15 characters)
SUBNET = f"10.250.{os.getpid() % 250}"
HEAD, NODE2 = f"{SUBNET}.1", f"{SUBNET}.2"


def cluster(env: dict, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)


def netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def train_on_cluster(env: dict, home: Path, name: str, *overrides: str) -> tuple[dict, str]:
    run_dir = home / "runs" / name
    keep = [o for o in TEST_OVERRIDES if not o.startswith(("model.", "train.steps", "eval.heldout"))]
    cmd = [sys.executable, "-m", "factory.cli", "run", str(REPO / "recipes" / "two_node.yaml"), *keep,
           f"model.path={home / 'models' / 'policy'}", "eval.before=false", "eval.heldout=32",
           "tracking.enabled=false", *overrides, "--run-dir", str(run_dir)]
    done = cluster(env, "run", *cmd, timeout=600)
    log = done.stdout[-3000:] + done.stderr[-6000:]
    assert done.returncode == 0, log
    return json.loads((run_dir / "results.json").read_text()), log


def test_a_run_spans_two_nodes_that_share_nothing_but_the_network(policy, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(policy, home / "models" / "policy")  # under the dir node 2 cannot see
    ray_dir = tempfile.mkdtemp(prefix=f"{NAME}-")  # short: Ray's socket paths must fit in 107 bytes
    env = dict(os.environ, FACTORY_HOME=str(home), CLUSTER_NAME=NAME, CLUSTER_SUBNET=SUBNET,
               CLUSTER_DIR=ray_dir, PYTHON=sys.executable)
    up = cluster(env, "up")
    pids: set[int] = set()
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"cluster up: {HEAD}, {NODE2}" in up.stdout

        # weights by gloo broadcast: rendezvous on node 1's address, receiver joins from node 2's
        results, log = train_on_cluster(env, home, "broadcast", "train.steps=3", "train.checkpoint_every=3")
        nodes = results["nodes"]
        assert nodes["driver"] == nodes["trainer"] == nodes["buffer"] == HEAD, nodes
        assert nodes["engines"] == [NODE2] and nodes["env_workers"] == [NODE2], nodes
        assert results["engine_requests"][0] > 0  # samples were generated on node 2 ...
        assert results["samples_trained"] > 0  # ... and trained on node 1
        assert 0.0 <= results["after"]["mean"] <= 1.0
        ckpt = home / "runs" / "broadcast" / "checkpoints" / "step-000003"
        assert (ckpt / "config.json").is_file() and (ckpt / "trainer.pt").is_file()  # came back to the driver

        # node 2 sees none of it: its processes live in a mount namespace with an empty state dir
        pids = set(netns_pids(f"{NAME}-head")) | set(netns_pids(f"{NAME}-node2"))
        node2 = netns_pids(f"{NAME}-node2")[0]
        for path in (ckpt, home / "models" / "policy" / "config.json"):
            seen = subprocess.run(["nsenter", "-t", str(node2), "-m", "test", "-e", str(path)])
            assert seen.returncode == 1, f"node 2 can see {path}"

        # two FSDP2 trainer ranks, one per node (each node offers one `trainer_rank`): gloo across the veth;
        # and weights as files (disk sync): a bundle through Ray's object store, written on node 2's own disk,
        # into the HF engine there (one run for both: a second vLLM start on node 2 costs ~30 s)
        results, _ = train_on_cluster(env, home, "ranks", "train.steps=2", "train.ranks=2", "eval.after=false",
                                      "placement.trainer={trainer_rank: 1}", "train.checkpoint_every=2",
                                      "rollout.engine=hf", "rollout.weight_sync=disk")
        assert sorted(results["nodes"]["trainer_ranks"]) == [HEAD, NODE2] and results["samples_trained"] > 0
        assert results["nodes"]["engines"] == [NODE2] and results["engine_requests"][0] > 0
        assert results["engine_versions"] == [2]  # the engine on node 2 took each step's weights from the files
        ckpt = home / "runs" / "ranks" / "checkpoints" / "step-000002"
        assert len(list((ckpt / "dcp").glob("*.distcp"))) == 2  # both ranks' shards reached the driver
    finally:
        pids |= set(netns_pids(f"{NAME}-head")) | set(netns_pids(f"{NAME}-node2"))
        down = cluster(env, "down")
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert down.returncode == 0, down.stdout + down.stderr
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert NAME not in namespaces
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"{NAME}-" not in links
    assert pids and not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
