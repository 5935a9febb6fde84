"""Failures are loud: the env worker's failure log (tracebacks, then counts) and the gate that fails a
run once failed groups pass the recipe's limits."""

from __future__ import annotations

import logging

import pytest

from factory.support.failures import EpisodeFailure, FailureGate, FailureLog


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


# ---- no reward spread ----------------------------------------------------------------------


def since_spread(seconds: float, groups: int = 48, filtered: int | None = None, rejected: int = 0,
                 reward: float = 0.0) -> dict[str, float]:
    """The buffer's `buffer/*_since_spread` metrics, 8 samples a group."""
    return {"buffer/seconds_since_spread": seconds, "buffer/groups_since_spread": groups,
            "buffer/samples_since_spread": 8 * groups, "buffer/reward_since_spread": reward,
            "buffer/filtered_since_spread": groups - rejected if filtered is None else filtered,
            "buffer/rejected_since_spread": rejected}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_no_reward_spread_warns_once_per_interval_then_stops_the_run():
    from factory.support.failures import NoRewardSpread, RunFailure, SpreadWatch

    clock, lines = Clock(), []
    watch = SpreadWatch(60, 900, lines.append, clock)
    assert not watch.due()  # nothing can be 60 s old before 60 s have passed here
    clock.now = 59.5
    assert not watch.due()
    clock.now = 62
    assert watch.due()
    watch.observe(since_spread(62))
    assert lines == ["no reward spread for 62 s: 48 groups (384 samples) finished since the last one, mean reward "
                     "0.000, and algorithm.filter_zero_variance dropped them all; the policy may never solve these "
                     "tasks (see deadlines.no_signal_s)"]
    clock.now = 100
    watch.observe(since_spread(100))  # within 60 s of the last line: quiet
    assert len(lines) == 1 and not watch.due()
    clock.now = 122
    assert watch.due()
    watch.observe(since_spread(122, groups=90))
    assert len(lines) == 2 and "for 122 s: 90 groups (720 samples)" in lines[1]
    clock.now = 901
    with pytest.raises(NoRewardSpread) as stopped:
        watch.observe(since_spread(901))
    assert isinstance(stopped.value, RunFailure)
    assert str(stopped.value).startswith("no reward spread for 901 s: 48 groups (384 samples)")
    assert str(stopped.value).endswith("(see deadlines.no_signal_s); the run stops at deadlines.no_signal_s=900")


def test_the_watch_asks_the_buffer_only_when_a_threshold_may_have_passed():
    from factory.support.failures import SpreadWatch

    clock, lines = Clock(), []
    watch = SpreadWatch(60, 900, lines.append, clock)
    clock.now = 60
    watch.observe(since_spread(20))  # a spread 20 s ago: the next threshold is 40 s away
    clock.now = 99
    assert not watch.due()
    clock.now = 100
    assert watch.due()
    watch.observe(since_spread(60, groups=0))  # no group finished since: no line (deadlines.batch_s covers it)
    assert lines == [] and not watch.due()
    clock.now = 102
    assert watch.due()  # soon again: the threshold has passed, only a finished group is missing
    watch.observe(since_spread(62))
    assert len(lines) == 1 and not watch.due()
    clock.now = 161
    assert not watch.due()  # the next line is allowed 60 s after this one
    clock.now = 162
    assert watch.due()


def test_the_line_says_what_became_of_the_groups_and_why_they_had_no_spread():
    from factory.support.failures import SpreadWatch

    line = SpreadWatch(60, None, print).message
    assert "algorithm.filter_zero_variance dropped 40 of them and 8 were rejected as stale; the policy may" \
        in line(since_spread(61, filtered=40, rejected=8))
    # the filter off: every group is trained, with advantage 0
    assert "mean reward 1.000, and they were trained with advantage 0 (algorithm.filter_zero_variance is off); the " \
        "policy already solves every one of these tasks" in line(since_spread(61, filtered=0, reward=1.0))
    assert "every group's replies scored alike" in line(since_spread(61, filtered=0, reward=0.25))


def test_the_run_watches_only_where_equal_rewards_give_no_gradient():
    from factory.recipe import recipe_from_dict
    from factory.run import _spread_watch

    def watched(*overrides: str) -> bool:
        return _spread_watch(recipe_from_dict({}, overrides=list(overrides)), print) is not None

    assert watched() and watched("algorithm.filter_zero_variance=false")  # dropped, or trained with advantage 0
    assert watched("algorithm.advantage=reinforce_pp")  # the filter drops those groups before any estimator
    for teaches in ("algorithm.advantage=reinforce_pp", "algorithm.distill.teacher=/t", "algorithm.overlong_buffer=8"):
        assert not watched("algorithm.filter_zero_variance=false", teaches)


def test_no_signal_s_zero_or_null_never_stops_the_run():
    from factory.support.failures import SpreadWatch

    for stop in (0, None):
        clock, lines = Clock(), []
        watch = SpreadWatch(60, stop, lines.append, clock)
        clock.now = 10_000
        watch.observe(since_spread(10_000))
        assert len(lines) == 1
