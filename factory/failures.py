"""Failures made loud: what an env worker logs when an episode raises, when the run gives up, and
the errors a run stops with.

An environment, reward or sandbox error inside an episode fails its group. The env worker logs it
(`FailureLog`: the first few tracebacks in full, then a count line at 2^k failures) and tells the
buffer, whose `FailureGate` fails the run once failures pass the recipe's `failures` limits:
`max_in_a_row` consecutive failed groups, or a share above `max_share` once `min_groups` groups
have finished. The run then stops with an `EnvironmentFailure` naming the environment and showing
the first traceback. Every wait of the loop has a deadline (`deadlines.*`); one that passes stops
the run with a `DeadlineExceeded` naming the setting; a lake or MLflow outage longer than
`deadlines.service_outage_s` with a `ServiceOutage` naming the service.
"""

from __future__ import annotations

import logging
import traceback
from collections import Counter
from dataclasses import dataclass


class RunFailure(RuntimeError):
    """A run stopped on purpose; its message says what happened and what to change (printed whole)."""


class EnvironmentFailure(RunFailure):
    """Too many groups failed inside the environment (its episodes, reward or sandbox raised)."""


class DeadlineExceeded(RunFailure):
    """A wait of the run loop passed its `deadlines.*` setting."""


class ServiceOutage(RunFailure):
    """A service the run writes to (lake, MLflow) stayed unreachable past `deadlines.service_outage_s`
    (`factory.outage`); the message names the service and what was kept."""


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
