"""Loud failures on the real stack: a broken environment fails the run with its traceback; a paused
vLLM server and a slow trainer end in errors naming the deadline, instead of a hang."""

from __future__ import annotations

import time

import httpx
import pytest
import ray

from factory.support.failures import DeadlineExceeded, EnvironmentFailure
from factory.run import run
from factory.runtime.warm import ENV_WORKERS, TRAINERS

from .conftest import small_recipe

BROKEN = "environment.name=tests.integration.broken_env:ScoringFailsEnvironment"


def test_a_broken_environment_fails_the_run_with_its_first_traceback(engine, tmp_path):
    recipe = small_recipe(BROKEN, "failures.max_in_a_row=3", "eval.before=false", "train.steps=3")
    t0 = time.perf_counter()
    with pytest.raises(EnvironmentFailure) as caught:
        run(recipe, tmp_path, engines=[engine])
    message = str(caught.value)
    assert message.startswith("environment 'scoring_fails': 3 of 3 groups failed, 3 in a row "
                              "(failures.max_in_a_row=3); first error: ConnectionError: reward service unreachable")
    assert "Traceback (most recent call last)" in message
    assert 'broken_env.py", line' in message and "in score" in message  # where it raised, in the environment
    assert time.perf_counter() - t0 < 300  # no hang (133 s seen at load 8 on 2 cores)
    assert not (tmp_path / "results.json").exists()
    # the failed groups are in the lake, each with its error, though the run never trained a step
    from factory.lake.query import sql

    failed = sql(f"SELECT status, error, step FROM samples WHERE run_id = '{tmp_path.name}'").to_pylist()
    assert len(failed) >= 3 and {r["status"] for r in failed} == {"failed"} and {r["step"] for r in failed} == {0}
    assert all(r["error"].startswith("ConnectionError: reward service unreachable while scoring") for r in failed)


@pytest.fixture
def paused_engine(engine):
    """The session's vLLM server, paused through its own /pause endpoint (requests queue, none finish);
    resumed afterwards."""
    url = ray.get(engine.url.remote())
    httpx.post(f"{url}/pause", params={"mode": "keep", "clear_cache": "false"}, timeout=30).raise_for_status()
    try:
        yield engine
    finally:
        httpx.post(f"{url}/resume", timeout=30).raise_for_status()


def test_a_paused_engine_fails_its_episodes_by_the_engine_call_deadline(paused_engine, tmp_path):
    recipe = small_recipe("deadlines.engine_call_s=3", "failures.max_in_a_row=2", "eval.before=false")
    t0 = time.perf_counter()
    with pytest.raises(EnvironmentFailure) as caught:
        run(recipe, tmp_path, engines=[paused_engine])
    message = str(caught.value)
    assert message.startswith("environment 'single_turn': ")
    assert "DeadlineExceeded: engine call " in message and "deadlines.engine_call_s=3 s" in message
    assert time.perf_counter() - t0 < 300


def test_episodes_slower_than_the_batch_deadline_end_the_wait_for_a_batch(engine, tmp_path):
    # every episode thinks for 120 s after its reply (the environment's latency setting): no group finishes
    recipe = small_recipe("deadlines.batch_s=5", "environment.latency.fast_s=120", "eval.before=false")
    with pytest.raises(DeadlineExceeded, match=r"^the batch of step 1: not done within deadlines\.batch_s=5 s; "
                                               r"buffer: [1-9]\d* groups running, 0 queued; finished so far 0 trained"):
        run(recipe, tmp_path, engines=[engine])


def test_a_trainer_step_past_its_deadline_ends_the_run(engine, tmp_path):
    recipe = small_recipe("deadlines.train_step_s=0.001", "eval.before=false")
    with pytest.raises(DeadlineExceeded, match=r"^trainer step 1: not done within deadlines\.train_step_s=0\.001 s"):
        run(recipe, tmp_path, engines=[engine])
    # a failed run's actors are killed with it, never kept for the next run (factory/runtime/warm.py)
    assert TRAINERS.kept() is None and ENV_WORKERS.kept() is None
