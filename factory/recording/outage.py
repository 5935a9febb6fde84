"""Transient faults of the services a run writes to (the lake's catalog and object store, MLflow):
retried until they pass, fatal only past a deadline.

An outage, as one client sees it, runs from the start of the first call that failed with a
transient error to the next call that succeeds. `retry` calls a function until it succeeds; between
attempts it sleeps `backoff_s(n)` (exponential, with jitter so clients that failed together do not
come back together). It gives up with `ServiceOutage` only when the outage has lasted longer than
the deadline (the recipe's `deadlines.service_outage_s`), with a one-line message naming the
service and what the client kept. `Outage.seconds()` is the time spent in outages so far (the
`lake/outage_s` and `tracking/outage_s` metrics). `GuardedClient` is the one guard both clients (the
lake writer, the MLflow tracker) call their service through.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from factory.support.failures import ServiceOutage

T = TypeVar("T")
DEADLINE_SETTING = "deadlines.service_outage_s"


def backoff_s(attempt: int, base_s: float = 0.05, cap_s: float = 2.0) -> float:
    """Exponential backoff with jitter: `min(cap, base·2^attempt) · U(0.5, 1.5)`."""
    return min(cap_s, base_s * 2 ** min(attempt, 32)) * random.uniform(0.5, 1.5)


def first_line(error: BaseException, *, with_type: bool = True) -> str:
    """An error's first non-blank line (at most 300 characters), after its type's name if `with_type`;
    the type's name alone for an error without text."""
    line = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    if with_type or not line:
        line = f"{type(error).__name__}: {line}".rstrip(": ")
    return line[:300]


class Outage:
    """One service's availability as one client sees it; safe to share between threads.

    `service(error)` names the service an error came from (e.g. the lake's catalog or its object
    store), for the message past the deadline.
    """

    def __init__(self, service: Callable[[BaseException | None], str], deadline_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.deadline_s = deadline_s
        self.clock = clock
        self._lock = threading.Lock()
        self._began: float | None = None  # start of the current outage
        self._past = 0.0  # seconds of outages that ended
        self.failures = 0  # failed calls in the current outage
        self.last_error: BaseException | None = None

    def failed(self, error: BaseException, started: float) -> None:
        """A call that started at `started` (the clock's time) failed with a transient `error`."""
        with self._lock:
            if self._began is None:
                self._began = started
            self.failures += 1
            self.last_error = error

    def recovered(self) -> None:
        """A call succeeded: the current outage, if any, is over."""
        with self._lock:
            if self._began is not None:
                self._past += self.clock() - self._began
                self._began = None
                self.failures = 0

    @property
    def down(self) -> bool:
        with self._lock:
            return self._began is not None

    def current_s(self) -> float:
        """How long the current outage has lasted (0 when the service answers)."""
        with self._lock:
            return 0.0 if self._began is None else self.clock() - self._began

    def seconds(self) -> float:
        """Seconds spent in outages so far, the current one included."""
        with self._lock:
            return self._past + (0.0 if self._began is None else self.clock() - self._began)

    def past_deadline(self) -> bool:
        return self.current_s() > self.deadline_s

    def error(self, kept: str) -> ServiceOutage:
        """The one line a run stops with: the service, how long, the setting, the last error, what was kept."""
        last = self.last_error
        return ServiceOutage(f"{self.service(last)} unreachable for {self.current_s():.0f} s, past "
                             f"{DEADLINE_SETTING}={self.deadline_s:g} s (last error: "
                             f"{first_line(last) if last else 'none'}); kept: {kept}")


def retry(fn: Callable[[], T], outage: Outage, transient: Callable[[BaseException], bool],
          kept: Callable[[], str] = lambda: "nothing", sleep: Callable[[float], None] = time.sleep) -> T:
    """`fn()`, called again after each transient error until it succeeds; raises `outage.error(kept())`
    once the outage passes its deadline, and any other error at once."""
    while True:
        started = outage.clock()
        try:
            result = fn()
        except Exception as error:
            if not transient(error):
                raise
            outage.failed(error, started)
            if outage.past_deadline():
                raise outage.error(kept()) from error
            sleep(min(backoff_s(outage.failures), max(0.0, outage.deadline_s - outage.current_s()) + 0.01))
            continue
        outage.recovered()
        return result


class GuardedClient:
    """A client of one service (the lake's catalog and object store, the MLflow store) whose calls wait
    out its outages: `_call(fn)` retries `fn` through an outage up to the deadline (`retry`). The
    `ServiceOutage` that ends one is kept in `_gave_up`; the client's later calls and its background
    thread raise it (a run stops with one line, not one per call).

    A subclass sets `outage`, `_lock`, `_gave_up` (None) and `_transient`, and says what it kept (`_kept`)."""

    outage: Outage
    _lock: threading.Condition
    _gave_up: ServiceOutage | None

    @staticmethod
    def _transient(error: BaseException) -> bool:
        raise NotImplementedError

    def _kept(self) -> str:
        return "nothing"

    def _call(self, fn: Callable[[], T]) -> T:
        """`fn()` (a call to the service), retried through an outage up to the deadline."""
        if self._gave_up is not None:
            raise self._gave_up
        try:
            return retry(fn, self.outage, self._transient, kept=self._kept)
        except ServiceOutage as error:
            with self._lock:
                self._gave_up = self._gave_up or error
            raise
