"""A run's trainer and env worker processes import transformers without scikit-learn (~1.1 s each)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
{prelude}
from transformers import AutoModelForCausalLM, AutoTokenizer
import transformers.utils.import_utils as iu
print("sklearn" in sys.modules, iu.is_sklearn_available())
"""


def probe(prelude: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE.format(prelude=prelude)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_model_and_tokenizer_classes_import_without_sklearn_and_its_check_elsewhere_is_untouched():
    # (without the call, the probe prints True True: MLflow installs scikit-learn and transformers imports it)
    lean = "from factory.lean_imports import transformers_without_sklearn; transformers_without_sklearn()"
    assert probe(lean) == ["False", "True"]
