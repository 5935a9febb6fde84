"""Server mode (slime's): a recipe names running engines by URL; the run attaches to them, syncs its
weights into them and leaves them running. The engine here is the session's vLLM server, which this
run did not start (it is started like `factory serve` starts one)."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import psutil
import pytest
import ray

from factory.rollout.server import owned_servers
from factory.rollout.vllm import EngineStartError
from factory.run import run

from .conftest import FILTER_ON, small_recipe

pytestmark = pytest.mark.integration


def test_a_recipe_naming_engine_urls_trains_on_an_engine_it_did_not_start(engine, tmp_path):
    """The attached server also hangs for a while (SIGSTOP after step 1, SIGCONT 15 s later): the run
    waits for it instead of restarting it, then reconnects and gives it the weights again. (With the
    zero-variance filter, as the default recipe: its steps' pace is the one this fault was timed under.)"""
    url = ray.get(engine.url.remote())
    recipe = small_recipe(f"rollout.urls=[{url}]", FILTER_ON, "train.steps=3", "eval.before=false", "eval.heldout=16",
                          "lake.enabled=false", "tracking.enabled=false", "rollout.health.interval_s=2",
                          "rollout.health.timeout_s=3", "rollout.health.first_wait_s=0")
    (server,) = [psutil.Process(pid) for pid in owned_servers(ray.get(engine.pid.remote()))]
    stalls: list[threading.Timer] = []

    def stall(report):
        if report.step == 1:
            server.send_signal(signal.SIGSTOP)
            stalls.append(threading.Timer(15, server.send_signal, (signal.SIGCONT,)))
            stalls[0].start()

    try:
        results = run(recipe, tmp_path, on_step=stall)  # no engines handed in: the run attaches to the URL
    finally:
        server.send_signal(signal.SIGCONT)
    assert results["samples_trained"] > 0 and results["engine_requests"][0] > 0
    assert results["restarts"]["engine"] == 1  # found hung, waited for: the same server, never restarted
    assert server.is_running() and server.status() != psutil.STATUS_STOPPED
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # the attached engine took the run's weights at the start, every step's (an update the stall held up
    # completes late, or the current weights are sent again once it answers), the last one before the run
    # ended (a step's metrics may predate its own update: rollout.overlap_sync)
    assert results["engine_updates"][0] >= recipe.train.steps + 1
    assert results["engine_versions"] == [recipe.train.steps]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # left running
    assert results["after"]["n"] == 16


def test_a_url_where_no_engine_answers_is_a_plain_error(ray_cluster, tmp_path):
    recipe = small_recipe("rollout.urls=[http://127.0.0.1:9]", "train.steps=1", "eval.before=false",
                          "lake.enabled=false", "tracking.enabled=false")
    with pytest.raises(EngineStartError, match=r"rollout.urls: no vLLM server answers at http://127.0.0.1:9 "):
        run(recipe, tmp_path)
