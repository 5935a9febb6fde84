"""Off-policy corrections: per-token weights multiplied into any policy loss before aggregation.

A correction looks at a batch (current logprobs, advantages, mask, and the `LossContext`: the
behaviour policy's logprobs, the proximal policy's, per-token versions, truncation flags) and
returns a [B, T] stop-grad weight per token; 0 drops the token from the loss and from the
aggregation's normaliser. A recipe lists any number of them; their weights multiply
(`apply_corrections`). The importance ratio they look at is the proximal/behaviour ratio

    rho_t = pi_prox(t) / pi_b(t)

i.e. the gap the policy loss's own ratio (centred on pi_prox) does not already cover. With the
proximal policy = the behaviour policy rho is 1, which is why the recipe refuses tis and icepop
unless `algorithm.proximal` is `current` (exact: the policy before this step) or `loglinear`.

Levels for ratio-based corrections: "token" uses rho_t; "sequence" the sequence's product
prod_t rho_t = exp(sum_t log rho_t); "geometric" its geometric mean exp(mean_t log rho_t). A
sequence-level weight applies to every token of the sequence.

This module also holds the staleness helpers of the version-spread gate (per-token staleness,
stale masks, spread metrics) and the proximal-policy estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

from factory.core import registries
from factory.core.registry import Registry
from factory.algo.losses import LossContext
from factory.core.types import NOT_SAMPLED


@dataclass
class CorrectionConfig:
    """Knobs of the corrections; each correction reads only the ones named in CORRECTION_PARAMS."""

    level: str = "token"  # token | sequence | geometric
    cap: float = 2.0  # tis: upper bound of the importance weight
    low: float = 0.5  # icepop: smallest kept ratio
    high: float = 2.0  # icepop: largest kept ratio
    delta: float = 0.01  # opsm: largest tolerated per-token KL(pi_b || pi_theta) of a negative sample
    max_staleness: int = 1  # version_reject: oldest kept token is this many versions behind


CorrectionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, LossContext, CorrectionConfig],
    tuple[torch.Tensor, dict[str, float]],
]

CORRECTIONS: Registry[CorrectionFn] = registries.CORRECTIONS
CORRECTION_PARAMS: dict[str, tuple[str, ...]] = registries.CORRECTION_PARAMS  # the config fields each reads
IS_CORRECTIONS: set[str] = registries.IS_CORRECTIONS  # those that look at rho = pi_prox / pi_b

LEVELS = ("token", "sequence", "geometric")


def register_correction(
    name: str, params: tuple[str, ...] = (), uses_ratio: bool = False
) -> Callable[[CorrectionFn], CorrectionFn]:
    """Decorator: add a correction to `CORRECTIONS` under `name` (names must be unique).

    A correction is fn(logp, advantages, mask, ctx, cfg) -> (weights [B, T] >= 0, metrics);
    `params` names the CorrectionConfig fields it reads (the recipe rejects any other);
    `uses_ratio` marks it as weighing rho = pi_prox / pi_b.
    """
    unknown = set(params) - set(CorrectionConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"correction {name!r}: unknown parameters {sorted(unknown)}")

    def register(fn: CorrectionFn) -> CorrectionFn:
        CORRECTIONS.register(name, fn)
        CORRECTION_PARAMS[name] = tuple(params)
        if uses_ratio:
            IS_CORRECTIONS.add(name)
        return fn

    return register


# ---------------------------------------------------------------- helpers


def _behaviour(ctx: LossContext, logp: torch.Tensor) -> torch.Tensor:
    if ctx.behaviour_logp is None:
        raise ValueError("this correction needs the behaviour logprobs (LossContext.behaviour_logp)")
    if ctx.behaviour_logp.shape != logp.shape:
        raise ValueError(f"behaviour_logp {tuple(ctx.behaviour_logp.shape)} and logp {tuple(logp.shape)} differ")
    return ctx.behaviour_logp


def _log_rho(logp: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    """log(pi_prox / pi_b) on counted tokens, 0 elsewhere; the proximal defaults to the behaviour."""
    behaviour = _behaviour(ctx, logp)
    proximal = ctx.proximal_logp if ctx.proximal_logp is not None else behaviour
    keep = mask > 0
    return torch.where(keep, proximal.detach() - behaviour, torch.zeros_like(logp))


def _at_level(log_rho: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[B, T] log-ratio at `level`: per token, or the sequence's sum / mean broadcast over its tokens."""
    if level == "token":
        return log_rho
    keep = mask > 0
    total = torch.where(keep, log_rho, torch.zeros_like(log_rho)).sum(dim=1)
    if level == "sequence":
        per_seq = total
    elif level == "geometric":
        per_seq = total / keep.sum(dim=1).clamp_min(1)
    else:
        raise ValueError(f"unknown correction level {level!r}; choose one of {list(LEVELS)}")
    return per_seq[:, None].expand_as(log_rho)


def _masked_mean(values: torch.Tensor, keep: torch.Tensor) -> float:
    return (torch.where(keep, values, torch.zeros_like(values)).sum() / keep.sum().clamp_min(1)).item()


def _share(flags: torch.Tensor, keep: torch.Tensor) -> float:
    """Share of counted tokens where `flags` holds."""
    return ((flags & keep).sum() / keep.sum().clamp_min(1)).item()


def token_staleness(versions: torch.Tensor, mask: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """[B, T] staleness s_t = V - v_t of each counted token (V = trainer_version), 0 elsewhere.

    Tokens with version NOT_SAMPLED are never counted, whatever the mask says.
    """
    counted = (mask > 0) & (versions != NOT_SAMPLED)
    return torch.where(counted, trainer_version - versions, torch.zeros_like(versions))


def stale_tokens(
    versions: torch.Tensor, mask: torch.Tensor, trainer_version: int, max_staleness: int, level: str = "token"
) -> torch.Tensor:
    """[B, T] bool: counted tokens with V - v_t > max_staleness ("token"), or every counted token
    of a sequence holding at least one such token ("sequence"/"sample")."""
    counted = (mask > 0) & (versions != NOT_SAMPLED)
    stale = counted & (token_staleness(versions, mask, trainer_version) > max_staleness)
    if level == "token":
        return stale
    if level in ("sequence", "sample"):
        return counted & stale.any(dim=1, keepdim=True)
    raise ValueError(f"unknown staleness level {level!r}; choose 'token' or 'sample'")


def version_spread_metrics(versions: torch.Tensor, mask: torch.Tensor, trainer_version: int) -> dict[str, float]:
    """Per-token view of a batch's versions (V = trainer_version, s_t = V - v_t on counted tokens):

    token_mean / token_max: mean and max of s_t; version_spread: newest minus oldest token version
    in the batch; sample_spread_max: the largest newest-minus-oldest within one sample;
    mixed_sample_fraction: share of samples whose tokens come from more than one version.
    """
    counted = (mask > 0) & (versions != NOT_SAMPLED)
    if not counted.any():
        return {"token_mean": 0.0, "token_max": 0.0, "version_spread": 0.0,
                "sample_spread_max": 0.0, "mixed_sample_fraction": 0.0}
    s = token_staleness(versions, mask, trainer_version)
    big = torch.iinfo(versions.dtype).max
    newest = torch.where(counted, versions, torch.full_like(versions, -big)).max(dim=1).values
    oldest = torch.where(counted, versions, torch.full_like(versions, big)).min(dim=1).values
    has = counted.any(dim=1)
    spread = (newest - oldest)[has]
    return {
        "token_mean": (s[counted].double().mean()).item(),
        "token_max": float(s[counted].max()),
        "version_spread": float(newest[has].max() - oldest[has].min()),
        "sample_spread_max": float(spread.max()),
        "mixed_sample_fraction": (spread > 0).double().mean().item(),
    }


# ---------------------------------------------------------------- proximal policy


def loglinear_proximal(
    behaviour_logp: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor, trainer_version: int
) -> torch.Tensor:
    """AReaL's log-linear proximal estimate from per-token versions (no extra forward pass).

    log pi_prox ~= log pi_b + alpha_t * (sg(log pi_theta) - log pi_b),
    alpha_t = (v_prox - v_t) / (V - v_t) clamped to [0, 1], with V = trainer_version (the version
    of pi_theta when the loss is evaluated) and v_prox = V - 1, the policy one step behind.

    Why V - 1: this trainer takes one optimizer step per batch, so the policy before the step
    (AReaL's recomputed proximal) is pi_theta itself, against which the clipped ratio is 1 and
    clipping never acts. One version behind keeps a trust region that binds, and the estimate is
    exact where it matters most: a token sampled at V - 1 gets alpha = 0 and pi_prox = pi_b =
    pi_{V-1}; fresh tokens (v_t = V) also get alpha = 0 (pi_b is then the current policy). Only
    tokens older than one version are interpolated: v_t = V - k gives alpha = (k - 1) / k.
    Tokens with version NOT_SAMPLED keep the behaviour logprob.
    """
    gap = (trainer_version - versions).to(logp.dtype)
    alpha = ((gap - 1.0) / gap.clamp_min(1.0)).clamp(0.0, 1.0)
    alpha = torch.where(versions == NOT_SAMPLED, torch.zeros_like(alpha), alpha)
    current = logp.detach()
    interpolated = behaviour_logp + alpha * (current - behaviour_logp)
    # where, not arithmetic, at alpha 0 so a -inf current logprob cannot leak in as 0 * inf
    return torch.where(alpha > 0, interpolated, behaviour_logp)


PROXIMAL_MODES = ("behaviour", "current", "loglinear")


def proximal_logp(mode: str, logp: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    """The proximal policy's logprobs: ctx.proximal_logp when the caller computed them exactly,
    else by `mode`: "behaviour" (pi_prox = pi_b, plain PPO), "current" (pi_prox = sg(pi_theta),
    the policy before this step, exact here since each batch is one optimizer step), or
    "loglinear" (`loglinear_proximal`, needs versions and the trainer version)."""
    if ctx.proximal_logp is not None:
        return ctx.proximal_logp.detach()
    if mode not in PROXIMAL_MODES:
        raise ValueError(f"unknown proximal mode {mode!r}; choose one of {list(PROXIMAL_MODES)}")
    if mode == "current":
        return logp.detach()
    behaviour = _behaviour(ctx, logp)
    if mode == "behaviour":
        return behaviour
    if ctx.versions is None or ctx.trainer_version is None:
        raise ValueError("proximal 'loglinear' needs per-token versions and the trainer version")
    return loglinear_proximal(behaviour, logp, ctx.versions, ctx.trainer_version)


# ---------------------------------------------------------------- corrections


@register_correction("tis", params=("level", "cap"), uses_ratio=True)
def tis(logp, advantages, mask, ctx: LossContext, cfg: CorrectionConfig):
    """Truncated importance sampling: w = min(rho, cap) at cfg.level (token, sequence, geometric).

    rho = pi_prox / pi_b; computed in log space, w = exp(min(log rho, log cap)), so a long
    sequence's product cannot overflow. Metrics: weight_mean, truncated_fraction (share of
    counted tokens whose weight was capped).
    """
    keep = mask > 0
    log_rho = _at_level(_log_rho(logp, mask, ctx), mask, cfg.level)
    log_cap = torch.log(torch.tensor(cfg.cap, dtype=log_rho.dtype))
    weights = torch.exp(torch.minimum(log_rho, log_cap))
    return weights, {"weight_mean": _masked_mean(weights, keep), "truncated_fraction": _share(log_rho > log_cap, keep)}


@register_correction("icepop", params=("level", "low", "high"), uses_ratio=True)
def icepop(logp, advantages, mask, ctx: LossContext, cfg: CorrectionConfig):
    """IcePop: drop tokens whose ratio rho = pi_prox / pi_b lies outside [low, high].

    w = 1 if low <= rho <= high else 0, with rho at cfg.level (at "sequence" or "geometric" the
    whole sequence is kept or dropped). No reweighting: kept tokens train as if on-policy.
    Metrics: masked_fraction (share of counted tokens dropped).
    """
    keep = mask > 0
    log_rho = _at_level(_log_rho(logp, mask, ctx), mask, cfg.level)
    rho = torch.exp(log_rho)
    inside = (rho >= cfg.low) & (rho <= cfg.high)
    weights = inside.to(logp.dtype)
    return weights, {"masked_fraction": _share(~inside, keep)}


@register_correction("opsm", params=("delta",))
def opsm(logp, advantages, mask, ctx: LossContext, cfg: CorrectionConfig):
    """Off-policy sequence masking (DeepSeek-V3.2): drop a sample with a negative advantage whose
    policy has drifted too far from the one that sampled it.

    KL_i = (1 / |o_i|) * sum_t (log pi_b(t) - sg(log pi_theta(t)))   (k1 estimate of KL(pi_b || pi_theta))
    w_i = 0 if A_i < 0 and KL_i > delta, else 1 (for [B, T] advantages A_i is the mean over tokens).
    Positive samples are always kept: learning from a good old sample is safe, pushing down an old
    bad one that the current policy no longer produces is what destabilises training.
    Metrics: masked_fraction (share of samples dropped), kl_mean (mean KL_i).
    """
    keep = mask > 0
    behaviour = _behaviour(ctx, logp)
    diff = torch.where(keep, behaviour - logp.detach(), torch.zeros_like(logp))
    tokens = keep.sum(dim=1)
    kl = diff.sum(dim=1) / tokens.clamp_min(1)
    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 2:
        adv = torch.where(keep, adv, torch.zeros_like(adv)).sum(dim=1) / tokens.clamp_min(1)
    dropped = (adv < 0) & (kl > cfg.delta)
    weights = (~dropped).to(logp.dtype)[:, None].expand_as(logp)
    has = tokens > 0
    return weights, {
        "masked_fraction": (dropped & has).double().sum().item() / max(int(has.sum()), 1),
        "kl_mean": kl[has].mean().item() if has.any() else 0.0,
    }


@register_correction("version_reject", params=("max_staleness", "level"))
def version_reject(logp, advantages, mask, ctx: LossContext, cfg: CorrectionConfig):
    """Per-sample (or per-token) version rejection: drop what is older than a limit.

    s_t = V - v_t (V = ctx.trainer_version, v_t = ctx.versions). level "sequence": w_i = 0 for a
    sample whose oldest counted token has s_t > max_staleness; level "token": w_t = 0 for each such
    token only. Metrics: dropped_fraction (share of counted tokens dropped).
    """
    if ctx.versions is None or ctx.trainer_version is None:
        raise ValueError("version_reject needs per-token versions and the trainer version")
    if cfg.level == "geometric":
        raise ValueError("version_reject works at level 'token' or 'sequence', not 'geometric'")
    stale = stale_tokens(ctx.versions, mask, ctx.trainer_version, cfg.max_staleness, cfg.level)
    return (~stale).to(logp.dtype), {"dropped_fraction": _share(stale, mask > 0)}


@register_correction("length_mask")
def length_mask(logp, advantages, mask, ctx: LossContext, cfg: CorrectionConfig):
    """DAPO's overlong filtering: completions cut at the length limit leave the loss.

    w_i = 0 if sample i was truncated (ctx.truncated), else 1: a truncated answer's reward says
    little about its tokens, so it neither rewards nor punishes them. Metrics: masked_fraction
    (share of samples dropped).
    """
    if ctx.truncated is None:
        raise ValueError("length_mask needs the truncation flags (LossContext.truncated)")
    truncated = ctx.truncated.to(torch.bool).reshape(-1)
    weights = (~truncated).to(logp.dtype)[:, None].expand_as(logp)
    return weights, {"masked_fraction": truncated.double().mean().item() if truncated.numel() else 0.0}


def apply_corrections(
    corrections: list[tuple[str, CorrectionConfig]],
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ctx: LossContext,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Run the corrections in order; return (mask without dropped tokens, product of weights, metrics).

    Starts from ctx.weights (1 where None). Each correction sees the mask left by the ones before
    it. Metrics are "<name>/<metric>" (a name used twice gets "<name>#2", ...).
    """
    weights = torch.ones_like(logp) if ctx.weights is None else ctx.weights.detach().clone()
    metrics: dict[str, float] = {}
    seen: dict[str, int] = {}
    for name, cfg in corrections:
        if name not in CORRECTIONS:
            raise ValueError(f"unknown correction {name!r}; choose one of {sorted(CORRECTIONS)}")
        w, m = CORRECTIONS[name](logp, advantages, mask, ctx, cfg)
        weights = weights * w.detach()
        mask = mask * (w > 0).to(mask.dtype)
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name}#{seen[name]}"
        metrics.update({f"{label}/{k}": float(v) for k, v in m.items()})
    return mask, weights, metrics
