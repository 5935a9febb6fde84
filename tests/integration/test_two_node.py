"""A real two-node Ray run on one machine (infra/cluster/netns.sh): two network namespaces joined by a
veth pair, node 1 (trainer, buffer, driver) and node 2 (rollout engine, env worker), node 2 with a
private empty view of the state directory. The policy, the weights and the checkpoints can only have
crossed over the network. Then the faults a real cluster has, mid-run: the link between the nodes
down for 30 s (a partition), node 2 lost and a new one started, and node 2 lost for good. One cluster
serves the module; tear-down must leave no namespace, veth or Ray process behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from infra.cluster.control import TwoNodes

from .conftest import REPO, TEST_OVERRIDES, one_fate_per_group

pytestmark = pytest.mark.integration


def run_command(home: Path, name: str, *overrides: str) -> list[str]:
    keep = [o for o in TEST_OVERRIDES if not o.startswith(("model.", "train.steps", "eval.heldout"))]
    return [sys.executable, "-m", "factory.cli", "run", str(REPO / "recipes" / "two_node.yaml"), *keep,
            f"model.path={home / 'models' / 'policy'}", "eval.before=false", "eval.heldout=32",
            "tracking.enabled=false", *overrides, "--run-dir", str(home / "runs" / name)]


def train_on_cluster(nodes: TwoNodes, name: str, *overrides: str) -> tuple[dict, str]:
    done = nodes.run(run_command(nodes.home, name, *overrides))
    log = done.stdout[-3000:] + done.stderr[-6000:]
    assert done.returncode == 0, log
    return json.loads((nodes.home / "runs" / name / "results.json").read_text()), log


def faulted_run(nodes: TwoNodes, name: str, *overrides: str):
    """A run in the background, to be hit by a fault mid-run."""
    return nodes.start_run(run_command(nodes.home, name, *overrides), nodes.home / "runs" / name,
                           nodes.home / f"{name}.log")


def lake_fates(home: Path, run_id: str, group_size: int, monkeypatch) -> list[dict]:
    monkeypatch.setenv("FACTORY_HOME", str(home))  # the run's lake: node 1's state dir
    return one_fate_per_group(run_id, group_size)


@pytest.fixture(scope="module")
def two_nodes(policy, tmp_path_factory):
    """The cluster, up once for the module; tear-down leaves no namespace, veth or process behind."""
    home = tmp_path_factory.mktemp("two-nodes") / "home"
    shutil.copytree(policy, home / "models" / "policy")  # under the dir node 2 cannot see
    nodes = TwoNodes(home)
    pids: set[int] = set()
    try:
        assert f"cluster up: {nodes.head}, {nodes.node2}" in nodes.up()
        yield nodes
    finally:
        pids |= set(nodes.pids("head")) | set(nodes.pids("node2"))
        nodes.down()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert nodes.name not in namespaces
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"{nodes.name}-" not in links
    assert pids and not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_a_run_spans_two_nodes_that_share_nothing_but_the_network(two_nodes):
    nodes = two_nodes
    home, head_ip, node2_ip = nodes.home, nodes.head, nodes.node2
    # weights by gloo broadcast: rendezvous on node 1's address, receiver joins from node 2's
    results, log = train_on_cluster(nodes, "broadcast", "train.steps=3", "train.checkpoint_every=3")
    where = results["nodes"]
    assert where["driver"] == where["trainer"] == where["buffer"] == head_ip, where
    assert where["engines"] == [node2_ip] and where["env_workers"] == [node2_ip], where
    assert results["engine_requests"][0] > 0  # samples were generated on node 2 ...
    assert results["samples_trained"] > 0  # ... and trained on node 1
    assert 0.0 <= results["after"]["mean"] <= 1.0
    ckpt = home / "runs" / "broadcast" / "checkpoints" / "step-000003"
    assert (ckpt / "config.json").is_file() and (ckpt / "trainer.pt").is_file()  # came back to the driver

    # node 2 sees none of it: its processes live in a mount namespace with an empty state dir
    node2 = nodes.pids("node2")[0]
    for path in (ckpt, home / "models" / "policy" / "config.json"):
        seen = subprocess.run(["nsenter", "-t", str(node2), "-m", "test", "-e", str(path)])
        assert seen.returncode == 1, f"node 2 can see {path}"

    # two FSDP2 trainer ranks, one per node (each node offers one `trainer_rank`): gloo across the veth;
    # and weights as files (disk sync): a bundle through Ray's object store, written on node 2's own disk,
    # into the HF engine there (one run for both: a second vLLM start on node 2 costs ~30 s)
    results, _ = train_on_cluster(nodes, "ranks", "train.steps=2", "train.ranks=2", "eval.after=false",
                                  "placement.trainer={trainer_rank: 1}", "train.checkpoint_every=2",
                                  "rollout.engine=hf", "rollout.weight_sync=disk")
    assert sorted(results["nodes"]["trainer_ranks"]) == [head_ip, node2_ip] and results["samples_trained"] > 0
    assert results["nodes"]["engines"] == [node2_ip] and results["engine_requests"][0] > 0
    assert results["engine_versions"] == [2]  # the engine on node 2 took each step's weights from the files
    ckpt = home / "runs" / "ranks" / "checkpoints" / "step-000002"
    assert len(list((ckpt / "dcp").glob("*.distcp"))) == 2  # both ranks' shards reached the driver


# the faults below: runs long enough to be hit mid-run, every sample in the lake, no evaluation after
FAULTED = ("train.steps=8", "train.checkpoint_every=0", "eval.after=false", "lake.enabled=true")
# longer than a 30-s partition: at 30 s Ray's connections sometimes outlive the outage (TCP retransmits),
# at 45 s they are reset and the env worker's calls to the buffer fail as unavailable (the case that left
# groups "running" for ever), and Ray's GCS still does not declare node 2 dead (5 missed 10-s health checks)
PARTITION_S = 45


def test_a_partition_mid_run_costs_the_partition_not_the_run(two_nodes, monkeypatch):
    """The link between the nodes down for 45 s after step 2: the env worker's reports, tickets and lease
    renewals to the buffer fail as transient ("the actor is temporarily unavailable") and are retried;
    the supervisor's probes of node 2 wait (deadlines.partition_s); nothing is restarted. Once the link is
    back the run goes on and finishes, with every group's fate once in the lake."""
    run = faulted_run(two_nodes, "partition", *FAULTED)
    run.wait_for_step(2)
    t0 = time.monotonic()
    two_nodes.partition(PARTITION_S)
    assert run.finish() == 0, run.tail()
    after_s = time.monotonic() - t0
    results = run.results()
    assert results["steps"] == 8 and results["samples_trained"] > 0
    # nothing restarted (a weight sync cut by the partition forms its group anew: not a restart)
    assert results["restarts"]["engine"] == 0 and results["restarts"]["worker"] == 0, results["restarts"]
    assert results["buffer"]["buffer/running"] == 0
    # the run lost the partition and a few steps' time, not a deadline's (deadlines.batch_s = 600 s)
    assert after_s < PARTITION_S + 120, after_s
    lake_fates(two_nodes.home, "partition", 4, monkeypatch)
    # a group whose report fails as unavailable is retried, never an unretrieved task exception that leaves
    # it "running" in the buffer until deadlines.batch_s ends the run
    assert "Task exception was never retrieved" not in run.tail(1_000_000)


def test_a_lost_node_whose_replacement_joins_takes_its_roles_back(two_nodes, monkeypatch):
    """Every process of node 2 killed at step 2 and a new node 2 started 15 s later: Ray declares the old
    node dead, the engine and env worker are started again on the new one (the policy reaches it over the
    network), the groups they ran are re-queued, and the run finishes with every group's fate once."""
    run = faulted_run(two_nodes, "node-back", *FAULTED)
    run.wait_for_step(2)
    two_nodes.kill_node2()
    time.sleep(15)
    two_nodes.start_node2()
    assert run.finish() == 0, run.tail()
    results = run.results()
    assert results["steps"] == 8 and results["restarts"]["engine"] == 1 and results["restarts"]["worker"] == 1
    assert results["nodes"]["engines"] == [two_nodes.node2] and results["nodes"]["env_workers"] == [two_nodes.node2]
    lake_fates(two_nodes.home, "node-back", 4, monkeypatch)


def test_a_node_lost_for_good_ends_the_run_in_one_line_naming_it(two_nodes):
    """Node 2 killed at step 2 and never back: within deadlines.partition_s (20 s here) of Ray declaring it
    dead, the run ends with one line naming the node, the roles it held and the resources no live node
    offers. (Last in the module: the cluster has one node from here on.)"""
    run = faulted_run(two_nodes, "node-gone", *FAULTED, "deadlines.partition_s=20")
    run.wait_for_step(2)
    t0 = time.monotonic()
    two_nodes.kill_node2()
    assert run.finish(timeout=240) != 0
    assert time.monotonic() - t0 < 150
    last = [line for line in run.tail().splitlines() if line.strip()][-1]
    assert f"node {two_nodes.node2} lost for good" in last and "env worker 0" in last and "rollout engine 0" in last, last
    assert "{'rollout': 1}" in last and "placement." in last, last
