"""Every extension point's registry, in the core: components register into these, the recipe reads them.

A registry here fills itself on its first read by calling the loader the composition root installs
(`set_loader`, in factory/__init__.py): the loader imports the components that register into it. So
the recipe validates names against these tables without importing a component, and importing this
module (or the recipe) imports no component at all.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from factory.core.registry import Registry

_loader: Callable[[Registry], None] | None = None


def set_loader(loader: Callable[[Registry], None]) -> None:
    """Install the function that fills a registry (imports its components) on the registry's first read."""
    global _loader
    _loader = loader


class LoadedRegistry(Registry):
    """A Registry that calls the installed loader once, before its first read; registering never does."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self._loaded = False
        self._filling = False
        self._lock = threading.RLock()  # another thread's first read waits for the whole load

    def _load(self) -> None:
        if self._loaded or _loader is None:
            return
        with self._lock:
            if self._loaded or self._filling:  # filling: a read from within the load sees what is there so far
                return
            self._filling = True
            try:
                _loader(self)
                self._loaded = True
            finally:
                self._filling = False

    def __getitem__(self, name: str):
        self._load()
        return super().__getitem__(name)

    def check(self, name: str) -> str:
        self._load()
        return super().check(name)

    def names(self) -> list[str]:
        self._load()
        return super().names()

    def __contains__(self, name: object) -> bool:
        self._load()
        return super().__contains__(name)

    def __len__(self) -> int:
        self._load()
        return super().__len__()


ENGINES: Registry = LoadedRegistry("rollout engine")  # factory/rollout/engines.py: EngineKind entries
ENVIRONMENTS: Registry = LoadedRegistry("environment")  # factory/envs/: environment factories
VERIFIERS: Registry = LoadedRegistry("verifier")  # factory/rewards/verifiers.py: Verifier entries
EXTRACTORS: Registry = LoadedRegistry("answer extractor")  # factory/rewards/extract.py
SCORERS: Registry = LoadedRegistry("scorer")  # factory/training/scoring.py: Scorer classes
POLICY_LOSSES: Registry = LoadedRegistry("policy loss")  # factory/algo/losses.py
AGGREGATIONS: Registry = LoadedRegistry("aggregation")  # factory/algo/losses.py
ADVANTAGES: Registry = LoadedRegistry("advantage estimator")  # factory/algo/advantages.py
KL_ESTIMATORS: Registry = LoadedRegistry("KL estimator")  # factory/algo/kl.py
CORRECTIONS: Registry = LoadedRegistry("correction")  # factory/algo/corrections.py
# the correction registry's metadata, filled beside each entry by register_correction
CORRECTION_PARAMS: dict[str, tuple[str, ...]] = {}  # the CorrectionConfig fields each one reads
IS_CORRECTIONS: set[str] = set()  # those that look at rho = pi_prox / pi_b (trivial when prox = behaviour)

# Recipe-time checks a component owns, by what they check; each raises ValueError or returns problems:
# "environment": name -> the environment factory (a registered name or a user's package.module:attr);
# "verifier_spec": (name, extract, config) -> ["field: problem", ...].
VALIDATORS: Registry[Callable[..., Any]] = LoadedRegistry("recipe validator")


def correction_params(name: str) -> tuple[str, ...]:
    """The CorrectionConfig fields the registered correction `name` reads."""
    CORRECTIONS.check(name)  # fills the registry and its metadata
    return CORRECTION_PARAMS[name]


def is_correction(name: str) -> bool:
    """Whether the correction `name` weighs the proximal/behaviour ratio."""
    return name in CORRECTIONS and name in IS_CORRECTIONS
