"""Algorithms as pure tensor functions: advantage estimators, policy losses, KL penalties.

No Ray, no vLLM: everything here takes and returns torch tensors and is unit-testable on CPU.
"""

from factory.algo.advantages import ADVANTAGES, register_advantage
from factory.algo.kl import KL_ESTIMATORS, kl_penalty
from factory.algo.losses import POLICY_LOSSES, LossConfig, aggregate, register_policy_loss

__all__ = [
    "ADVANTAGES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "LossConfig",
    "aggregate",
    "kl_penalty",
    "register_advantage",
    "register_policy_loss",
]
