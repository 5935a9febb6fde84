"""Failures are loud: the env worker's failure log (tracebacks, then counts) and the gate that fails a
run once failed groups pass the recipe's limits."""

from __future__ import annotations

import logging

import pytest

from factory.failures import EpisodeFailure, FailureGate, FailureLog


def failure(i: int = 0, kind: type[Exception] = ValueError) -> EpisodeFailure:
    try:
        raise kind(f"reward service refused task {i}")
    except Exception as err:  # a real exception with a real traceback
        return EpisodeFailure.of("arith", f"task/{i}", err)


def test_an_episode_failure_keeps_its_traceback_and_a_one_line_error():
    f = failure(7)
    assert f.error == "ValueError: reward service refused task 7"
    assert f.traceback.startswith("Traceback (most recent call last):")
    assert "test_failures.py" in f.traceback and f.traceback.rstrip().endswith(f.error)


def test_the_log_shows_the_first_tracebacks_whole_then_counts_at_powers_of_two(caplog):
    log = FailureLog(logging.getLogger("test.failures"), full=3)
    with caplog.at_level(logging.ERROR, logger="test.failures"):
        for i in range(17):
            log.record(failure(i, KeyError if i % 4 == 3 else ValueError))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 + 3  # failures 1-3 in full; count lines at 4, 8 and 16
    assert all("Traceback (most recent call last)" in m for m in messages[:3])
    assert "task/0" in messages[0] and "failure 1" in messages[0]
    assert not any("Traceback" in m for m in messages[3:])
    assert messages[3].startswith("environment 'arith': 4 groups failed so far (ValueError x3, KeyError x1)")
    assert messages[5].startswith("environment 'arith': 16 groups failed so far (ValueError x12, KeyError x4)")


def test_the_gate_trips_on_failures_in_a_row_and_names_the_environment_and_first_traceback():
    gate = FailureGate(max_in_a_row=3, max_share=1.0, min_groups=1)
    for outcome in (failure(0), None, failure(1), failure(2)):
        gate.record(outcome)
    assert gate.tripped is None  # the success in between reset the run of failures
    gate.record(failure(3))
    assert gate.tripped == "3 in a row (failures.max_in_a_row=3)"
    gate.record(failure(4))  # finished before the run stopped: the message keeps the counts at the trip
    message = gate.message()
    assert message.startswith("environment 'arith': 4 of 5 groups failed, 3 in a row (failures.max_in_a_row=3); "
                              "first error: ValueError: reward service refused task 0 (task task/0)")
    assert "Traceback (most recent call last)" in message and "refused task 1" not in message


def test_the_gate_trips_on_the_share_only_after_min_groups():
    gate = FailureGate(max_in_a_row=100, max_share=0.25, min_groups=8)
    outcomes = [failure(0), None, failure(1), None, None, None, None]  # 2 of 7 failed: too few groups yet
    for outcome in outcomes:
        gate.record(outcome)
    assert gate.tripped is None
    gate.record(None)  # 2 of 8 = 25%: not above the share
    assert gate.tripped is None
    gate.record(failure(2))  # 3 of 9 = 33%
    assert gate.tripped == "33% of 9 finished groups (failures.max_share=0.25 after failures.min_groups=8)"


@pytest.mark.parametrize("bad", ["failures.max_share=1.5", "failures.max_in_a_row=0", "deadlines.batch_s=0"])
def test_failure_limits_and_deadlines_are_checked(bad):
    from factory.paths import REPO_ROOT
    from factory.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=bad.split("=")[0].replace(".", r"\.")):
        load_recipe(REPO_ROOT / "recipes" / "default.yaml", [bad])
