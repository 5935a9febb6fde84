"""Riding out a network partition: Ray calls that fail with a transient error are tried again.

While the link between two nodes is down, a call from one to an actor on the other fails with
`ray.exceptions.ActorUnavailableError` ("The actor is temporarily unavailable: RpcError ..."): the
actor may still be alive, and Ray says so. Ray makes it a kind of `RayActorError`, the error of a
dead actor; every place that treats `RayActorError` as a death must ask `transient` first.

`acall` (from an actor's event loop: the env workers' calls to the buffer) retries such a call with
backoff until the recipe's `deadlines.partition_s` has passed since the first failure, and then
raises `Unreachable`, which the caller treats as the actor's death. (The driver's own calls are
waited out by the supervisor: runtime/supervisor.py.) A call that failed transiently may
or may not have run on the other side: every method retried this way is one whose second run is
harmless (the buffer's reports are keyed by group and lease, its requeues by group id).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import ray

BACKOFF_FIRST_S = 0.25
BACKOFF_MAX_S = 4.0


class Unreachable(ray.exceptions.RayActorError):
    """An actor that stayed unreachable for `deadlines.partition_s`: treated as dead (it is one kind of
    `RayActorError`, so the run's recovery of dead actors applies)."""

    def __init__(self, message: str):
        super().__init__(error_msg=message)


def transient(err: BaseException) -> bool:
    """Whether `err` says the actor may be back: unavailable (a partition, a node's network restart),
    not dead."""
    return isinstance(err, ray.exceptions.ActorUnavailableError) and not isinstance(err, Unreachable)


def backoff(first: float = BACKOFF_FIRST_S, most: float = BACKOFF_MAX_S):
    """Delays between tries: doubling from `first` up to `most`."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, most)


class _Tries:
    """The bookkeeping of one retried call: when it first failed, and whether the deadline has passed."""

    def __init__(self, what: str, partition_s: float, on_retry: Callable[[str], None] | None):
        self.what, self.partition_s, self.on_retry = what, partition_s, on_retry
        self.since: float | None = None
        self.delays = backoff()
        self.tries = 0

    def failed(self, err: BaseException) -> float:
        """The delay before the next try; raises `Unreachable` once `partition_s` has passed."""
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        self.tries += 1
        if now - self.since >= self.partition_s:
            raise Unreachable(f"{self.what}: unreachable for {now - self.since:.0f} s, past deadlines.partition_s="
                              f"{self.partition_s:g} ({type(err).__name__}); treated as lost") from err
        if self.tries == 1 and self.on_retry is not None:
            self.on_retry(f"{self.what}: {type(err).__name__}; retrying for up to deadlines.partition_s="
                          f"{self.partition_s:g} s")
        return min(next(self.delays), max(0.0, self.since + self.partition_s - now))


async def acall(method, *args, partition_s: float, what: str, on_retry: Callable[[str], None] | None = None,
                **kwargs):
    """`await method.remote(*args, **kwargs)` inside an actor, tried again while the actor is unavailable,
    for up to `partition_s` seconds from the first such failure."""
    tries = _Tries(what, partition_s, on_retry)
    while True:
        try:
            return await method.remote(*args, **kwargs)
        except ray.exceptions.RayActorError as err:
            if not transient(err):
                raise
            await asyncio.sleep(tries.failed(err))
