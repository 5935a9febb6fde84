"""The policy objective of one step: version-spread gate -> proximal policy -> corrections -> loss.

The trainer hands this function the current logprobs, the advantages, the mask and a LossContext
(behaviour logprobs, per-token versions, truncation flags) and gets back the scalar loss; it
never needs to know which loss or correction the recipe chose.

    1. version-spread gate: per-token staleness s_t = V - v_t (V = the trainer's version). Tokens
       with s_t > max_token_staleness (or every token of a sample holding one, level "sample")
       are, by `spread_action`: kept ("none", reported only), dropped ("drop"), or IS-corrected
       ("correct": the ratio of those tokens is centred on the current policy, pi_prox := sg(pi_theta),
       and they are weighted by the truncated importance weight min(pi_theta / pi_b, spread_is_cap),
       so a far-stale token keeps a bounded share of its signal instead of being clipped away).
    2. proximal policy: exact when the context holds it, else "behaviour", "current" or "loglinear".
    3. corrections, in recipe order: per-token weights multiplied together; zeros drop tokens.
    4. the policy loss, called with old_logp = the proximal logprobs and the weights in the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from factory.algo.corrections import (
    CorrectionConfig,
    apply_corrections,
    proximal_logp,
    stale_tokens,
    version_spread_metrics,
)
from factory.algo.losses import POLICY_LOSSES, LossConfig, LossContext

SPREAD_ACTIONS = ("none", "drop", "correct")


@dataclass
class ObjectiveConfig:
    """Everything the objective reads from the recipe's `algorithm` section."""

    loss: str = "ppo_clip"
    loss_cfg: LossConfig = field(default_factory=LossConfig)
    proximal: str = "behaviour"
    corrections: list[tuple[str, CorrectionConfig]] = field(default_factory=list)
    max_token_staleness: int | None = None
    spread_action: str = "none"
    spread_level: str = "token"
    spread_is_cap: float = 2.0


def _share(part: torch.Tensor, whole: torch.Tensor) -> float:
    return (part.sum() / whole.sum().clamp_min(1)).item()


def policy_objective(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ctx: LossContext,
    cfg: ObjectiveConfig,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """(loss to minimise, metrics under their final names, the mask of tokens that stayed in).

    Metrics: "train/<loss metric>", "train/<correction>/<metric>", "train/dropped_token_fraction"
    (share of counted tokens left out by the gate and the corrections together), and with versions
    "staleness/token_mean|token_max|version_spread|sample_spread_max|mixed_sample_fraction" plus,
    with max_token_staleness set, "staleness/stale_token_fraction", "staleness/stale_sample_fraction"
    and "staleness/dropped_token_fraction" or "staleness/corrected_token_fraction".
    """
    if cfg.loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {cfg.loss!r}; choose one of {sorted(POLICY_LOSSES)}")
    if cfg.spread_action not in SPREAD_ACTIONS:
        raise ValueError(f"unknown spread action {cfg.spread_action!r}; choose one of {list(SPREAD_ACTIONS)}")
    counted = mask > 0
    metrics: dict[str, float] = {}
    behaviour = ctx.behaviour_logp if ctx.behaviour_logp is not None else logp.detach()
    ctx = replace(ctx, behaviour_logp=behaviour)
    proximal = proximal_logp(cfg.proximal, logp, ctx)
    weights = torch.ones_like(logp) if ctx.weights is None else ctx.weights.detach()

    if ctx.versions is not None and ctx.trainer_version is not None:
        spread = version_spread_metrics(ctx.versions, mask, ctx.trainer_version)
        metrics.update({f"staleness/{k}": v for k, v in spread.items()})
        if cfg.max_token_staleness is not None:
            stale = stale_tokens(ctx.versions, mask, ctx.trainer_version, cfg.max_token_staleness, cfg.spread_level)
            metrics["staleness/stale_token_fraction"] = _share(stale, counted)
            has = counted.any(dim=1)
            metrics["staleness/stale_sample_fraction"] = _share(stale.any(dim=1), has)
            if cfg.spread_action == "drop":
                mask = mask * (~stale).to(mask.dtype)
                metrics["staleness/dropped_token_fraction"] = _share(stale, counted)
            elif cfg.spread_action == "correct":
                current = logp.detach()
                proximal = torch.where(stale, current, proximal)
                log_w = torch.where(stale, current - behaviour, torch.zeros_like(current))
                cap = torch.log(torch.tensor(cfg.spread_is_cap, dtype=log_w.dtype))
                weights = weights * torch.exp(torch.minimum(log_w, cap))
                metrics["staleness/corrected_token_fraction"] = _share(stale, counted)
    elif cfg.max_token_staleness is not None and cfg.spread_action != "none":
        raise ValueError("the version-spread gate needs per-token versions and the trainer version")

    ctx = replace(ctx, proximal_logp=proximal, weights=weights)
    mask, weights, correction_metrics = apply_corrections(cfg.corrections, logp, advantages, mask, ctx)
    metrics.update({f"train/{k}": v for k, v in correction_metrics.items()})
    ctx = replace(ctx, weights=weights)
    loss, loss_metrics = POLICY_LOSSES[cfg.loss](logp, proximal, advantages, mask, cfg.loss_cfg, ctx)
    metrics.update({f"train/{k}": float(v) for k, v in loss_metrics.items()})
    metrics["train/dropped_token_fraction"] = _share(counted & ~(mask > 0), counted)
    return loss, metrics, mask
