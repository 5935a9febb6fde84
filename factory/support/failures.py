"""Failures made loud: what an env worker logs when an episode raises, when the run gives up, and
the errors a run stops with.

An environment, reward or sandbox error inside an episode fails its group. The env worker logs it
(`FailureLog`: the first few tracebacks in full, then a count line at 2^k failures) and tells the
buffer, whose `FailureGate` fails the run once failures pass the recipe's `failures` limits:
`max_in_a_row` consecutive failed groups, or a share above `max_share` once `min_groups` groups
have finished. The run then stops with an `EnvironmentFailure` naming the environment and showing
the first traceback. Every wait of the loop has a deadline (`deadlines.*`); one that passes stops
the run with a `DeadlineExceeded` naming the setting; a lake or MLflow outage longer than
`deadlines.service_outage_s` with a `ServiceOutage` naming the service. Training on which no group
has a reward spread (every reply scored alike) warns every `deadlines.no_signal_warn_s` and stops at
`deadlines.no_signal_s` (`SpreadWatch`).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


class RunFailure(RuntimeError):
    """A run stopped on purpose; its message says what happened and what to change (printed whole)."""


class EnvironmentFailure(RunFailure):
    """Too many groups failed inside the environment (its episodes, reward or sandbox raised)."""


class DeadlineExceeded(RunFailure):
    """A wait of the run loop passed its `deadlines.*` setting."""


class ServiceOutage(RunFailure):
    """A service the run writes to (lake, MLflow) stayed unreachable past `deadlines.service_outage_s`
    (`factory.recording.outage`); the message names the service and what was kept."""


@dataclass
class EpisodeFailure:
    """One failed group as the env worker reports it to the buffer."""

    env: str
    task_id: str
    error: str  # "TypeName: message", one line
    traceback: str  # the whole formatted traceback

    @classmethod
    def of(cls, env: str, task_id: str, err: BaseException) -> EpisodeFailure:
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return cls(env, task_id, f"{type(err).__name__}: {first}".rstrip(": "), text)


class FailureLog:
    """Logs failures without flooding: the first `full` tracebacks whole, then one count line each
    time the total reaches a power of two (4, 8, 16, ... after the first few)."""

    def __init__(self, logger: logging.Logger, full: int = 3):
        self.logger = logger
        self.full = full
        self.total = 0
        self.by_error: Counter[str] = Counter()

    def record(self, failure: EpisodeFailure) -> None:
        self.total += 1
        self.by_error[failure.error.split(":", 1)[0]] += 1
        if self.total <= self.full:
            self.logger.error("environment %r: group failed on task %s (failure %d; the first %d are shown "
                              "in full)\n%s", failure.env, failure.task_id, self.total, self.full,
                              failure.traceback.rstrip())
        elif self.total & (self.total - 1) == 0:  # a power of two
            kinds = ", ".join(f"{k} x{n}" for k, n in self.by_error.most_common())
            self.logger.error("environment %r: %d groups failed so far (%s); latest: %s", failure.env,
                              self.total, kinds, failure.error)


class FailureGate:
    """Decides when failed groups fail the run (the buffer holds one).

    Trips when `max_in_a_row` groups in a row failed, or when failed / finished > `max_share` once at
    least `min_groups` groups finished. `message()` names the environment, the counts, the limit that
    tripped and the first traceback."""

    def __init__(self, max_in_a_row: int, max_share: float, min_groups: int):
        self.max_in_a_row = max_in_a_row
        self.max_share = max_share
        self.min_groups = min_groups
        self.finished = 0
        self.failed = 0
        self.in_a_row = 0
        self.first: EpisodeFailure | None = None
        self.tripped: str | None = None  # which limit, once it tripped

    def record(self, failure: EpisodeFailure | None) -> None:
        self.finished += 1
        if failure is None:
            self.in_a_row = 0
            return
        self.failed += 1
        self.in_a_row += 1
        self.first = self.first or failure
        if self.tripped:
            return
        if self.in_a_row >= self.max_in_a_row:
            self.tripped = f"{self.in_a_row} in a row (failures.max_in_a_row={self.max_in_a_row})"
        elif self.finished >= self.min_groups and self.failed / self.finished > self.max_share:
            self.tripped = (f"{self.failed / self.finished:.0%} of {self.finished} finished groups (failures.max_share="
                            f"{self.max_share:g} after failures.min_groups={self.min_groups})")
        if self.tripped:  # the counts as they were when it tripped (groups keep finishing until the run stops)
            self._counts = f"{self.failed} of {self.finished} groups failed"

    def message(self) -> str:
        first = self.first
        assert first is not None and self.tripped
        return (f"environment {first.env!r}: {self._counts}, {self.tripped}; "
                f"first error: {first.error} (task {first.task_id}); its traceback:\n{first.traceback.rstrip()}")


class NoRewardSpread(RunFailure):
    """No finished group had a reward spread for `deadlines.no_signal_s` (`SpreadWatch`)."""


ASK_AT_MOST_EVERY_S = 2.0  # how often, at most, SpreadWatch asks the buffer (a Ray call)


class SpreadWatch:
    """Warns, then stops the run, when groups keep finishing but none has a reward spread.

    Fed the buffer's `buffer/*_since_spread` metrics (`StalenessBuffer.since_spread`): once the seconds
    since the last group with a spread reach `warn_s` (with at least one group finished since),
    `observe` calls `warn` with one line holding the counts, again at most every `warn_s`; once they
    reach `stop_s` (0 or None: never) it raises `NoRewardSpread` with that line. One rule with the
    zero-variance filter on (those groups are dropped: no batch comes) and off (they are trained with
    advantage 0: steps without a policy gradient; the run watches only where that holds). `due()`:
    whether the buffer's seconds may have crossed a threshold since the last `observe`, on this
    process's `clock` (the loop asks the buffer only then, not at every poll of a batch wait)."""

    def __init__(self, warn_s: float, stop_s: float | None, warn: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.warn_s = warn_s
        self.stop_s = stop_s or None
        self.warn = warn
        self.clock = clock
        self.warned_at: float | None = None
        # the buffer counts from its first group's start, after this: no threshold is reached sooner
        self.next_at = self.clock() + min(warn_s, self.stop_s or warn_s)

    def due(self) -> bool:
        return self.clock() >= self.next_at

    def observe(self, metrics: dict[str, float]) -> None:
        now = self.clock()
        seconds, groups = metrics["buffer/seconds_since_spread"], metrics["buffer/groups_since_spread"]
        if groups and (seconds >= self.warn_s or (self.stop_s and seconds >= self.stop_s)):
            line = self.message(metrics)
            if self.stop_s and seconds >= self.stop_s:
                raise NoRewardSpread(f"{line}; the run stops at deadlines.no_signal_s={self.stop_s:g}")
            if self.warned_at is None or now - self.warned_at >= self.warn_s:
                self.warned_at = now
                self.warn(line)
        ahead = [t - seconds for t in (self.warn_s, self.stop_s) if t and t > seconds]
        if seconds >= self.warn_s:  # the next line once allowed; without a finished group, soon
            ahead.append(self.warned_at + self.warn_s - now if groups and self.warned_at is not None else 0.0)
        self.next_at = now + max(ASK_AT_MOST_EVERY_S, min(ahead, default=ASK_AT_MOST_EVERY_S))

    def message(self, m: dict[str, float]) -> str:
        """One line: how long, how many groups and samples, their mean reward and what became of them."""
        groups, filtered, stale = (int(m[f"buffer/{k}_since_spread"]) for k in ("groups", "filtered", "rejected"))
        reward = m["buffer/reward_since_spread"]
        fates = []
        if filtered:
            fates.append("algorithm.filter_zero_variance dropped " + ("them all" if filtered == groups else
                                                                      f"{filtered} of them"))
        if groups - filtered - stale:
            trained = groups - filtered - stale
            fates.append(("they were" if trained == groups else f"{trained} were") + " trained with advantage 0 "
                         "(algorithm.filter_zero_variance is off)")
        if stale:
            fates.append(("they were" if stale == groups else f"{stale} were") + " rejected as stale")
        if reward <= 0:
            why = "the policy may never solve these tasks"
        elif reward >= 1:
            why = "the policy already solves every one of these tasks"
        else:
            why = "every group's replies scored alike"
        return (f"no reward spread for {m['buffer/seconds_since_spread']:.0f} s: {groups} groups "
                f"({m['buffer/samples_since_spread']:.0f} samples) finished since the last one, mean reward "
                f"{reward:.3f}, and {' and '.join(fates)}; {why} (see deadlines.no_signal_s)")
