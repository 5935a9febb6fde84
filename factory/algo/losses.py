"""Policy losses and the ways of reducing per-token losses to one scalar.

Tensors are [B, T]: B completions, T token positions. `mask` is 1.0 on tokens that count
(tokens the policy sampled) and 0.0 elsewhere; it is read as a boolean, so masked positions
have no influence on either the loss or its gradient even if their values are inf or NaN.

Off-policy training involves three policies: the behaviour policy pi_b that sampled a token
(its logprob recorded by the engine), the proximal policy pi_prox the loss's ratio is centred
on (`old_logp`; pi_b unless the recipe says otherwise) and the current policy pi_theta (`logp`).
A `LossContext` carries what a loss needs beyond that: pi_b, per-token versions, and the per-token
weights that corrections (factory.algo.corrections) multiply into the loss before aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

from factory.core import registries
from factory.core.registry import Registry
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
    behaviour_weight_cap: float = 5.0  # decoupled_ppo: tokens with pi_prox / pi_b above it are dropped


@dataclass
class LossContext:
    """Per-batch inputs of off-policy losses and corrections; every field is optional.

    behaviour_logp: [B, T] logprob of each token under the policy that sampled it (the engine's).
    proximal_logp: [B, T] exact proximal logprobs when the caller has them; None lets the
        objective choose (behaviour, current or the log-linear estimate from versions).
    versions: [B, T] integer policy version that sampled each token, NOT_SAMPLED (-1) elsewhere.
    trainer_version: the version of the policy being trained (pi_theta before this step).
    truncated: [B] bool, True for completions cut at the length limit.
    weights: [B, T] non-negative stop-grad weights multiplied into the per-token loss before
        aggregation (the product of the corrections); None means 1 everywhere.
    """

    behaviour_logp: torch.Tensor | None = None
    proximal_logp: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    trainer_version: int | None = None
    truncated: torch.Tensor | None = None
    weights: torch.Tensor | None = None


# ---------------------------------------------------------------- aggregation

AggregationFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]

AGGREGATIONS: Registry[AggregationFn] = registries.AGGREGATIONS

# What each aggregation divides by, as a function of the mask: an aggregation is (a sum of per-sample
# terms) / denominator, so a batch split into micro-batches (or across trainer ranks) is reassembled
# exactly as sum_m agg_m * den_m / sum_m den_m (`factory.training.trainer`). A new aggregation registers one.
AGGREGATION_DENOMINATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}


def _register_aggregation(name: str, denominator: Callable[[torch.Tensor], torch.Tensor]
                          ) -> Callable[[AggregationFn], AggregationFn]:
    def register(fn: AggregationFn) -> AggregationFn:
        AGGREGATION_DENOMINATORS[name] = denominator
        return AGGREGATIONS.register(name, fn)

    return register


def aggregation_denominator(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The count `aggregate(x, mask, mode)` divides by (before its clamp at 1), as a float scalar:
    counted tokens (token_mean), sequences with a counted token (seq_mean_token_mean), or rows
    (seq_mean_token_sum)."""
    if mode not in AGGREGATION_DENOMINATORS:
        raise ValueError(f"aggregation {mode!r} has no registered denominator; micro-batches need one")
    return AGGREGATION_DENOMINATORS[mode](mask).to(torch.float64)


def _masked(per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return per_token zeroed where mask is 0 (where, not *, so inf/NaN vanish) and the bool mask."""
    if per_token.shape != mask.shape:
        raise ValueError(f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} differ in shape")
    keep = mask > 0
    return torch.where(keep, per_token, torch.zeros_like(per_token)), keep


@_register_aggregation("token_mean", lambda mask: (mask > 0).sum())
def token_mean(per_token: torch.Tensor, mask: torch.Tensor, max_tokens: int = 0) -> torch.Tensor:
    """Mean over every counted token of the batch: sum_{b,t} m*x / sum_{b,t} m.

    Each token weighs the same, so long sequences weigh more than short ones (DAPO).
    """
    values, keep = _masked(per_token, mask)
    return values.sum() / keep.sum().clamp_min(1)


@_register_aggregation("seq_mean_token_mean", lambda mask: ((mask > 0).sum(dim=1) > 0).sum())
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


@_register_aggregation("seq_mean_token_sum", lambda mask: torch.tensor(mask.shape[0]))
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

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

POLICY_LOSSES: Registry[PolicyLossFn] = registries.POLICY_LOSSES


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: add a policy loss to `POLICY_LOSSES` under `name` (names must be unique).

    A policy loss is fn(logp, old_logp, advantages, mask, cfg, ctx=None) -> (scalar loss to
    minimise, metrics as python floats); advantages are [B] (one per sequence) or [B, T];
    `old_logp` is the proximal policy's logprob (the behaviour policy's unless the recipe centres
    the ratio elsewhere); `ctx` is an optional LossContext whose `weights` the loss multiplies into
    its per-token values before aggregating (use `_finish`).
    """

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        return POLICY_LOSSES.register(name, fn)

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


def _finish(per_token: torch.Tensor, mask: torch.Tensor, cfg: LossConfig, ctx: LossContext | None) -> torch.Tensor:
    """Multiply in the corrections' weights (if any) and aggregate with cfg.aggregation."""
    if ctx is not None and ctx.weights is not None:
        keep = mask > 0
        # weights are targets like advantages; 1 at padding so a junk weight cannot reach the gradient
        weights = torch.where(keep, ctx.weights.detach().to(per_token.dtype), torch.ones_like(per_token))
        per_token = per_token * weights
    return aggregate(per_token, mask, cfg.aggregation, cfg.max_tokens)


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """logp - old_logp on kept tokens, 0 elsewhere (so inf/NaN at padding stay out of exp and grads)."""
    return torch.where(keep, logp - old_logp, torch.zeros_like(logp))


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, keep: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) and where clipping binds."""
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped) & keep


def _ratio_metrics(ratio: torch.Tensor, clip_active: torch.Tensor, keep: torch.Tensor,
                   logp: torch.Tensor, old_logp: torch.Tensor) -> dict[str, float]:
    """clip_fraction, ratio_mean, ratio_max and approx_kl (k3 estimate of KL(pi_old || pi)) over kept tokens."""
    with torch.no_grad():
        on_tokens = ratio[keep]
        return {
            "clip_fraction": (clip_active.sum() / keep.sum().clamp_min(1)).item(),
            "ratio_mean": _masked_mean(ratio, keep),
            "ratio_max": on_tokens.max().item() if on_tokens.numel() else 0.0,
            # pi_old sampled the tokens, so the estimated KL is KL(pi_old || pi): k3 with roles swapped
            "approx_kl": _masked_mean(kl_penalty(old_logp, logp, "k3"), keep),
        }


@register_policy_loss("ppo_clip")
def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ctx: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with separate lower and upper clip (DAPO clip-higher).

    ratio = exp(logp - old_logp)
    loss_t = -w_t * min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), aggregated with
    cfg.aggregation; w_t are the corrections' weights (ctx.weights, 1 without). Where the clipped
    term is the smaller one the gradient is 0.

    Metrics over counted tokens: clip_fraction (share where the clipped term is strictly
    smaller, i.e. clipping changed the objective), ratio_mean, ratio_max, and approx_kl, the
    mean k3 estimate of KL(pi_old || pi) = ratio - 1 - log(ratio) (>= 0, unbiased on
    tokens sampled by pi_old).
    """
    keep = mask > 0
    ratio = torch.exp(_log_ratio(logp, old_logp, keep))
    adv = _per_token_advantages(advantages, logp, keep)
    per_token, clip_active = _clipped_surrogate(ratio, adv, keep, cfg)
    loss = _finish(per_token, mask, cfg, ctx)
    return loss, _ratio_metrics(ratio, clip_active, keep, logp, old_logp)


@register_policy_loss("reinforce")
def reinforce(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ctx: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Vanilla policy gradient: loss_t = -w_t * A * logp, aggregated with cfg.aggregation.

    No ratio and no clipping; `old_logp` is unused except for the approx_kl metric (mean k3
    estimate of KL(pi_old || pi), as in ppo_clip). w_t: the corrections' weights (1 without).
    """
    keep = mask > 0
    adv = _per_token_advantages(advantages, logp, keep)
    # where, not *, so a -inf logp at padding cannot turn into NaN
    per_token = torch.where(keep, -adv * logp, torch.zeros_like(logp))
    loss = _finish(per_token, mask, cfg, ctx)
    with torch.no_grad():
        metrics = {"approx_kl": _masked_mean(kl_penalty(old_logp, logp, "k3"), keep)}
    return loss, metrics


@register_policy_loss("decoupled_ppo")
def decoupled_ppo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ctx: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """AReaL's decoupled PPO: the trust region is centred on the proximal policy, and the
    behaviour policy that sampled the token enters only through a stop-grad importance weight.

    With old_logp = log pi_prox and ctx.behaviour_logp = log pi_b:
        r_t = pi_theta / pi_prox                      (the clipped ratio, as in ppo_clip)
        u_t = pi_prox / pi_b                          (stop-grad behaviour weight)
        loss_t = -u_t * min(r_t * A, clip(r_t, 1 - clip_low, 1 + clip_high) * A)   if u_t <= cap
        token dropped (left out of the loss and its normaliser)                   if u_t > cap
    with cap = cfg.behaviour_weight_cap. Without a behaviour logprob u_t = 1 and this is ppo_clip.
    The proximal logprobs come from the objective: exact when given, else the log-linear estimate
    from per-token versions (factory.algo.corrections.loglinear_proximal).

    Metrics: ppo_clip's (against pi_prox) plus behaviour_weight_mean and behaviour_dropped_fraction.
    """
    keep = mask > 0
    behaviour = ctx.behaviour_logp if ctx is not None and ctx.behaviour_logp is not None else old_logp
    with torch.no_grad():
        behaviour_weight = torch.exp(_log_ratio(old_logp, behaviour, keep))
        within_cap = behaviour_weight <= cfg.behaviour_weight_cap
    kept = keep & within_cap
    ratio = torch.exp(_log_ratio(logp, old_logp, kept))
    adv = _per_token_advantages(advantages, logp, kept)
    per_token, clip_active = _clipped_surrogate(ratio, adv, kept, cfg)
    per_token = per_token * torch.where(kept, behaviour_weight, torch.zeros_like(behaviour_weight))
    loss = _finish(per_token, kept.to(mask.dtype), cfg, ctx)
    metrics = _ratio_metrics(ratio, clip_active, kept, logp, old_logp)
    metrics["behaviour_weight_mean"] = _masked_mean(behaviour_weight, kept)
    metrics["behaviour_dropped_fraction"] = ((keep & ~within_cap).sum() / keep.sum().clamp_min(1)).item()
    return loss, metrics


@register_policy_loss("cispo")
def cispo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ctx: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1): clip the importance weight, not the update, and never drop a token.

    ratio = exp(logp - old_logp),  c_t = sg(clip(ratio, 1 - clip_low, 1 + clip_high))
    loss_t = -w_t * c_t * A * logp, aggregated with cfg.aggregation (sg = stop-gradient).
    Unlike ppo_clip, a token whose ratio left the bounds still gets gradient c_t * A * dlogp.

    Metrics: clip_fraction (share of tokens whose ratio is outside the bounds), ratio_mean,
    ratio_max, approx_kl, is_weight_mean (mean c_t).
    """
    keep = mask > 0
    ratio = torch.exp(_log_ratio(logp, old_logp, keep))
    adv = _per_token_advantages(advantages, logp, keep)
    with torch.no_grad():
        weight = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_token = torch.where(keep, -weight * adv * logp, torch.zeros_like(logp))
    loss = _finish(per_token, mask, cfg, ctx)
    metrics = _ratio_metrics(ratio, (weight != ratio) & keep, keep, logp, old_logp)
    metrics["is_weight_mean"] = _masked_mean(weight, keep)
    return loss, metrics


@register_policy_loss("gspo")
def gspo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ctx: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Qwen3): one importance ratio per sequence, the geometric mean of its token ratios.

    s_i = exp((1 / |o_i|) * sum_t (logp_t - old_logp_t))           over the counted tokens of i
    loss_i = -min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i)
    Implemented per token as s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)) (value s_i, gradient
    s_i * dlogp_t), so with seq_mean_token_mean the loss is mean_i loss_i and its gradient is
    exactly GSPO's; other aggregations weigh sequences by length. GSPO's clip ranges are tiny
    (e.g. 3e-4 / 4e-4): set clip_low / clip_high accordingly. Per-token advantages use A_i,t.

    Metrics: clip_fraction (share of sequences whose clipped term binds), seq_ratio_mean,
    seq_ratio_max, approx_kl.
    """
    keep = mask > 0
    log_ratio = _log_ratio(logp, old_logp, keep)
    tokens = keep.sum(dim=1)
    seq_log_ratio = log_ratio.sum(dim=1) / tokens.clamp_min(1)
    token_logp = torch.where(keep, logp, torch.zeros_like(logp))
    ratio = torch.exp(seq_log_ratio.detach()[:, None] + token_logp - token_logp.detach())
    adv = _per_token_advantages(advantages, logp, keep)
    per_token, clip_active = _clipped_surrogate(ratio, adv, keep, cfg)
    loss = _finish(per_token, mask, cfg, ctx)
    with torch.no_grad():
        has_tokens = tokens > 0
        seq_ratio = seq_log_ratio.exp()[has_tokens]
        seq_clipped = clip_active.any(dim=1)[has_tokens]
        metrics = {
            "clip_fraction": seq_clipped.float().mean().item() if seq_ratio.numel() else 0.0,
            "seq_ratio_mean": seq_ratio.mean().item() if seq_ratio.numel() else 0.0,
            "seq_ratio_max": seq_ratio.max().item() if seq_ratio.numel() else 0.0,
            "approx_kl": _masked_mean(kl_penalty(old_logp, logp, "k3"), keep),
        }
    return loss, metrics
