"""Which prompt starts next: scheduling for long-tailed episodes.

With more groups to run than slots to run them in, the order matters: a long episode started
last is the tail every synchronous step waits for. `LongestFirst` keeps a window of upcoming
tasks and starts the one predicted to run longest first (the idea of Seer's context-aware
scheduling); `DurationPredictor` predicts a group's wall time from what the run has seen: the
task's own history, else its family's, else the run's, else nothing (FIFO order).

Over-provisioning (`async.overprovision`, in factory/core/buffer.py) is the other half: a few groups
beyond what the staleness budget needs run alongside, so a step takes the first B to finish.

Pure Python; the buffer actor owns one of each.
"""

from __future__ import annotations

from collections import deque

from factory.core.types import Task


class DurationPredictor:
    """Exponential moving averages of group wall time per task id, per family, and overall."""

    def __init__(self, alpha: float = 0.5):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.by_task: dict[str, float] = {}
        self.by_family: dict[str, float] = {}
        self.overall: float | None = None
        self.observed = 0

    def _ema(self, old: float | None, x: float) -> float:
        return x if old is None else (1 - self.alpha) * old + self.alpha * x

    def observe(self, task: Task, seconds: float) -> None:
        self.by_task[task.task_id] = self._ema(self.by_task.get(task.task_id), seconds)
        self.by_family[task.family] = self._ema(self.by_family.get(task.family), seconds)
        self.overall = self._ema(self.overall, seconds)
        self.observed += 1

    def state_dict(self) -> dict:
        return {"by_task": self.by_task, "by_family": self.by_family, "overall": self.overall, "observed": self.observed}

    def load_state_dict(self, state: dict) -> None:
        self.by_task, self.by_family = dict(state["by_task"]), dict(state["by_family"])
        self.overall, self.observed = state["overall"], state["observed"]

    def predict(self, task: Task) -> float | None:
        """Predicted seconds, or None with no history at all."""
        for table, key in ((self.by_task, task.task_id), (self.by_family, task.family)):
            if key in table:
                return table[key]
        return self.overall


class LongestFirst:
    """Draws up to `lookahead` tasks ahead from `draw` and hands out the one predicted longest.

    Ties (and tasks with no prediction) keep their draw order, so with no history this is FIFO.
    Every drawn task is handed out eventually: a task waits at most until the window has
    cycled past it `max_wait` times, then goes regardless of prediction (no starvation)."""

    def __init__(self, draw, predictor: DurationPredictor, lookahead: int, max_wait: int | None = None):
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self.draw = draw
        self.predictor = predictor
        self.lookahead = lookahead
        self.max_wait = max_wait if max_wait is not None else 2 * lookahead
        self.window: deque[tuple[Task, int]] = deque()  # (task, hand-outs it has waited through)

    def next(self) -> Task:
        while len(self.window) < self.lookahead:
            self.window.append((self.draw(), 0))
        oldest_task, waited = self.window[0]
        if waited >= self.max_wait:
            self.window.popleft()
            return self._age(oldest_task)
        best, best_s = 0, float("-inf")
        for i, (task, _) in enumerate(self.window):
            predicted = self.predictor.predict(task)
            score = float("-inf") if predicted is None else predicted
            if score > best_s:
                best, best_s = i, score
        task, _ = self.window[best]
        del self.window[best]
        return self._age(task)

    def _age(self, handed_out: Task) -> Task:
        self.window = deque((t, w + 1) for t, w in self.window)
        return handed_out

    @property
    def pending(self) -> list[Task]:
        """Drawn but not yet handed out (a checkpoint re-queues them)."""
        return [t for t, _ in self.window]
