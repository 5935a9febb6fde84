"""The supervisor's view of an actor that does not answer (pure logic: no actors are probed here; the
two-node tests put it on a real partition): unreachable is waited for up to deadlines.partition_s, a
death is a death at once, and a lost node's roles move only to a node that offers their resources."""

from __future__ import annotations

import time
import types

import ray

from factory.recipe import Recipe
from factory.runtime.supervisor import Supervisor, _offers


def supervisor(partition_s: float) -> Supervisor:
    recipe = Recipe.model_validate({"deadlines": {"partition_s": partition_s}})
    actors = types.SimpleNamespace(engines=[None], workers=[None])
    return Supervisor(actors, recipe, start_engine=lambda i, n: None, start_worker=lambda owner: None,
                      start_scorer=None, restartable=True)


def unavailable() -> ray.exceptions.ActorUnavailableError:
    return ray.exceptions.ActorUnavailableError("RpcError: failed to connect to all addresses", None)


def test_an_unreachable_actor_is_waited_for_until_the_partition_deadline():
    sup = supervisor(partition_s=0.3)
    assert sup._unanswered("engine", 0, unavailable()) is None
    assert sup._unanswered("engine", 0, ray.exceptions.GetTimeoutError()) is None  # its actor silent: the same
    time.sleep(0.35)
    dead, why = sup._unanswered("engine", 0, unavailable())
    assert dead and "did not answer for 0 s (deadlines.partition_s=0.3)" in why
    assert ("engine", 0) not in sup._unreachable  # counted once: the next probe starts afresh


def test_an_answer_ends_the_wait_and_a_death_is_not_waited_for():
    sup = supervisor(partition_s=0.3)
    assert sup._unanswered("worker", 0, unavailable()) is None
    sup._reached("worker", 0)
    time.sleep(0.35)
    assert sup._unanswered("worker", 0, unavailable()) is None  # a new outage, its own deadline
    assert sup._unanswered("worker", 0, ray.exceptions.ActorDiedError()) == (True, "its actor died (ActorDiedError)")


def test_a_node_offers_a_role_only_with_every_resource_it_asks_for():
    node = {"Alive": True, "Resources": {"CPU": 8.0, "rollout": 8.0}}
    assert _offers(node, {"rollout": 1}) and _offers(node, {"rollout": 8, "CPU": 2})
    assert not _offers(node, {"rollout": 9}) and not _offers(node, {"trainer": 1})
