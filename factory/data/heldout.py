"""Held-out evaluation, the pure part: which tasks an evaluation scores (a seeded sample of a suite),
their digest, and how chunked results merge. The part that drives engines and env workers (Ray
actors) is `factory.runtime.evaluation`.
"""

from __future__ import annotations

import hashlib

from factory.data.tasks import ReasoningGymSource, seeded_subset
from factory.recipe import Recipe

SUITES = ("heldout", "train")


def tasks_digest(tasks) -> str:
    """12 hex digits naming the set of tasks an evaluation scored (equal digests: the same tasks)."""
    return hashlib.sha256("\n".join(sorted(t.task_id for t in tasks)).encode()).hexdigest()[:12]


def suite_tasks(recipe: Recipe, suite: str = "heldout", n: int | None = None,
                source: ReasoningGymSource | None = None):
    """The tasks an evaluation of `n` (default `eval.heldout`) scores: a sample of the suite seeded by
    `eval.seed`, so before and after training, and every run of the recipe, score the same tasks."""
    if suite not in SUITES:
        raise ValueError(f"suite: unknown {suite!r}; choose one of {list(SUITES)}")
    if n is not None and n <= 0:
        raise ValueError(f"n: expected a positive number of tasks, got {n}")
    source = source or ReasoningGymSource.from_recipe(recipe.data)
    tasks = source.heldout if suite == "heldout" else source.train
    return seeded_subset(tasks, n or recipe.eval.heldout, recipe.eval.seed)


def merge_chunks(chunks: dict[int, list]) -> list:
    """Results of chunks keyed by their first task's index, back in task order (chunks finish in any
    order, on any worker)."""
    return [item for start in sorted(chunks) for item in chunks[start]]
