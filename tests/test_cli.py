"""The `factory` command's user-facing lines: recipe check against this machine, the run summary."""

from __future__ import annotations

import json

import pytest

from factory.cli import main, print_summary
from factory.paths import REPO_ROOT
from factory.recipe import load_recipe

DEFAULT = str(REPO_ROOT / "recipes" / "default.yaml")


def check(capsys, *overrides: str) -> tuple[int, str]:
    code = main(["recipe", "check", DEFAULT, *overrides])
    out = capsys.readouterr()
    return code, (out.err or out.out).strip()


def test_recipe_check_rejects_a_model_path_that_is_not_a_model_directory(capsys, tmp_path):
    assert check(capsys, f"model.path={tmp_path / 'nope'}") == (2, f"{DEFAULT}: model.path: {tmp_path / 'nope'} does not exist")
    assert check(capsys, f"model.path={tmp_path}") == (
        2, f"{DEFAULT}: model.path: {tmp_path} is not a model directory (no config.json)")
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    code, text = check(capsys, f"model.path={tmp_path}")
    assert code == 2 and text.splitlines() == [
        f"{DEFAULT}: rollout.max_model_len: 256 is beyond the context of {tmp_path} (max_position_embeddings=128)",
        f"{DEFAULT}: model.path: {tmp_path} holds no weights (*.safetensors or *.bin)"]
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert check(capsys, f"model.path={tmp_path}", "rollout.max_model_len=128", "rollout.max_new_tokens=8")[0] == 0


def test_recipe_check_rejects_an_engine_this_machine_cannot_start(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FACTORY_SGLANG_PYTHON", str(tmp_path / "no-python"))
    code, text = check(capsys, "rollout.engine=sglang")
    assert code == 2 and text.startswith(f"{DEFAULT}: rollout.engine: sglang cannot start on this machine: "
                                         f"FACTORY_SGLANG_PYTHON={tmp_path / 'no-python'} does not exist")
    assert check(capsys, "rollout.engine=sglang", "rollout.urls=[http://127.0.0.1:9]")[0] == 2  # attach: sglang cannot
    assert check(capsys)[0] == 0  # vllm is installed here


def test_a_sweep_with_a_bad_grid_value_fails_at_plan_time_in_one_line(capsys):
    code = main(["sweep", str(REPO_ROOT / "recipes" / "sweep_loss_staleness.yaml"),
                 "sweep={algorithm.loss: [ppo_clip, nope]}", "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "sweep point algorithm.loss='nope': algorithm.loss: unknown policy loss 'nope'" in err


@pytest.mark.parametrize("home", [None, "moved"])
def test_the_summary_names_plots_and_prints_commands_for_this_state_dir(capsys, monkeypatch, tmp_path, home):
    if home:
        monkeypatch.setenv("FACTORY_HOME", str(tmp_path / home))
    else:
        monkeypatch.delenv("FACTORY_HOME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "default-20260101-000000"
    (run_dir / "plots").mkdir(parents=True)
    recipe = load_recipe(DEFAULT)
    print_summary({"run_dir": str(run_dir), "total_seconds": 1.0, "train_seconds": 1.0, "samples_trained": 8,
                   "trainer_idle_fraction": 0.1}, recipe)
    out = capsys.readouterr().out
    assert "plots/ (reward, throughput, staleness)" in out
    lake = next(line for line in out.splitlines() if line.startswith("SQL over the lake"))
    mlflow = next(line for line in out.splitlines() if line.startswith("MLflow UI"))
    assert "WHERE run_id = 'default-20260101-000000'" in lake
    if home:
        assert f"FACTORY_HOME={tmp_path / home} " in lake
        assert f"sqlite:///{tmp_path / home / 'mlflow' / 'mlflow.db'}" in mlflow
    else:
        assert "FACTORY_HOME" not in lake and f"sqlite:///{REPO_ROOT / '.state' / 'mlflow' / 'mlflow.db'}" in mlflow



def test_with_a_tracking_server_the_summary_prints_its_url_not_an_mlflow_ui_command(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5123")
    run_dir = tmp_path / "default-20260101-000000"
    run_dir.mkdir()
    print_summary({"run_dir": str(run_dir), "total_seconds": 1.0, "train_seconds": 1.0, "samples_trained": 8,
                   "trainer_idle_fraction": 0.1}, load_recipe(DEFAULT))
    mlflow = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("MLflow UI"))
    assert "http://127.0.0.1:5123 (experiment" in mlflow and " ui " not in mlflow

def test_resume_names_what_is_missing_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path))
    runs = tmp_path / "runs"
    started = runs / "default-20260101-000000"
    started.mkdir(parents=True)
    (started / "recipe.yaml").write_text((REPO_ROOT / "recipes" / "default.yaml").read_text())
    assert main(["run", "--resume", "default-20990101-000000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --resume default-20990101-000000: no run with that id or directory (under {runs}; "
                   "latest: default-20260101-000000)")
    assert main(["run", "--resume", "default-20260101-000000", "train.steps=8"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --resume default-20260101-000000: {started} has no "
                                               "checkpoint yet; start it again instead")
    assert main(["run"]) == 2
    assert capsys.readouterr().err.strip() == "error: give a recipe to run, or --resume RUN_ID"


@pytest.mark.parametrize("before,warned", [({"mean": 0.0, "stderr": 0.0, "n": 64}, True),
                                           ({"mean": 0.016, "stderr": 0.016, "n": 64}, True),
                                           ({"mean": 0.25, "stderr": 0.05, "n": 64}, False),
                                           ({"mean": 0.0, "stderr": 0.0, "n": 16}, False)])
def test_the_summary_warns_when_the_starting_policy_scores_near_zero(capsys, tmp_path, before, warned):
    run_dir = tmp_path / "default-20260101-000000"
    run_dir.mkdir()
    print_summary({"run_dir": str(run_dir), "total_seconds": 1.0, "train_seconds": 1.0, "samples_trained": 8,
                   "trainer_idle_fraction": 0.1, "before": before})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    assert len(lines) == int(warned)
    if warned:
        assert f"scored {before['mean']:.3f}" in lines[0] and "model.seed" in lines[0] and "warm start" in lines[0]


def test_the_summary_says_where_the_runs_time_went_by_phase(capsys, tmp_path):
    run_dir = tmp_path / "default-20260101-000000"
    phases = {"inputs": 1.9, "start": 40.9, "training": 3.2, "stop": 0.0, "evaluation_after": 12.4, "shutdown": 0.6}
    print_summary({"run_dir": str(run_dir), "total_seconds": 59.0, "train_seconds": 3.2, "samples_trained": 8,
                   "trainer_idle_fraction": 0.1, "phase_seconds": phases})
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("by phase")]
    assert line.split(": ", 1)[1] == "inputs 2s, start 41s, training 3s, stop 0s, evaluation after 12s, shutdown 1s"
