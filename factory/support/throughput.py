"""Throughput per window of steps, not since the start.

A running mean (samples so far / seconds so far) hides a slowdown: after 300 steps at one rate,
100 steps at half of it move the mean by only an eighth. `WindowedRate` keeps the last W steps'
cumulative counters and reports each counter's rate over them, so a rate that falls shows as it
falls.

Two counters matter in a run: samples *trained* (what the optimizer consumed) and samples
*generated* (every sample an episode finished, including those the buffer then filtered or
rejected). Their ratio is the share of generation that is trained: the dynamic-sampling filter
drops more groups as accuracy rises, so trained samples/s may fall while generation holds.

Pure Python: no Ray, no clock of its own (the caller passes the time).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

WINDOW_STEPS = 20  # a step is ~1 s on the default recipe: rates over the last ~20 s


class WindowedRate:
    """Rates of cumulative counters over the last `window` observations (steps).

    `observe(t, trained=…, generated=…)` records the counters' totals at time `t` (seconds, any
    monotonic clock) and returns {name: (total now − total W observations ago) / (t now − t then)}.
    Before W + 1 observations the window starts at the first one: observe the start of training
    (t0, zeros) first, so step k < W reports the rate since the start. A name seen for the first time
    has no earlier total, so its rate is 0 until the next observation.
    """

    def __init__(self, window: int = WINDOW_STEPS):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._points: deque[tuple[float, dict[str, float]]] = deque(maxlen=window + 1)

    def observe(self, t: float, **totals: float) -> dict[str, float]:
        if self._points and t < self._points[-1][0]:
            raise ValueError(f"time went backwards: {self._points[-1][0]} -> {t}")
        self._points.append((float(t), {k: float(v) for k, v in totals.items()}))
        return self.rates()

    def rates(self) -> dict[str, float]:
        """{name: per-second rate over the window}; empty before two observations."""
        if len(self._points) < 2:
            return {}
        (t0, first), (t1, last) = self._points[0], self._points[-1]
        span = t1 - t0
        return {name: (total - first.get(name, total)) / span if span > 0 else 0.0 for name, total in last.items()}

    @property
    def span_steps(self) -> int:
        """How many steps the current rates cover (≤ window)."""
        return max(0, len(self._points) - 1)


def window_rates(points: list[Mapping[str, float]], first: int, last: int, clock: str,
                 counters: Mapping[str, str]) -> dict[str, float]:
    """Rates over steps `first`…`last` (1-based, inclusive) of per-step records holding cumulative
    counters: {name: (counter at `last` − counter at `first` − 1) / (clock at `last` − clock at `first` − 1)}.

    `points[i]` is step i + 1's record; step 0 (before the first) is taken as zeros, so `first = 1`
    measures from the start of training (its pipeline fill included). `counters`: {name: key}.
    """
    if not 1 <= first <= last <= len(points):
        raise ValueError(f"steps {first}..{last} are not within 1..{len(points)}")
    before = points[first - 2] if first > 1 else {}
    end = points[last - 1]
    seconds = end[clock] - before.get(clock, 0.0)
    return {name: (end[key] - before.get(key, 0.0)) / seconds if seconds > 0 else 0.0
            for name, key in counters.items()}
