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


async def acall(method, *args, partition_s: float, what: str, on_retry: Callable[[str], None] | None = None,
                **kwargs):
    """`await method.remote(*args, **kwargs)` inside an actor, tried again while the actor is unavailable,
    for up to `partition_s` seconds from the first such failure; `on_retry` hears of the first one."""
    since, delays = None, backoff()
    while True:
        try:
            return await method.remote(*args, **kwargs)
        except ray.exceptions.RayActorError as err:
            if not transient(err):
                raise
            now = time.monotonic()
            if since is None:
                since = now
                if on_retry is not None:
                    on_retry(f"{what}: {type(err).__name__}; retrying for up to deadlines.partition_s={partition_s:g} s")
            if now - since >= partition_s:
                raise Unreachable(f"{what}: unreachable for {now - since:.0f} s, past deadlines.partition_s="
                                  f"{partition_s:g} ({type(err).__name__}); treated as lost") from err
            await asyncio.sleep(min(next(delays), max(0.0, since + partition_s - now)))
