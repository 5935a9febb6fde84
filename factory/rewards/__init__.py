"""Scorers: turn an episode's final answer into a reward."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from factory.core.types import Task


def verifier_spec(task: Task) -> dict[str, Any]:
    """The verifier a task is scored by: its own (`metadata["verifier"]`, from a file source), else a code
    task's unit tests, else its reasoning-gym family's scorer."""
    from factory.rewards.code import is_code_task

    if task.metadata.get("verifier"):
        return task.metadata["verifier"]
    if is_code_task(task):
        return {"name": "code"}
    return {"name": "reasoning_gym", "config": {"family": task.family}}


def verifier_specs(tasks: Iterable[Task]) -> list[dict[str, Any]]:
    """The distinct verifier specs `tasks` are scored by (what an env worker warms up before its first episode)."""
    specs: dict[str, dict[str, Any]] = {}
    for task in tasks:
        spec = verifier_spec(task)
        specs.setdefault(json.dumps(spec, sort_keys=True, default=str), spec)
    return list(specs.values())


async def score_answer(answer: str | None, task: Task, sandbox=None) -> tuple[float, dict[str, Any]]:
    """(reward, details) for `answer` to `task` under its verifier (`verifier_spec`); code runs its unit
    tests in `sandbox` (a Sandbox or SandboxPool; the reward is the pass fraction)."""
    from factory.rewards.verifiers import score_with

    return await score_with(verifier_spec(task), answer, task, sandbox)
