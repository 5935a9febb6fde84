"""Advantage estimators: turn a group's scalar rewards into per-completion advantages.

Every estimator takes `rewards` of shape [num_groups, G] (G completions sampled for the same
prompt) and returns float32 advantages of the same shape. The group itself is the baseline,
so no value network is needed. A "batch"-scope estimator (REINFORCE++) ignores the groups and
normalises over every reward of the step; `batch_advantages` applies either kind to groups of
unequal size. `overlong_penalty` is DAPO's reward shaping, applied to rewards before any estimator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from factory.core import registries
from factory.core.registry import Registry
from factory.core.types import Sample

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]

ADVANTAGES: Registry[AdvantageFn] = registries.ADVANTAGES
BATCH_SCOPE: set[str] = set()  # estimators that normalise over the whole batch, not per group

GRPO_EPS = 1e-6  # keeps the division finite for groups whose rewards barely differ


def register_advantage(name: str, scope: str = "group") -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: add an estimator to `ADVANTAGES` under `name` (names must be unique).

    scope "group": the estimator's baseline is per row (group); "batch": it treats all rewards of
    the step as one population, so `batch_advantages` hands it every reward as a single row.
    """
    if scope not in ("group", "batch"):
        raise ValueError(f"advantage scope must be 'group' or 'batch', got {scope!r}")

    def register(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGES.register(name, fn)
        if scope == "batch":
            BATCH_SCOPE.add(name)
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


@register_advantage("reinforce_pp", scope="batch")
def reinforce_pp(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE++: reward minus the batch mean, normalised by the batch std.

    A_i = (r_i - mean_batch(r)) / (std_batch(r) + 1e-6), population std over every reward of the
    step (all rows together): no per-prompt baseline, so a prompt whose G completions all fail
    still gets negative advantages when the batch does better on average. All-equal batch: 0.
    """
    rewards = _as_groups(rewards)
    mean = rewards.mean()
    std = rewards.std(unbiased=False)
    if bool((rewards == rewards.flatten()[0]).all()):
        return torch.zeros_like(rewards)
    return (rewards - mean) / (std + GRPO_EPS)


def batch_advantages(name: str, rewards: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
    """[N] advantages for N rewards laid out as consecutive groups of `group_sizes` (may differ).

    A group-scope estimator runs once per group; a batch-scope one once on all N rewards.
    """
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ADVANTAGES)}")
    if sum(group_sizes) != rewards.numel():
        raise ValueError(f"group sizes {group_sizes} do not add up to {rewards.numel()} rewards")
    estimator = ADVANTAGES[name]
    rewards = rewards.reshape(-1).to(torch.float32)
    if name in BATCH_SCOPE:
        return estimator(rewards[None, :])[0]
    return torch.cat([estimator(part[None, :])[0] for part in rewards.split(group_sizes)])


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, a reward term for completions of `lengths` tokens.

    With L_max = max_len and L_cache = buffer_len:
        R(L) = 0                                   if L <= L_max - L_cache
        R(L) = factor * ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
        R(L) = -factor                             if L > L_max
    so the penalty grows linearly from 0 to -factor over the last L_cache tokens before the limit.
    buffer_len = 0 disables it (all zeros).
    """
    if buffer_len < 0 or buffer_len > max_len:
        raise ValueError(f"overlong buffer must be in [0, max_len={max_len}], got {buffer_len}")
    lengths = lengths.to(torch.float32)
    if buffer_len == 0:
        return torch.zeros_like(lengths)
    start = max_len - buffer_len
    ramp = (start - lengths) / buffer_len
    return factor * ramp.clamp(min=-1.0, max=0.0)


def distillation_advantages(adv: torch.Tensor, samples: list[Sample], old_logp: torch.Tensor, mask: torch.Tensor,
                            coef: float) -> torch.Tensor:
    """[B] task advantages -> [B, T]: A_t = A_task + coef * (teacher_logp_t - behaviour_logp_t) on
    sampled tokens (0 elsewhere). Samples without teacher scores keep their task advantage."""
    teacher = torch.zeros_like(old_logp)
    scored = torch.zeros(old_logp.shape[0], 1, device=old_logp.device)
    for i, s in enumerate(samples):
        if s.teacher_logprobs:
            teacher[i, : len(s.teacher_logprobs)] = torch.tensor(s.teacher_logprobs, dtype=old_logp.dtype)
            scored[i] = 1.0
    gap = torch.where(mask > 0, teacher - old_logp, torch.zeros_like(old_logp)) * scored
    return adv[:, None].expand_as(old_logp) + coef * gap
