"""RunRecorder on a real lake and MLflow store: a resumed run rewinds its lake partition to the
checkpoint and continues its MLflow run."""

from __future__ import annotations

import json

from mlflow import MlflowClient

from factory.lake import TrajectoryWriter, open_catalog, sql
from factory.recipe import load_recipe
from factory.recording.recorder import RunRecorder
from factory.paths import REPO_ROOT
from factory.recording.tracking import RunTracker, default_tracking_uri
from tests.lake.rows import sample_row, step_row


def test_a_resumed_run_rewinds_the_lake_and_continues_its_mlflow_run(tmp_path, monkeypatch):
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    recipe = load_recipe(REPO_ROOT / "recipes" / "default.yaml", ["lake.enabled=true", "tracking.enabled=true"])
    run_dir = tmp_path / "run-1"

    first = RunRecorder(recipe, run_dir)  # the first attempt: 4 steps recorded, then it dies
    first.lake.append("samples", [sample_row("run-1", f"s{step}", step=step) for step in (1, 2, 3, 4)])
    for step in (1, 2, 3, 4):
        first.log_step(step, {"train/loss": 1.0 / step})
    first.fail()
    mlflow_run = first.tracker.run_id

    checkpoint = run_dir / "checkpoints" / "step-000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text(json.dumps({"version": 2, "step": 2}))
    with TrajectoryWriter(open_catalog(), run_id="other") as other:  # another run's rows stay
        other.append("steps", [step_row("other", 4)])

    second = RunRecorder(recipe, run_dir, resume_from=checkpoint)
    assert second.rewound == {"samples": 2, "steps": 2}
    second.flush()
    assert sql("SELECT step, path FROM checkpoints").to_pylist() == [{"step": 2, "path": str(checkpoint)}]
    assert second.tracker.run_id == mlflow_run
    second.lake.append("samples", [sample_row("run-1", f"s{step}", step=step, reward=0.0) for step in (3, 4)])
    for step in (3, 4):
        second.log_step(step, {"train/loss": 2.0 / step})
    second.finish({"steps": 4})

    rows = sql("SELECT run_id, step FROM steps ORDER BY 1, 2").to_pylist()
    assert [(r["run_id"], r["step"]) for r in rows] == [("other", 4)] + [("run-1", s) for s in (1, 2, 3, 4)]
    samples = sql("SELECT sample_id, reward FROM samples ORDER BY 1").to_pylist()
    assert samples == [{"sample_id": "s1", "reward": 1.0}, {"sample_id": "s2", "reward": 1.0},
                       {"sample_id": "s3", "reward": 0.0}, {"sample_id": "s4", "reward": 0.0}]
    run = MlflowClient(default_tracking_uri()).get_run(mlflow_run)
    assert run.info.status == "FINISHED"
    assert run.data.tags["factory.resumed"] == "1" and run.data.tags["factory.resumed_from_step"] == "2"
    assert RunTracker().find_run("run-1") == mlflow_run


def test_a_checkpoints_flush_puts_every_step_so_far_in_mlflow(tmp_path, monkeypatch):
    """The MLflow sender merges steps (one call per `send_interval_s`); a checkpoint's `flush` must not
    leave steps up to it queued in memory, where a killed run loses them and its resumed attempt, which
    logs only the steps after the checkpoint, never sends them (the production test caught one)."""
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    recipe = load_recipe(REPO_ROOT / "recipes" / "default.yaml", ["lake.enabled=false", "tracking.enabled=true"])
    recorder = RunRecorder(recipe, tmp_path / "run-1")
    recorder.tracker.send_interval_s = 60.0
    for step in (1, 2, 3):
        recorder.log_step(step, {"train/loss": 1.0 / step})
    recorder.flush()
    history = MlflowClient(default_tracking_uri()).get_metric_history(recorder.tracker.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3]
    recorder.finish({"steps": 3})


def test_the_experiment_opens_on_model_training_not_the_genai_view(tmp_path, monkeypatch):
    """MLflow 3's UI shows an experiment without `mlflow.experimentKind` as a GenAI (traces) experiment."""
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    recipe = load_recipe(REPO_ROOT / "recipes" / "default.yaml", ["lake.enabled=false", "tracking.enabled=true",
                                                                   "tracking.experiment=kind-test"])
    recorder = RunRecorder(recipe, tmp_path / "run-1")
    recorder.finish({"steps": 0})
    experiment = MlflowClient(default_tracking_uri()).get_experiment_by_name("kind-test")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_prune_checkpoints_keeps_the_newest_and_never_leaves_a_half_deleted_one(tmp_path):
    from factory.recording.recorder import checkpoints, latest_checkpoint, prune_checkpoints

    folder = tmp_path / "checkpoints"
    for step in (2, 4, 10, 6):
        (folder / f"step-{step:06d}").mkdir(parents=True)
        (folder / f"step-{step:06d}" / "state.json").write_text(json.dumps({"version": step}))
    (folder / "step-000008.tmp").mkdir()  # a checkpoint still being written: not a step-N dir
    (folder / ".pruned-step-000001").mkdir()  # what a crash during an earlier prune left
    (folder / ".pruned-step-000001" / "model.safetensors").write_bytes(b"x")

    assert prune_checkpoints(tmp_path, 0) == [] and len(checkpoints(tmp_path)) == 4  # 0: keep all
    assert (folder / ".pruned-step-000001").is_dir()
    deleted = prune_checkpoints(tmp_path, 2)
    assert [p.name for p in deleted] == ["step-000002", "step-000004"]
    assert [p.name for p in checkpoints(tmp_path)] == ["step-000006", "step-000010"]
    assert latest_checkpoint(tmp_path).name == "step-000010"
    assert sorted(p.name for p in folder.iterdir()) == ["step-000006", "step-000008.tmp", "step-000010"]
    assert prune_checkpoints(tmp_path, 2) == []  # nothing more to do
