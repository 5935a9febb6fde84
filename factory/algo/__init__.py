"""Algorithms as pure tensor functions: advantage estimators, policy losses, off-policy
corrections, KL penalties, and the per-step objective that chains them.

No Ray, no vLLM: everything here takes and returns torch tensors and is unit-testable on CPU.
"""

from factory.algo.advantages import (
    ADVANTAGES, batch_advantages, distillation_advantages, overlong_penalty, register_advantage,
)
from factory.algo.config import from_section
from factory.algo.corrections import (
    CORRECTION_PARAMS,
    CORRECTIONS,
    IS_CORRECTIONS,
    CorrectionConfig,
    apply_corrections,
    loglinear_proximal,
    register_correction,
)
from factory.algo.kl import KL_ESTIMATORS, kl_penalty
from factory.algo.losses import POLICY_LOSSES, LossConfig, LossContext, aggregate, register_policy_loss
from factory.algo.objective import ObjectiveConfig, policy_objective

__all__ = [
    "ADVANTAGES",
    "distillation_advantages",
    "CORRECTIONS",
    "CORRECTION_PARAMS",
    "IS_CORRECTIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "CorrectionConfig",
    "LossConfig",
    "LossContext",
    "ObjectiveConfig",
    "aggregate",
    "apply_corrections",
    "batch_advantages",
    "from_section",
    "kl_penalty",
    "loglinear_proximal",
    "overlong_penalty",
    "policy_objective",
    "register_advantage",
    "register_correction",
    "register_policy_loss",
]
