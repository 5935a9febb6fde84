"""Advantage estimators: turn a group's scalar rewards into per-completion advantages.

Every estimator takes `rewards` of shape [num_groups, G] (G completions sampled for the same
prompt) and returns float32 advantages of the same shape. The group itself is the baseline,
so no value network is needed.
"""

from __future__ import annotations

from typing import Callable

import torch

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]

ADVANTAGES: dict[str, AdvantageFn] = {}

GRPO_EPS = 1e-6  # keeps the division finite for groups whose rewards barely differ


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: add an estimator to `ADVANTAGES` under `name` (names must be unique)."""

    def register(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGES[name] = fn
        return fn

    return register


def _as_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Check the [num_groups, G] layout and return the rewards as float32."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_groups, G], got {tuple(rewards.shape)}")
    return rewards.to(torch.float32)


@register_advantage("grpo")
def grpo(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO: reward standardised within its group.

    A_i = (r_i - mean(r)) / (std(r) + 1e-6), with the population std (unbiased=False,
    i.e. divide by G): it is the std of the group as sampled, defined for G = 1, and matches
    the common GRPO implementations. Groups whose rewards are all equal get exactly 0.
    """
    rewards = _as_groups(rewards)
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    advantages = (rewards - mean) / (std + GRPO_EPS)
    # the float mean of equal values can be off by one ulp, which 1/eps would blow up to ~1e-3
    constant_group = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant_group, torch.zeros_like(advantages), advantages)


@register_advantage("dr_grpo")
def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: reward minus its group mean, no std normalisation.

    A_i = r_i - mean(r). Dropping the 1/std removes GRPO's bias towards groups that are
    almost all right or almost all wrong.
    """
    rewards = _as_groups(rewards)
    return rewards - rewards.mean(dim=1, keepdim=True)


@register_advantage("rloo")
def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: reward minus the mean of the other G - 1 rewards of its group.

    A_i = r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) * (r_i - mean(r)).
    The baseline excludes r_i, so it is independent of completion i and the estimate is
    unbiased. With G = 1 there are no other completions and the advantage is 0.
    """
    rewards = _as_groups(rewards)
    group_size = rewards.shape[1]
    if group_size < 2:
        return torch.zeros_like(rewards)
    leave_one_out_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)
    return rewards - leave_one_out_mean
