"""Scorers: turn an episode's final answer into a reward."""

from __future__ import annotations

from typing import Any

from factory.types import Task


def verifier_spec(task: Task) -> dict[str, Any]:
    """The verifier a task is scored by: its own (`metadata["verifier"]`, from a file source), else a code
    task's unit tests, else its reasoning-gym family's scorer."""
    from factory.rewards.code import is_code_task

    if task.metadata.get("verifier"):
        return task.metadata["verifier"]
    if is_code_task(task):
        return {"name": "code"}
    return {"name": "reasoning_gym", "config": {"family": task.family}}


async def score_answer(answer: str | None, task: Task, sandbox=None) -> tuple[float, dict[str, Any]]:
    """(reward, details) for `answer` to `task` under its verifier (`verifier_spec`); code runs its unit
    tests in `sandbox` (a Sandbox or SandboxPool; the reward is the pass fraction)."""
    from factory.rewards.verifiers import score_with

    return await score_with(verifier_spec(task), answer, task, sandbox)
