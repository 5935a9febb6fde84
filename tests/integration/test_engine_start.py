"""An engine whose start fails is replaced, not the end of the run (`factory.run.start_engines`).

A real run whose engine's vLLM server is stopped (SIGSTOP) while it starts: not ready within the
recipe's start-up timeout, it is killed, a new engine is started in its place, the env workers (made
with the first engine's handle) are given the new one, and the run trains. (The chaos bench found both:
a fault stopped a server mid-start and the run ended; with the retry but not the hand-over, the run
made no progress.) Then a start that fails on its last try is raised."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import ray

from factory.rollout.server import owned_servers
from factory.run import run, start_engines
from factory.runtime.actors import EngineActor

from .conftest import actor_pids, small_recipe


def test_a_run_whose_engine_hangs_while_starting_starts_another_and_trains(ray_cluster, policy, tmp_path):
    recipe = small_recipe("rollout.startup_timeout_s=12", "train.steps=2", "eval.before=false", "eval.after=false",
                          "lake.enabled=false", "tracking.enabled=false", "train.checkpoint_every=0")
    others = set(actor_pids("EngineActor"))
    stopped: list[int] = []
    done = threading.Event()

    def stop_the_first_server() -> None:  # as soon as the run's first engine has a server
        while not done.is_set() and not stopped:
            for actor in set(actor_pids("EngineActor")) - others:
                for server in owned_servers(actor):
                    os.kill(server, signal.SIGSTOP)
                    stopped.append(server)
            time.sleep(0.05)

    watcher = threading.Thread(target=stop_the_first_server, daemon=True)
    watcher.start()
    try:
        results = run(recipe, tmp_path)
    finally:
        done.set()
        watcher.join(timeout=10)
    assert len(stopped) == 1
    assert results["samples_trained"] > 0 and results["steps"] == 2
    assert (tmp_path / "engine-0.start-2.log").is_file()  # the engine started in its place
    # the stopped server was ended, not left behind (a forked server's pid is known only once it leads its
    # own process group, so the stop never lands before the group kill can find it: seen once before that)
    assert not psutil.pid_exists(stopped[0]) or psutil.Process(stopped[0]).status() == psutil.STATUS_ZOMBIE


def test_the_last_try_s_failure_is_raised(ray_cluster, recipe, policy, tmp_path):
    hung = recipe.rollout.model_copy(update={"startup_timeout_s": 0.5})  # never ready in time
    made: list[str] = []
    with pytest.raises(ray.exceptions.RayTaskError, match="not ready after"):
        start_engines([EngineActor.remote("vllm", str(policy), hung, str(tmp_path / "e.log"))],
                      lambda i, tag: made.append(tag), timeout_s=300, tries=1)
    assert made == []  # one try: nothing made in its place
