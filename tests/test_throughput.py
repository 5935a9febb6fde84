"""Windowed throughput: rates over the last W steps, not since the start (factory.support.throughput)."""

from __future__ import annotations

import pytest

from factory.core.buffer import StalenessBuffer
from factory.support.throughput import WindowedRate, window_rates
from factory.recording.tracking import THROUGHPUT_METRIC, WINDOWED_THROUGHPUT, throughput_plot
from factory.core.types import Group, Sample, Task

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_rate_covers_only_the_last_window_of_steps():
    w = WindowedRate(window=4)
    w.observe(0.0, trained=0)
    for step in range(1, 11):  # 10 samples/s for 10 s, then 5 samples/s
        w.observe(float(step), trained=10 * step)
    for step in range(11, 15):
        rates = w.observe(float(step), trained=100 + 5 * (step - 10))
    assert rates["trained"] == pytest.approx(5.0)  # the running mean would say 120/14 ≈ 8.6
    assert w.span_steps == 4


def test_before_a_full_window_the_rate_is_since_the_start():
    w = WindowedRate(window=20)
    assert w.observe(0.0, trained=0, generated=0) == {}  # one point: no rate yet
    w.observe(2.0, trained=64, generated=100)
    rates = w.observe(4.0, trained=128, generated=300)
    assert rates == {"trained": pytest.approx(32.0), "generated": pytest.approx(75.0)}
    assert w.span_steps == 2


def test_a_slowdown_shows_in_the_window_at_once():
    """Steps of 1 s, then 2 s: after one window the rate has halved exactly."""
    w = WindowedRate(window=5)
    t = 0.0
    w.observe(t, generated=0)
    total = 0
    for _ in range(50):
        t, total = t + 1.0, total + 64
        w.observe(t, generated=total)
    for _ in range(5):
        t, total = t + 2.0, total + 64
        rates = w.observe(t, generated=total)
    assert rates["generated"] == pytest.approx(32.0)


def test_generated_and_trained_are_separate_rates():
    """Generation that is mostly filtered: generated holds, trained falls."""
    w = WindowedRate(window=2)
    w.observe(0.0, trained=0, generated=0)
    w.observe(1.0, trained=64, generated=128)
    w.observe(2.0, trained=128, generated=256)
    w.observe(3.0, trained=160, generated=384)
    rates = w.observe(4.0, trained=192, generated=512)
    assert rates == {"trained": pytest.approx(32.0), "generated": pytest.approx(128.0)}


def test_bad_arguments():
    with pytest.raises(ValueError):
        WindowedRate(window=0)
    w = WindowedRate()
    w.observe(5.0, trained=1)
    with pytest.raises(ValueError):
        w.observe(4.0, trained=2)
    assert w.observe(5.0, trained=3) == {"trained": 0.0}  # no time passed: no rate, no division by zero


def test_window_rates_over_steps_of_a_metrics_file():
    # step i (1-based): 1 s per step for 3 steps, then 2 s per step; 64 trained and 100 generated per step
    points, t = [], 0.0
    for step in range(1, 7):
        t += 1.0 if step <= 3 else 2.0
        points.append({"t": t, "trained": 64 * step, "gen": 100 * step})
    counters = {"trained": "trained", "generated": "gen"}
    assert window_rates(points, 1, 3, "t", counters) == {"trained": pytest.approx(64.0),
                                                          "generated": pytest.approx(100.0)}
    assert window_rates(points, 4, 6, "t", counters) == {"trained": pytest.approx(32.0),
                                                          "generated": pytest.approx(50.0)}
    with pytest.raises(ValueError):
        window_rates(points, 0, 3, "t", counters)
    with pytest.raises(ValueError):
        window_rates(points, 5, 7, "t", counters)


def _group(gid: str, rewards: list[float]) -> Group:
    samples = [Sample(sample_id=f"{gid}-{i}", group_id=gid, task_id="t", prompt_ids=[1], completion_ids=[2],
                      logprobs=[-0.1], loss_mask=[1], versions=[0], reward=r) for i, r in enumerate(rewards)]
    return Group(group_id=gid, task=Task(task_id="t", family="f", question="q", answer="a"), samples=samples)


def test_buffer_counts_every_finished_sample_as_generated():
    buf = StalenessBuffer(groups_per_step=1, max_staleness=1, max_inflight=4)
    for gid, rewards in (("a", [0.0, 1.0]), ("b", [1.0, 1.0, 1.0]), ("c", [0.0, 1.0, 1.0, 0.0])):
        assert buf.start()
        buf.finish(_group(gid, rewards))
    assert buf.filtered == 1  # "b": zero variance, never trained, still generated
    assert buf.metrics()["buffer/finished_samples"] == 9.0


def test_throughput_plot_draws_both_windowed_rates(tmp_path):
    series = {WINDOWED_THROUGHPUT["generated"]: [(s, 100.0 - s) for s in range(1, 30)],
              WINDOWED_THROUGHPUT["trained"]: [(s, 60.0 - s) for s in range(1, 30)],
              THROUGHPUT_METRIC: [(s, 60.0) for s in range(1, 30)]}
    path = throughput_plot(series, tmp_path / "throughput.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    # an older run's file, with the running mean only, still gets a plot
    assert throughput_plot({THROUGHPUT_METRIC: [(1, 5.0)]}, tmp_path / "old.png").read_bytes()[:8] == PNG_MAGIC
