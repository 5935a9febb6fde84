"""Tests never touch the user's state: a test session records into a state dir of its own, and shares
only the user's built policies (and the suite's own, built or not), as links."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mlflow import MlflowClient

from factory.lake import sql
from factory.paths import REPO_ROOT, state_dir
from factory.recipe import load_recipe
from factory.recording.recorder import RunRecorder
from tests.policies import base_policy_names


def test_this_session_runs_in_its_own_state_dir():
    user_home = Path(os.environ["FACTORY_TEST_USER_HOME"])
    assert state_dir().resolve() != user_home and state_dir().name.startswith("factory-tests-")
    # unset for the session by tests/conftest.py; a session fixture may point one at its own temp dir
    # (dagster's instance_for_test sets DAGSTER_HOME while it lives), never at the user's state
    for name in ("MLFLOW_TRACKING_URI", "DAGSTER_HOME", "RAY_ADDRESS", "FACTORY_PROFILE"):
        value = os.environ.get(name)
        assert value is None or str(user_home) not in value, (name, value)


def test_a_test_session_leaves_the_user_s_lake_and_mlflow_untouched(tmp_path, monkeypatch):
    user = tmp_path / "user-state"  # a user's state dir with one run of their own in the lake and MLflow
    monkeypatch.setenv("FACTORY_HOME", str(user))
    recipe = load_recipe(REPO_ROOT / "recipes" / "default.yaml", ["lake.enabled=true", "tracking.enabled=true"])
    mine = RunRecorder(recipe, user / "runs" / "users-run")
    mine.log_step(1, {"train/loss": 1.0})
    mine.finish({"steps": 1})
    policy = user / "models" / "tiny-000000000000"
    policy.mkdir(parents=True)
    (policy / "sft.json").write_text("{}")
    (user / "models" / "tiny-half-built").mkdir()  # no sft.json: not shared
    before = {p: p.stat().st_mtime_ns for p in user.rglob("*") if p.is_file()}

    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           str(REPO_ROOT / "tests" / "state_probe.py")],
                          cwd=REPO_ROOT, env={**os.environ, "FACTORY_HOME": str(user), "MLFLOW_TRACKING_URI": ""},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    probe = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))[6:])

    session = Path(probe["state_dir"])
    assert not session.is_relative_to(user) and not session.exists()  # its own, removed afterwards
    # the complete policy shared, the half-built one not; the suite's own policies are linked whether built
    # or not (`make test` may be building them in the user's state dir meanwhile: tests/conftest.py)
    suite = {name: os.path.realpath(user / "models" / name) for name in base_policy_names()}
    assert probe["models"] == {"tiny-000000000000": str(policy.resolve()), **suite}
    after = {p: p.stat().st_mtime_ns for p in user.rglob("*") if p.is_file()}
    assert after == before  # not one file of the user's state written, none added
    assert sql("SELECT run_id, count(*) AS n FROM steps GROUP BY 1").to_pylist() == [{"run_id": "users-run", "n": 1}]
    experiment = MlflowClient(f"sqlite:///{user / 'mlflow' / 'mlflow.db'}").get_experiment_by_name("factory")
    runs = MlflowClient(f"sqlite:///{user / 'mlflow' / 'mlflow.db'}").search_runs([experiment.experiment_id])
    assert [r.info.run_name for r in runs] == ["users-run"]
