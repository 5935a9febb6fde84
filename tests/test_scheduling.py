"""Long-tail scheduling: duration prediction, longest-first hand-out, over-provisioned admission."""

from __future__ import annotations

import itertools

import pytest

from factory.core.buffer import StalenessBuffer
from factory.core.scheduling import DurationPredictor, LongestFirst
from factory.core.types import Task


def task(i: int, family: str = "f") -> Task:
    return Task(f"t{i}", family, "q", "a")


def test_predictor_falls_back_from_task_to_family_to_run():
    p = DurationPredictor(alpha=0.5)
    assert p.predict(task(1)) is None
    p.observe(task(1), 4.0)
    p.observe(task(1), 2.0)  # EMA: 0.5 * 4 + 0.5 * 2
    assert p.predict(task(1)) == 3.0
    assert p.predict(task(2)) == 3.0  # same family
    assert p.predict(task(3, "other")) == 3.0  # the run's overall average
    p.observe(task(4, "other"), 10.0)
    assert p.predict(task(5, "other")) == 10.0
    with pytest.raises(ValueError, match="alpha"):
        DurationPredictor(alpha=0)


def test_longest_first_is_fifo_without_history_and_longest_first_with_it():
    counter = itertools.count()
    fifo = LongestFirst(lambda: task(next(counter)), DurationPredictor(), lookahead=4)
    assert [fifo.next().task_id for _ in range(4)] == ["t0", "t1", "t2", "t3"]

    p = DurationPredictor()
    for i, s in [(0, 1.0), (1, 9.0), (2, 5.0), (3, 1.0)]:
        p.observe(task(i, f"fam{i}"), s)
    filler = (task(i, "fam3") for i in itertools.count(10))  # predicted 1.0: ties keep draw order
    drawn = itertools.chain([task(0, "fam0"), task(1, "fam1"), task(2, "fam2"), task(3, "fam3")], filler)
    lf = LongestFirst(lambda: next(drawn), p, lookahead=4)
    assert [lf.next().task_id for _ in range(4)] == ["t1", "t2", "t0", "t3"]


def test_longest_first_does_not_starve_a_short_task():
    p = DurationPredictor()
    p.observe(task(0, "short"), 0.1)
    p.observe(task(1, "long"), 10.0)
    counter = itertools.count(1)
    draws = iter([task(0, "short")] + [task(next(counter), "long") for _ in range(50)])
    lf = LongestFirst(lambda: next(draws), p, lookahead=3, max_wait=4)
    handed = [lf.next().task_id for _ in range(6)]
    assert "t0" in handed[:5] and handed.count("t0") == 1


def test_overprovision_admits_extra_groups_beyond_the_staleness_budget():
    plain = StalenessBuffer(groups_per_step=4, max_staleness=0, max_inflight=64)
    extra = StalenessBuffer(groups_per_step=4, max_staleness=0, max_inflight=64, overprovision=3)
    assert plain.capacity() == 4 and extra.capacity() == 7
    with pytest.raises(ValueError, match="overprovision"):
        StalenessBuffer(4, 0, 64, overprovision=-1)
