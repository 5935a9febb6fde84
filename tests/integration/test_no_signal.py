"""A task set the policy never solves, with the zero-variance filter on: every group is dropped, no batch
comes, and the run says so, then stops at `deadlines.no_signal_s`, instead of running silently."""

from __future__ import annotations

import re
import time

import pytest

from factory.support.failures import RunFailure
from factory.run import run

from .conftest import FILTER_ON, small_recipe

# sums of two 6-digit numbers: the suite's policy, warm-started on 2-digit sums, never writes one (reward 0)
UNSOLVABLE = ["data.families[0].config.min_digits=6", "data.families[0].config.max_digits=6"]


def test_a_run_without_reward_spread_warns_then_stops_at_no_signal_s(engine, policy, tmp_path):
    recipe = small_recipe(FILTER_ON, *UNSOLVABLE, f"model.path={policy}", "eval.before=false", "eval.after=false",
                          "deadlines.no_signal_warn_s=3", "deadlines.no_signal_s=10")
    phases: list[tuple[float, str]] = []
    with pytest.raises(RunFailure) as caught:
        run(recipe, tmp_path, engines=[engine], on_phase=lambda line: phases.append((time.perf_counter(), line)))
    stopped = time.perf_counter()
    message = str(caught.value)
    found = re.fullmatch(r"no reward spread for (\d+) s: (\d+) groups \((\d+) samples\) finished since the last one, "
                         r"mean reward 0\.000, and algorithm\.filter_zero_variance dropped them all; the policy may "
                         r"never solve these tasks \(see deadlines\.no_signal_s\); the run stops at "
                         r"deadlines\.no_signal_s=10", message)
    assert found, message
    seconds, groups, samples = map(int, found.groups())
    assert seconds >= 10 and groups > 0 and samples == groups * recipe.rollout.group_size
    texts = [line for _, line in phases]
    assert texts[0] == f"base policy (model.path: {policy})"
    started = next(t for t, line in phases if line == "training")
    warnings = [line for line in texts if line.startswith("no reward spread for ")]
    assert warnings and "dropped them all" in warnings[0] and "deadlines.no_signal_s=" not in warnings[0]
    assert stopped - started < 30  # the clock counts from training's start: ~10 s, plus the poll and the teardown
    assert not (tmp_path / "results.json").exists()
