"""RunTracker over a real MLflow SQLite store: params, metrics, plots, resume, limits."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from factory.recording.tracking import RunTracker, default_tracking_uri, flatten_params, mlflow_key

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    # one store for the module: creating MLflow's SQLite schema takes ~2 s
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("home")
        mp.setenv("FACTORY_HOME", str(path))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield path


@pytest.fixture(scope="module")
def finished_run(home):
    """A run with nested params, five steps of metrics and its plots, then ended."""
    metrics_file = home / "run" / "metrics.jsonl"
    metrics_file.parent.mkdir()
    lines = [{"step": s, "rollout/reward_mean": 0.1 * s, "perf/samples_per_s": 50.0 + s, "note": "x"} for s in range(5)]
    metrics_file.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    tracker = RunTracker()
    run_id = tracker.start("arith-grpo", params={"algo": {"loss": "grpo", "lr": 5e-5}, "rollout": {"n": 8},
                                                 "tags": ["a", "b"]}, tags={"recipe": "default.yaml"})
    for line in lines:
        tracker.log_metrics(line["step"], {k: v for k, v in line.items() if k != "step"})
    plots = tracker.log_plots(metrics_file, staleness=[0, 1, 1, 2, 1, 0])
    tracker.end("FINISHED")
    return tracker, run_id, plots


def test_store_defaults_to_sqlite_under_the_state_dir(home, finished_run):
    tracker, _, _ = finished_run
    assert tracker.tracking_uri == f"sqlite:///{home / 'mlflow' / 'mlflow.db'}" == default_tracking_uri()
    assert (home / "mlflow" / "mlflow.db").stat().st_size > 0
    assert (home / "mlflow" / "artifacts").is_dir()


def test_params_tags_metrics_and_status(finished_run):
    tracker, run_id, _ = finished_run
    run = MlflowClient(tracker.tracking_uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "arith-grpo"
    assert run.data.params == {"algo.loss": "grpo", "algo.lr": "5e-05", "rollout.n": "8", "tags": '["a", "b"]'}
    assert run.data.tags["recipe"] == "default.yaml" and run.data.tags["factory.run"] == "arith-grpo"
    history = MlflowClient(tracker.tracking_uri).get_metric_history(run_id, "rollout/reward_mean")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (s, pytest.approx(0.1 * s)) for s in range(5)]
    assert "note" not in run.data.metrics  # non-numeric values are skipped


def test_plots_are_pngs_logged_as_artifacts(finished_run):
    tracker, run_id, plots = finished_run
    assert sorted(p.name for p in plots) == ["reward.png", "staleness.png", "throughput.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in plots)
    logged = MlflowClient(tracker.tracking_uri).list_artifacts(run_id, "plots")
    assert sorted(a.path for a in logged) == ["plots/reward.png", "plots/staleness.png", "plots/throughput.png"]
    assert all(a.file_size > 1000 for a in logged)


def test_the_staleness_histogram_takes_counts_as_a_run_keeps_them(finished_run, tmp_path):
    """A run keeps its trained samples' staleness as counts (a run of days trains millions): the plot of
    the counts is the plot of the values."""
    from collections import Counter

    tracker, _, plots = finished_run
    (by_value,) = [p for p in plots if p.name == "staleness.png"]
    again = tracker.log_plots(tmp_path / "none.jsonl", staleness=Counter({1: 3, 0: 2, 2: 1, 5: 0}),
                              out_dir=tmp_path / "plots")
    assert [p.name for p in again] == ["staleness.png"] and again[0].read_bytes() == by_value.read_bytes()
    assert tracker.log_plots(tmp_path / "none.jsonl", staleness=Counter(), out_dir=tmp_path / "empty") == []


def test_resume_continues_the_same_run(finished_run, tmp_path):
    first, run_id, _ = finished_run
    tracker = RunTracker()
    assert tracker.find_run("arith-grpo") == run_id
    resumed = tracker.start("arith-grpo", params={"algo": {"loss": "grpo", "lr": 1e-4}, "seed": 3},
                            resume_run_id=run_id)
    assert resumed == run_id
    client = MlflowClient(tracker.tracking_uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    tracker.log_metrics(5, {"rollout/reward_mean": 0.5})
    artifact = tmp_path / "checkpoint.txt"
    artifact.write_text("step 5")
    tracker.log_artifact(artifact, "checkpoints")
    tracker.end("KILLED")
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(run_id, "rollout/reward_mean")] == [0, 1, 2, 3, 4, 5]
    assert run.data.params["algo.lr"] == "5e-05" and run.data.params["seed"] == "3"
    assert run.data.tags["factory.param_changed.algo.lr"] == "0.0001" and run.data.tags["factory.resumed"] == "1"
    assert [a.path for a in client.list_artifacts(run_id, "checkpoints")] == ["checkpoints/checkpoint.txt"]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_steps_queued_together_are_stored_in_one_call_within_mlflows_limits(tmp_path):
    """The sender merges the batches queued for a run (a step's metrics each) into one log_batch call,
    up to MLflow's 1,000 entities per call, in order; `flush` does not wait for the send interval."""
    import time

    tracker = RunTracker(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", send_interval_s=60)
    run_id = tracker.start("merged")
    calls = []
    store = tracker._store
    tracker._store = lambda batch: (calls.append((len(batch["metrics"]), len(batch["tags"]))), store(batch))[1]
    tracker.log_metrics(0, {"first": 0.0})
    tracker.flush()  # the first call goes at once
    for step in range(1, 13):  # 12 steps of 200 metrics: 2,400, more than one call holds
        tracker.log_metrics(step, {f"m{i}": float(step * i) for i in range(200)})
    tracker.set_tags({"lineage": "kept"})
    started = time.monotonic()
    tracker.end("FINISHED")
    assert time.monotonic() - started < 30  # not the 60 s interval
    assert calls == [(1, 0), (1000, 0), (1000, 0), (400, 1)]
    client = MlflowClient(tracker.tracking_uri)
    assert [m.step for m in client.get_metric_history(run_id, "m7")] == list(range(1, 13))
    assert client.get_run(run_id).data.tags["lineage"] == "kept"


def test_many_metrics_go_in_batches(finished_run):
    tracker = RunTracker()
    run_id = tracker.start("wide", params={f"p{i}": i for i in range(250)})  # > 100 params per batch
    tracker.log_metrics(0, {f"m/{i}": float(i) for i in range(1500)})  # > 1000 metrics per batch
    tracker.end()
    run = MlflowClient(tracker.tracking_uri).get_run(run_id)
    assert len(run.data.params) == 250 and len(run.data.metrics) == 1500 and run.data.metrics["m/1499"] == 1499.0


def test_flatten_params_and_key_limits():
    flat = flatten_params({"a": {"b": {"c": 1}, "d": None}, "long": "x" * 7000, "e": {}})
    assert flat == {"a.b.c": "1", "a.d": "None", "long": "x" * 6000, "e": "{}"}
    assert mlflow_key("/rollout/reward@mean") == "rollout/reward_mean"
    assert len(mlflow_key("k" * 400)) == 250


def test_an_env_tracking_uri_switches_the_store(monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert RunTracker().tracking_uri == "http://127.0.0.1:5999"
    recipe_uri = f"sqlite:///{tmp_path / 'x.db'}"
    assert RunTracker(tracking_uri=recipe_uri).tracking_uri == recipe_uri  # the recipe wins


def test_using_the_tracker_before_start_is_an_error(tmp_path):
    tracker = RunTracker(tracking_uri=f"sqlite:///{tmp_path / 'unused.db'}")
    with pytest.raises(RuntimeError, match="start"):
        tracker.log_metrics(0, {"a": 1.0})
    assert not (tmp_path / "unused.db").exists()  # the store is opened lazily


class TrackingServer:
    """A real MLflow tracking server (its Flask app over a SQLite store) on a fixed port, in this
    process, stopped and started again to make an outage. One request per connection (no keep-alive),
    so a stopped server refuses every request."""

    def __init__(self, root):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.env = {"_MLFLOW_SERVER_FILE_STORE": f"sqlite:///{root / 'server.db'}",
                    "_MLFLOW_SERVER_ARTIFACT_ROOT": (root / "artifacts").as_uri(), "_MLFLOW_SERVER_SERVE_ARTIFACTS": "false"}
        self.server = None

    def start(self) -> None:
        import threading

        from mlflow.server import app
        from werkzeug.serving import make_server

        self.server = make_server("127.0.0.1", self.port, app, threaded=False)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    server = TrackingServer(root)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in server.env.items():
            mp.setenv(key, value)
        mp.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # RunTracker's own retries only: the outage shows at once
        server.start()
        yield server
        server.stop()


def wait_until(condition, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_server_outage_shorter_than_the_deadline_is_waited_out_and_every_step_stored_once(server, tmp_path):
    import time

    spill = tmp_path / "tracking-spill.jsonl"
    tracker = RunTracker(server.uri, outage_deadline_s=60, spill_path=spill, max_queued=2)
    run_id = tracker.start("outage", params={"a": 1})
    tracker.log_metrics(1, {"x": 1.0})
    tracker.flush()
    server.stop()
    try:
        started = time.monotonic()
        for step in range(2, 9):  # the loop goes on: logging returns at once, batches beyond 2 wait on disk
            tracker.log_metrics(step, {"x": float(step)})
        tracker.set_tags({"lineage": "kept"})
        assert time.monotonic() - started < 0.5
        assert len(spill.read_text().splitlines()) >= 5
        wait_until(lambda: tracker.outage.down)
        time.sleep(0.2)  # the outage lasts a while
    finally:
        server.start()
    tracker.end("FINISHED")
    assert tracker.metrics()["tracking/outage_s"] >= 0.2 and tracker.metrics()["tracking/spilled_batches"] >= 5
    assert not spill.exists()
    client = MlflowClient(server.uri)
    assert sorted(m.step for m in client.get_metric_history(run_id, "x")) == list(range(1, 9))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["lineage"] == "kept"


def test_a_server_outage_past_the_deadline_stops_with_one_line_and_keeps_the_batches(server, tmp_path):
    import time

    from factory.support.failures import ServiceOutage

    spill = tmp_path / "tracking-spill.jsonl"
    tracker = RunTracker(server.uri, outage_deadline_s=0.5, spill_path=spill, max_queued=100)
    tracker.start("gone")
    server.stop()
    try:
        for step in (1, 2, 3):
            tracker.log_metrics(step, {"x": float(step)})
        with pytest.raises(ServiceOutage) as failed:
            tracker.flush()
        started = time.monotonic()
        with pytest.raises(ServiceOutage):
            tracker.end("FAILED")  # no second wait
        assert time.monotonic() - started < 1.0
    finally:
        server.start()
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"the MLflow tracking store ({server.uri}) unreachable for ")
    assert "deadlines.service_outage_s=0.5 s" in message
    kept = [json.loads(line) for line in spill.read_text().splitlines()]
    # the sender merges what is queued when it takes a batch: one to three batches, each counted once
    assert f"{len(kept)} unsent batches in {spill}" in message and "in memory" not in message, message
    assert sorted(m[3] for batch in kept for m in batch["metrics"]) == [1, 2, 3]


def test_the_ui_hint_is_a_servers_url_or_the_command_that_serves_a_local_store():
    from factory.recording.tracking import ui_hint

    assert ui_hint("http://user:secret@10.0.0.5:5000") == "http://user:***@10.0.0.5:5000"
    assert ui_hint("sqlite:////s/mlflow.db", "/v/bin/mlflow") == \
        "/v/bin/mlflow ui --backend-store-uri sqlite:////s/mlflow.db --port 5000, then http://127.0.0.1:5000"
