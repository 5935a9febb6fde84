"""Waits on actors that end: `Deadline.get` is `ray.get` with the time left of a recipe deadline.

A wait that passes its deadline raises `DeadlineExceeded` naming the wait and the `deadlines.*`
setting; a `RunFailure` raised inside an actor (e.g. the buffer's `EnvironmentFailure`) reaches the
caller as itself, not wrapped in Ray's task error.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from factory.support.failures import DeadlineExceeded, RunFailure


class Deadline:
    """`seconds` from now for `what` (e.g. "weight sync of step 3"), set by recipe field `setting`."""

    def __init__(self, seconds: float, what: str, setting: str, hint: str | Callable[[], str] = ""):
        self.seconds = seconds
        self.what = what
        self.setting = setting
        self.hint = hint
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def get(self, refs, poll: Callable[[], bool] | None = None):
        """`ray.get(refs)` within the time left. `poll`: called about once a second while waiting (the
        run's supervisor restarting a dead actor); when it returns True the deadline starts afresh, since
        the work waited for was held up by the restart."""
        if poll is not None:
            pending = list(refs) if isinstance(refs, list) else [refs]
            while True:
                _, waiting = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, self.left()))
                if not waiting:
                    break
                if poll():
                    self.end = time.monotonic() + self.seconds
                elif self.left() <= 0:
                    raise self.exceeded()
        left = self.left()
        try:
            return ray.get(refs, timeout=None if left == float("inf") else left)
        except ray.exceptions.GetTimeoutError:
            raise self.exceeded() from None
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, RunFailure):
                raise err.cause from None
            raise

    def exceeded(self) -> DeadlineExceeded:
        hint = self.hint() if callable(self.hint) else self.hint  # e.g. what the buffer holds at that moment
        hint = f"; {hint}" if hint else ""
        return DeadlineExceeded(f"{self.what}: not done within {self.setting}={self.seconds:g} s{hint} (raise "
                                f"{self.setting} in the recipe if this work is meant to take longer)")


def get_within(refs, seconds: float, what: str, setting: str, hint: str | Callable[[], str] = "",
               poll: Callable[[], bool] | None = None):
    """`ray.get(refs)` that ends by `seconds` (see `Deadline`)."""
    return Deadline(seconds, what, setting, hint).get(refs, poll)
