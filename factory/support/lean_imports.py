"""Import transformers without scikit-learn and scipy, in the processes a run starts for each run.

transformers imports scikit-learn (`sklearn.metrics.roc_curve`, for a heuristic of assisted
generation) whenever it is installed, from `transformers.generation`, which every model class and
tokenizer import pulls in; and scipy (`scipy.optimize.linear_sum_assignment`, for object-detection
losses) from `transformers.loss`, which every model class import pulls in. MLflow requires
scikit-learn (and with it scipy), so both are always installed here. Measured on 2 cores: scikit-learn
costs ~1.1 s of CPU in each trainer and env worker process, scipy ~0.4 s more in each process that
imports a model class (the trainer, the scorer, a driver that builds or evaluates a policy). A run
pays them at its start. Factory never uses assisted generation or detection losses.
"""

from __future__ import annotations

import sys
from types import ModuleType


def lean_transformers(utils: ModuleType | None = None) -> None:
    """Before the first import of `transformers.generation` and `transformers.loss` in this process,
    tell them that scikit-learn and scipy are absent (only transformers' own checks,
    `transformers.utils.is_sklearn_available` and `is_scipy_available`, answer "no": the rest of
    transformers and any other user of either library are untouched). A no-op once they were imported.
    `utils`: the `transformers.utils` module, for a caller that has it while transformers is still
    being imported (an import hook)."""
    if "transformers.generation.candidate_generator" in sys.modules or "transformers.loss.loss_utils" in sys.modules:
        return
    if utils is None:
        import transformers.utils

        utils = transformers.utils
    setattr(utils, "is_sklearn_available", lambda: False)  # noqa: B010  (a module's attribute, not a typed one)
    setattr(utils, "is_scipy_available", lambda: False)  # noqa: B010
