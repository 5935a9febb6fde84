"""Retrying calls across a partition (factory/runtime/transient.py), on the logic alone: a stand-in
method that is unavailable for a while; the two-node partition test is tests/integration/test_partition.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from factory.runtime.transient import Unreachable, acall, backoff, transient


def unavailable() -> ray.exceptions.ActorUnavailableError:
    return ray.exceptions.ActorUnavailableError("RpcError: connection to 10.250.0.2 lost", None)


class Flaky:
    """`.remote()` fails as an unavailable actor's call does until `until` (monotonic), then answers."""

    def __init__(self, until: float, error=unavailable):
        self.until, self.error, self.calls = until, error, 0

    def remote(self, *args):
        self.calls += 1

        async def answer():
            if time.monotonic() < self.until:
                raise self.error()
            return ("ok", *args)

        return answer()


def test_an_unavailable_actor_is_transient_and_a_dead_one_is_not():
    assert transient(unavailable())
    assert not transient(ray.exceptions.ActorDiedError())
    assert not transient(Unreachable("gone"))  # past the deadline: a death, not retried again
    assert isinstance(Unreachable("gone"), ray.exceptions.RayActorError)  # the run's recovery of dead actors applies


def test_backoff_doubles_up_to_its_cap():
    delays = backoff(0.25, 4.0)
    assert [next(delays) for _ in range(7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_call_is_retried_until_the_partition_ends():
    said = []
    flaky = Flaky(time.monotonic() + 0.6)
    assert asyncio.run(acall(flaky, 7, partition_s=5, what="the buffer (report)", on_retry=said.append)) == ("ok", 7)
    assert flaky.calls >= 2
    assert len(said) == 1 and "the buffer (report)" in said[0] and "deadlines.partition_s=5" in said[0]


def test_past_the_deadline_the_actor_counts_as_lost_in_one_line():
    flaky = Flaky(time.monotonic() + 60)
    t0 = time.monotonic()
    with pytest.raises(Unreachable, match=r"the buffer \(acquire\): unreachable for \d+ s, past deadlines.partition_s=0.5"):
        asyncio.run(acall(flaky, partition_s=0.5, what="the buffer (acquire)"))
    assert time.monotonic() - t0 < 3  # the last wait is cut to the deadline


def test_a_dead_actor_is_not_retried():
    flaky = Flaky(time.monotonic() + 60, error=ray.exceptions.ActorDiedError)
    with pytest.raises(ray.exceptions.ActorDiedError):
        asyncio.run(acall(flaky, partition_s=30, what="x"))
    assert flaky.calls == 1
