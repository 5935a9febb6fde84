"""Policy losses and the ways of reducing per-token losses to one scalar.

Tensors are [B, T]: B completions, T token positions. `mask` is 1.0 on tokens that count
(tokens the policy sampled) and 0.0 elsewhere; it is read as a boolean, so masked positions
have no influence on either the loss or its gradient even if their values are inf or NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from factory.algo.kl import kl_penalty


@dataclass
class LossConfig:
    """Knobs shared by the policy losses.

    The PPO ratio is clipped to [1 - clip_low, 1 + clip_high]; a larger clip_high than clip_low
    is DAPO's clip-higher. `max_tokens` is the constant divisor of "seq_mean_token_sum"
    (0 means the padded length T).
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    aggregation: str = "token_mean"
    max_tokens: int = 0


# ---------------------------------------------------------------- aggregation

AggregationFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]

AGGREGATIONS: dict[str, AggregationFn] = {}


def _register_aggregation(name: str) -> Callable[[AggregationFn], AggregationFn]:
    def register(fn: AggregationFn) -> AggregationFn:
        AGGREGATIONS[name] = fn
        return fn

    return register


def _masked(per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return per_token zeroed where mask is 0 (where, not *, so inf/NaN vanish) and the bool mask."""
    if per_token.shape != mask.shape:
        raise ValueError(f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} differ in shape")
    keep = mask > 0
    return torch.where(keep, per_token, torch.zeros_like(per_token)), keep


@_register_aggregation("token_mean")
def token_mean(per_token: torch.Tensor, mask: torch.Tensor, max_tokens: int = 0) -> torch.Tensor:
    """Mean over every counted token of the batch: sum_{b,t} m*x / sum_{b,t} m.

    Each token weighs the same, so long sequences weigh more than short ones (DAPO).
    """
    values, keep = _masked(per_token, mask)
    return values.sum() / keep.sum().clamp_min(1)


@_register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(per_token: torch.Tensor, mask: torch.Tensor, max_tokens: int = 0) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean: mean_b (sum_t m*x / sum_t m).

    Each sequence weighs the same (original GRPO). Sequences with no counted token are left
    out of the outer mean; with none at all the result is 0.
    """
    values, keep = _masked(per_token, mask)
    tokens_per_seq = keep.sum(dim=1)
    seq_means = values.sum(dim=1) / tokens_per_seq.clamp_min(1)
    has_tokens = tokens_per_seq > 0
    return (seq_means * has_tokens).sum() / has_tokens.sum().clamp_min(1)


@_register_aggregation("seq_mean_token_sum")
def seq_mean_token_sum(per_token: torch.Tensor, mask: torch.Tensor, max_tokens: int = 0) -> torch.Tensor:
    """Mean over sequences of each sequence's token sum over a constant: mean_b (sum_t m*x / L).

    L = max_tokens, or T when max_tokens is 0. A constant divisor removes the length bias of
    per-sequence means (Dr. GRPO). Every one of the B sequences counts in the outer mean.
    """
    values, _ = _masked(per_token, mask)
    divisor = max_tokens if max_tokens > 0 else per_token.shape[1]
    seq_sums = values.sum(dim=1) / max(divisor, 1)
    return seq_sums.sum() / max(per_token.shape[0], 1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_tokens: int = 0) -> torch.Tensor:
    """Reduce a [B, T] per-token quantity to a scalar with one of the modes in `AGGREGATIONS`:
    "token_mean", "seq_mean_token_mean" or "seq_mean_token_sum" (see each for its formula)."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; choose one of {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[mode](per_token, mask, max_tokens)


# ---------------------------------------------------------------- policy losses

PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossConfig],
    tuple[torch.Tensor, dict[str, float]],
]

POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: add a policy loss to `POLICY_LOSSES` under `name` (names must be unique).

    A policy loss is fn(logp, old_logp, advantages, mask, cfg) -> (scalar loss to minimise,
    metrics as python floats); advantages are [B] (one per sequence) or [B, T].
    """

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return register


def _per_token_advantages(advantages: torch.Tensor, like: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Return advantages as [B, T], 0 where not kept: a [B] tensor is repeated over tokens."""
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        advantages = advantages.unsqueeze(1)
    elif advantages.shape != like.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(like.shape)}, got {tuple(advantages.shape)}"
        )
    # advantages are targets, never something to differentiate through
    advantages = advantages.detach().to(like.dtype).expand_as(like)
    # a NaN advantage at padding would otherwise leak into the gradient as 0 * NaN
    return torch.where(keep, advantages, torch.zeros_like(advantages))


def _masked_mean(values: torch.Tensor, keep: torch.Tensor) -> float:
    return (torch.where(keep, values, torch.zeros_like(values)).sum() / keep.sum().clamp_min(1)).item()


@register_policy_loss("ppo_clip")
def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with separate lower and upper clip (DAPO clip-higher).

    ratio = exp(logp - old_logp)
    loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), aggregated with
    cfg.aggregation. Where the clipped term is the smaller one the gradient is 0.

    Metrics over counted tokens: clip_fraction (share where the clipped term is strictly
    smaller, i.e. clipping changed the objective), ratio_mean, ratio_max, and approx_kl, the
    mean k3 estimate of KL(pi_old || pi) = ratio - 1 - log(ratio) (>= 0, unbiased on
    tokens sampled by pi_old).
    """
    keep = mask > 0
    # zeroing the log-ratio first keeps inf/NaN at padding out of exp and out of the gradient
    log_ratio = torch.where(keep, logp - old_logp, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    adv = _per_token_advantages(advantages, logp, keep)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, cfg.aggregation, cfg.max_tokens)

    with torch.no_grad():
        clip_active = (clipped < unclipped) & keep
        ratio_on_tokens = ratio[keep]
        metrics = {
            "clip_fraction": (clip_active.sum() / keep.sum().clamp_min(1)).item(),
            "ratio_mean": _masked_mean(ratio, keep),
            "ratio_max": ratio_on_tokens.max().item() if ratio_on_tokens.numel() else 0.0,
            # pi_old sampled the tokens, so the estimated KL is KL(pi_old || pi): k3 with roles swapped
            "approx_kl": _masked_mean(kl_penalty(old_logp, logp, "k3"), keep),
        }
    return loss, metrics


@register_policy_loss("reinforce")
def reinforce(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Vanilla policy gradient: loss_t = -A * logp, aggregated with cfg.aggregation.

    No ratio and no clipping; `old_logp` is unused except for the approx_kl metric (mean k3
    estimate of KL(pi_old || pi), as in ppo_clip).
    """
    keep = mask > 0
    adv = _per_token_advantages(advantages, logp, keep)
    # where, not *, so a -inf logp at padding cannot turn into NaN
    per_token = torch.where(keep, -adv * logp, torch.zeros_like(logp))
    loss = aggregate(per_token, mask, cfg.aggregation, cfg.max_tokens)
    with torch.no_grad():
        metrics = {"approx_kl": _masked_mean(kl_penalty(old_logp, logp, "k3"), keep)}
    return loss, metrics
