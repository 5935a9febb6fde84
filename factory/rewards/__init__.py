"""Scorers: turn an episode's final answer into a reward."""

from __future__ import annotations

from typing import Any

from factory.types import Task


async def score_answer(answer: str | None, task: Task, sandbox=None) -> tuple[float, dict[str, Any]]:
    """(reward, details) for `answer` to `task`: code tasks run their unit tests in `sandbox` (a
    Sandbox or SandboxPool; the reward is the pass fraction), other tasks use reasoning-gym's verifier."""
    from factory.rewards.code import is_code_task, score_code
    from factory.rewards.verifiers import reasoning_gym_reward

    if is_code_task(task):
        if sandbox is None:
            raise ValueError(f"task {task.task_id} is a code task: its reward needs a sandbox")
        score = await score_code(answer, task, sandbox)
        return score.fraction, {"tests": score.to_dict()}
    return reasoning_gym_reward(answer, task), {}
