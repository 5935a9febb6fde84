"""Per-token estimators of KL(pi || pi_ref) from tokens sampled by pi.

With x = ref_logp - logp = log(pi_ref / pi) at a token sampled from pi:
    k1 = -x                      unbiased, can be negative, high variance
    k2 = 0.5 * x^2               biased, always >= 0, low variance
    k3 = exp(x) - x - 1          unbiased, always >= 0, low variance
(Schulman, "Approximating KL divergence", 2020.) Values at padding positions are whatever the
inputs make them; mask them out with `factory.algo.aggregate`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from factory.core import registries
from factory.core.registry import Registry

KlEstimatorFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KlEstimatorFn] = registries.KL_ESTIMATORS


def register_kl_estimator(name: str) -> Callable[[KlEstimatorFn], KlEstimatorFn]:
    """Decorator: add a per-token KL estimator to `KL_ESTIMATORS` under `name`."""

    def register(fn: KlEstimatorFn) -> KlEstimatorFn:
        return KL_ESTIMATORS.register(name, fn)

    return register


@register_kl_estimator("k1")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp (the plain log-ratio)."""
    return logp - ref_logp


@register_kl_estimator("k2")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (logp - ref_logp)^2."""
    return 0.5 * (logp - ref_logp) ** 2


@register_kl_estimator("k3")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1, which is >= 0 and 0 iff equal."""
    log_ratio = ref_logp - logp
    # expm1 keeps precision near 0; clamping removes the -1e-8 that rounding can still leave
    return (torch.expm1(log_ratio) - log_ratio).clamp_min(0.0)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref), shape of `logp`, using "k1", "k2" or "k3".

    `logp` is the current policy's logprob of each sampled token, `ref_logp` the reference
    policy's logprob of the same token. See the module docstring for the formulas.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ in shape")
    return KL_ESTIMATORS[estimator](logp, ref_logp)
