"""On-policy distillation: the teacher-minus-student advantage (hand-computed)."""

from __future__ import annotations

import pytest
import torch

from factory.algo import distillation_advantages
from factory.training.scoring import make_scorer
from factory.core.types import Sample


def sample(teacher, mask=(1, 1, 0)):
    return Sample("s", "g", "t", prompt_ids=[0], completion_ids=[1, 2, 3], logprobs=[-1.0, -2.0, 0.0],
                  loss_mask=list(mask), versions=[0, 0, -1], teacher_logprobs=teacher)


def test_per_token_advantage_adds_the_teacher_gap_on_sampled_tokens():
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([0.5, -0.5])
    out = distillation_advantages(adv, [sample([-0.5, -3.0, 0.0]), sample([])], old, mask, coef=2.0)
    # row 0: 0.5 + 2 * (-0.5 - -1) = 1.5 ; 0.5 + 2 * (-3 - -2) = -1.5 ; unsampled token: task advantage only
    assert torch.allclose(out[0], torch.tensor([1.5, -1.5, 0.5]))
    # row 1 has no teacher scores: its task advantage on every token
    assert torch.allclose(out[1], torch.tensor([-0.5, -0.5, -0.5]))


def test_a_missing_teacher_is_a_one_line_error(tmp_path):
    from factory.recipe import load_recipe

    recipe = load_recipe("recipes/default.yaml", [f"algorithm.distill.teacher={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="algorithm.distill.teacher: .* holds no config.json"):
        make_scorer(recipe.algorithm.distill, recipe.rollout)
    assert make_scorer(load_recipe("recipes/default.yaml").algorithm.distill, recipe.rollout) is None
