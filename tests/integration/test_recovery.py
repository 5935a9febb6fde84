"""A run outlives its rollout engine and env worker: the vLLM server the run started is killed
(SIGKILL) after one step, the env worker's process after the next, and the restarted server is stopped
(SIGSTOP, a hang) after a third; each time the supervisor restarts what died (an engine is given the
current weights), the groups it was running are re-queued under their ids, and the run finishes with
every group's fate recorded once. (The trainer's death: tests/integration/test_resume.py.)"""

from __future__ import annotations

import json
import os
import signal

import psutil

from factory.rollout.server import owned_servers
from factory.run import run

from .conftest import actor_pids, one_fate_per_group, small_recipe

# probes every 2 s, a hang declared after 2 missed 3 s probes: the test waits seconds, not minutes
QUICK_HEALTH = ["rollout.health.interval_s=2", "rollout.health.timeout_s=3", "rollout.health.misses=2",
                "rollout.health.first_wait_s=5"]


def engine_server_pid(other_engines: set[int]) -> int:
    """The vLLM API server of the run's one engine actor (forked by the zygote, or the actor's child, in a
    session of its own); `other_engines`: engine actors alive before the run (the session's shared one)."""
    (actor,) = set(actor_pids("EngineActor")) - other_engines
    servers = owned_servers(actor)
    assert len(servers) == 1, servers
    return servers[0]


def test_a_killed_then_hung_engine_is_restarted_and_every_group_keeps_one_fate(ray_cluster, policy, tmp_path):
    recipe = small_recipe(*QUICK_HEALTH, "train.steps=5", "train.checkpoint_every=0", "eval.before=false",
                          "eval.after=false")
    faults: list[tuple[int, str, int]] = []
    others = set(actor_pids("EngineActor"))

    def inject(report):
        if report.step == 1:
            pid = engine_server_pid(others)
            os.kill(pid, signal.SIGKILL)  # a crash: the server's process is gone
            faults.append((1, "SIGKILL", pid))
        elif report.step == 2:
            (pid,) = actor_pids("EnvWorkerActor")
            os.kill(pid, signal.SIGKILL)
            faults.append((2, "SIGKILL worker", pid))
        elif report.step == 3:
            pid = engine_server_pid(others)
            os.kill(pid, signal.SIGSTOP)  # a hang: the process lives but never answers
            faults.append((3, "SIGSTOP", pid))

    results = run(recipe, tmp_path, on_step=inject)

    assert [f[:2] for f in faults] == [(1, "SIGKILL"), (2, "SIGKILL worker"), (3, "SIGSTOP")]
    assert faults[0][2] != faults[2][2]  # the hang hit the restarted server
    assert results["restarts"] == {"engine": 2, "worker": 1, "scorer": 0, "sync": 0}
    assert not psutil.pid_exists(faults[2][2]) or psutil.Process(faults[2][2]).status() == psutil.STATUS_ZOMBIE
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert metrics[-1]["rollout/engine_restarts"] == 2 and metrics[-1]["env/worker_restarts"] == 1
    # the restarted engine serves the trainer's weights: steps after a restart train on its samples
    assert results["engine_versions"] == [5] and results["samples_trained"] > 0
    # groups cut short were re-queued, not failed; each group has one fate, each sample one row
    assert results["buffer"]["buffer/failed"] == 0
    one_fate_per_group(tmp_path.name, recipe.rollout.group_size)
    assert (tmp_path / "engine-0.restart-1.log").is_file() and (tmp_path / "engine-0.restart-2.log").is_file()
