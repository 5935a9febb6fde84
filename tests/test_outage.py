"""factory.recording.outage: the backoff schedule, outage accounting and the deadline, on a scripted clock."""

from __future__ import annotations

import pytest

from factory.support.failures import ServiceOutage
from factory.recording.outage import Outage, backoff_s, retry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_backoff_grows_exponentially_within_jitter_and_is_capped():
    for attempt, nominal in [(0, 0.05), (1, 0.1), (3, 0.4), (5, 1.6), (6, 2.0), (60, 2.0)]:
        delays = [backoff_s(attempt) for _ in range(200)]
        assert all(0.5 * nominal <= d <= 1.5 * nominal for d in delays)
        assert max(delays) - min(delays) > 0.2 * nominal  # jittered, not one value


def test_an_outage_shorter_than_the_deadline_is_retried_and_its_time_counted():
    clock = Clock()
    outage = Outage(lambda _: "the store", deadline_s=10.0, clock=clock)
    answers = iter([ConnectionError("refused")] * 5 + ["ok"])

    def call() -> str:
        clock.now += 0.5  # each call takes half a second
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert retry(call, outage, lambda e: isinstance(e, ConnectionError), sleep=clock.sleep) == "ok"
    assert not outage.down
    first_started = 100.0
    assert outage.seconds() == pytest.approx(clock.now - first_started)
    clock.now += 50  # time after the outage is not outage
    assert outage.seconds() == pytest.approx(clock.now - 50 - first_started)


def test_past_the_deadline_one_line_names_the_service_the_setting_and_what_was_kept():
    clock = Clock()
    outage = Outage(lambda e: f"the store ({type(e).__name__})", deadline_s=3.0, clock=clock)

    def call() -> None:
        clock.now += 1.0
        raise ConnectionError("connection refused\nsecond line")

    with pytest.raises(ServiceOutage) as failed:
        retry(call, outage, lambda e: True, kept=lambda: "12 rows on disk", sleep=clock.sleep)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith("the store (ConnectionError) unreachable for ")
    assert "deadlines.service_outage_s=3 s" in message and message.endswith("kept: 12 rows on disk")
    assert "ConnectionError: connection refused" in message
    assert outage.current_s() > 3.0


def test_an_error_that_is_not_an_outage_is_raised_at_once():
    outage = Outage(lambda _: "the store", deadline_s=10.0)
    calls = []

    def call() -> None:
        calls.append(1)
        raise ValueError("bad request")

    with pytest.raises(ValueError):
        retry(call, outage, lambda e: isinstance(e, ConnectionError))
    assert calls == [1] and not outage.down
