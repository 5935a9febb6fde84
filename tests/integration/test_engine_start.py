"""An engine whose start fails is replaced, not the end of the run (`factory.run.start_engines`): here a
real vLLM engine actor whose server is not ready within its start-up timeout (0.5 s), the way a server
that hangs while starting fails. The replacement serves; the failed one's actor and server are gone.
The last try's failure is raised."""

from __future__ import annotations

import psutil
import pytest
import ray

from factory.rollout.engine import SamplingParams
from factory.rollout.server import owned_servers
from factory.run import start_engines
from factory.runtime.actors import EngineActor


def engine_actor(policy, rollout, log, hang: bool):
    return EngineActor.remote("vllm", str(policy), rollout.model_copy(update={"startup_timeout_s": 0.5}) if hang
                              else rollout, str(log))


def test_an_engine_whose_start_fails_is_replaced_and_the_last_try_s_failure_is_raised(ray_cluster, recipe, policy,
                                                                                 tmp_path):
    made: list[str] = []

    def remake(i: int, tag: str):
        made.append(tag)
        return engine_actor(policy, recipe.rollout, tmp_path / f"engine-{i}.{tag}.log", hang=False)

    first = engine_actor(policy, recipe.rollout, tmp_path / "engine-0.log", hang=True)
    first_pid = ray.get(first.pid.remote())
    engines = start_engines([first], remake, timeout_s=300)
    try:
        assert made == ["start-2"] and engines[0] is not first
        answer = ray.get(engines[0].generate.remote([1, 5, 6, 7], SamplingParams(max_new_tokens=4), "probe"))
        assert len(answer.token_ids) >= 1
        assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE
        assert owned_servers(first_pid) == []  # its server went with its failed start
    finally:
        ray.get(engines[0].stop.remote())

    # the last try's failure is raised (one try here: a second failing start would only cost time)
    with pytest.raises(ray.exceptions.RayTaskError, match="not ready after"):
        start_engines([engine_actor(policy, recipe.rollout, tmp_path / "again.log", hang=True)], remake,
                      timeout_s=300, tries=1)
    assert made == ["start-2"]
