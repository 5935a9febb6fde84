"""Import transformers without scikit-learn, in the processes a run starts for each run.

transformers imports scikit-learn (`sklearn.metrics.roc_curve`, for a heuristic of assisted
generation) whenever it is installed, from `transformers.generation`, which every model class and
tokenizer import pulls in. MLflow requires scikit-learn, so it is always installed here, and the
import costs ~1.1 s of CPU (scipy.stats mostly) in each trainer and env worker process: ~2 s of a run's
~9 s start on 2 cores. Factory never uses assisted generation.
"""

from __future__ import annotations

import sys


def transformers_without_sklearn() -> None:
    """Before the first import of `transformers.generation` in this process, tell it that scikit-learn
    is absent (only its own check, `transformers.utils.is_sklearn_available`, is answered "no": the rest
    of transformers and any other user of scikit-learn are untouched). A no-op once it was imported."""
    if "transformers.generation.candidate_generator" in sys.modules:
        return
    import transformers.utils

    transformers.utils.is_sklearn_available = lambda: False
