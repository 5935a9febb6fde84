"""Factory: a declarative research factory for asynchronous agentic RL on language models."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

# Modules that moved into a room: an old import path keeps working, with a warning naming the new one.
MOVED = {
    "factory.types": "factory.core.types", "factory.registry": "factory.core.registry",
    "factory.buffer": "factory.core.buffer", "factory.scheduling": "factory.core.scheduling",
    "factory.evaluate": "factory.data.heldout", "factory.trainer": "factory.training.trainer",
    "factory.parallel": "factory.training.parallel", "factory.scoring": "factory.training.scoring",
    "factory.weightsync": "factory.model.weightsync", "factory.lineage": "factory.recording.lineage",
    "factory.tracking": "factory.recording.tracking", "factory.replay": "factory.recording.replay",
    "factory.outage": "factory.recording.outage", "factory.threads": "factory.support.threads",
    "factory.throughput": "factory.support.throughput", "factory.progress": "factory.support.progress",
    "factory.failures": "factory.support.failures", "factory.lean_imports": "factory.support.lean_imports",
    "factory.devices": "factory.support.devices", "factory.profile": "factory.support.profile",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a moved module under its old name and hands out the module at its new one."""

    specs: dict = {}

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; import that", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        self.specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.specs[module.__spec__.name]  # the import machinery set the alias's


sys.meta_path.append(_Moved())


# The composition root: a core registry, on its first read, imports the components that register into it.
_FILLED_BY = {
    "ENGINES": ("factory.rollout.engines",), "ENVIRONMENTS": ("factory.envs",),
    "VERIFIERS": ("factory.rewards.verifiers",), "EXTRACTORS": ("factory.rewards.extract",),
    "SCORERS": ("factory.training.scoring",), "POLICY_LOSSES": ("factory.algo",), "AGGREGATIONS": ("factory.algo",),
    "ADVANTAGES": ("factory.algo",), "KL_ESTIMATORS": ("factory.algo",), "CORRECTIONS": ("factory.algo",),
    "VALIDATORS": ("factory.envs", "factory.rewards.verifiers"),
}


def _fill(registry) -> None:
    from factory.core import registries

    for name, modules in _FILLED_BY.items():
        if getattr(registries, name) is registry:
            for module in modules:
                importlib.import_module(module)


def _install_loader() -> None:
    from factory.core import registries

    registries.set_loader(_fill)


_install_loader()
