"""Run only by tests/test_state.py, in a pytest of its own: records a run the way any test would (the
default lake and MLflow, no FACTORY_HOME of its own) and says where its state went."""

from __future__ import annotations

import json
import os

from factory.paths import REPO_ROOT, models_dir, state_dir
from factory.recipe import load_recipe
from factory.recording.recorder import RunRecorder


def test_record_a_run_in_the_default_state():
    recipe = load_recipe(REPO_ROOT / "recipes" / "default.yaml", ["lake.enabled=true", "tracking.enabled=true"])
    recorder = RunRecorder(recipe, state_dir() / "runs" / "probe-run")
    recorder.log_step(1, {"train/loss": 0.5})
    recorder.log_evaluation(1, 1, "heldout", {"n": 4, "mean": 0.5, "stderr": 0.25, "by_family": {}})
    recorder.finish({"steps": 1})
    models = {p.name: os.path.realpath(p) for p in models_dir().iterdir()}
    print("PROBE " + json.dumps({"state_dir": str(state_dir()), "models": models}))
