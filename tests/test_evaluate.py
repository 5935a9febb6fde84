"""Held-out subsets: a seeded random sample of the split (never its first N), and the standard error."""

from __future__ import annotations

import pytest

from factory.data.tasks import ReasoningGymSource
from factory.data.heldout import suite_tasks
from factory.paths import REPO_ROOT
from factory.recipe import load_recipe
from factory.rollout.episodes import summarize

RECIPES = REPO_ROOT / "recipes"


def small_answer_share(tasks) -> float:
    return sum(int(t.answer) < 20 for t in tasks) / len(tasks)


def test_a_heldout_subset_is_a_seeded_sample_with_the_split_s_difficulty_not_its_prefix():
    """The bias this fixes: within basic_arithmetic the one-digit sums (few, each kept once) come first,
    so the first 200 of 1,000 held-out tasks held 42% answers below 20 against 12% in the split."""
    recipe = load_recipe(RECIPES / "default.yaml", ["eval.heldout=200"])
    source = ReasoningGymSource.from_recipe(recipe.data)
    full = source.heldout
    subset = suite_tasks(recipe, "heldout", source=source)
    assert len(subset) == 200 and len({t.task_id for t in subset}) == 200
    assert {t.task_id for t in subset} <= {t.task_id for t in full}
    assert small_answer_share(full[:200]) - small_answer_share(full) > 0.2  # the prefix really is easier
    assert abs(small_answer_share(subset) - small_answer_share(full)) < 0.06
    # the same tasks in a fresh process-like rebuild, and for the default n (before/after training)
    assert [t.task_id for t in suite_tasks(recipe, "heldout")] == [t.task_id for t in subset]
    assert [t.task_id for t in suite_tasks(recipe, "heldout", n=200, source=source)] == [t.task_id for t in subset]
    # a smaller subset lies inside a larger one; another eval.seed draws another sample
    assert {t.task_id for t in suite_tasks(recipe, "heldout", n=50)} <= {t.task_id for t in subset}
    other = suite_tasks(load_recipe(RECIPES / "default.yaml", ["eval.heldout=200", "eval.seed=1"]), "heldout")
    assert {t.task_id for t in other} != {t.task_id for t in subset}


def test_a_heldout_subset_keeps_the_family_mix():
    recipe = load_recipe(RECIPES / "two_families.yaml", ["data.heldout_size=400", "eval.heldout=100"])
    source = ReasoningGymSource.from_recipe(recipe.data)
    assert {t.family for t in source.heldout[:100]} == {"basic_arithmetic"}  # the split is family by family
    subset = suite_tasks(recipe, "heldout", source=source)
    share = sum(t.family == "chain_sum" for t in subset) / len(subset)
    assert 0.35 < share < 0.65  # 0.5 in the split; a binomial 100-sample stays inside 3 SE


def test_a_subset_as_large_as_the_split_is_the_split_and_n_must_be_positive():
    recipe = load_recipe(RECIPES / "default.yaml", ["data.heldout_size=50", "eval.heldout=80"])
    source = ReasoningGymSource.from_recipe(recipe.data)
    assert suite_tasks(recipe, "heldout", source=source) == source.heldout
    with pytest.raises(ValueError, match="n: expected a positive number"):
        suite_tasks(recipe, "heldout", n=-3, source=source)


def test_standard_error_by_hand():
    """SE = sqrt(s² / n) with the sample variance s² = Σ(r − mean)² / (n − 1)."""
    result = summarize([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"])
    # mean 0.75; s² = (3·0.0625 + 0.5625) / 3 = 0.25; SE = sqrt(0.25 / 4) = 0.25
    assert result.mean == pytest.approx(0.75) and result.stderr == pytest.approx(0.25)
    assert result.by_family == {"a": 0.5, "b": 1.0}


def test_chunks_merge_back_in_task_order_whatever_order_they_finished_in():
    from factory.data.heldout import merge_chunks

    finished = {64: ["c", "c2"], 0: ["a", "a2"], 32: ["b"]}  # keyed by each chunk's first task index
    assert merge_chunks(finished) == ["a", "a2", "b", "c", "c2"]
    assert merge_chunks({}) == []
