"""A run's trainer and env worker processes import transformers without scikit-learn (~1.1 s each)
and scipy (~0.4 s)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
{prelude}
from transformers import AutoModelForCausalLM, AutoTokenizer
import transformers.models.llama.modeling_llama  # a model class: pulls in transformers.loss
import transformers.utils.import_utils as iu
print("sklearn" in sys.modules, "scipy" in sys.modules, iu.is_sklearn_available(), iu.is_scipy_available())
"""


def probe(prelude: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(prelude=prelude)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_model_and_tokenizer_classes_import_without_sklearn_or_scipy_and_their_checks_elsewhere_are_untouched():
    # (without the call, the probe prints True True True True: MLflow installs both and transformers imports them)
    lean = "from factory.support.lean_imports import lean_transformers; lean_transformers()"
    assert probe(lean) == ["False", "False", "True", "True"]
