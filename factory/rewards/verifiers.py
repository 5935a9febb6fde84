"""reasoning-gym's own verifiers, as a reward in [0, 1]."""

from __future__ import annotations

from functools import cache

from factory.types import Task


@cache
def _score_fn(family: str):
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(family)


def reasoning_gym_reward(answer: str | None, task: Task) -> float:
    """The task family's verifier score of `answer` (surrounding whitespace ignored)."""
    if answer is None:
        return 0.0
    entry = task.metadata.get("rg_entry") or {"answer": task.answer, "metadata": {}}
    return float(_score_fn(task.family)(answer.strip(), entry))
