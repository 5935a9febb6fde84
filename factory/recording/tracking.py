"""RunTracker: one MLflow run per RL run — flattened recipe as params, step metrics, plots, artifacts.

Store: the tracking URI given (from the recipe), else the production profile's tracking server,
else $MLFLOW_TRACKING_URI, else a SQLite store at `<state>/mlflow/mlflow.db` with artifacts under
`<state>/mlflow/artifacts`.
A resumed RL run continues its MLflow run (`start(..., resume_run_id=...)`), so its curves stay one.
`TrackingSink` is MLflow as one of a run's sinks (`factory.recording.sinks`).

Outages of the store (the server, or its database behind it) do not stop training: each step's
metrics and tags go into a queue that one background thread sends, retrying with backoff and jitter
(`factory.recording.outage`) up to `outage_deadline_s` (the recipe's `deadlines.service_outage_s`). At most
`max_queued` batches wait in memory; later ones spill to `spill_path` (JSON lines) and are sent
from there once the store answers. A batch sent twice (its answer lost) is stored once: each metric
keeps the timestamp it was logged with, and MLflow skips a metric it already holds. Other calls
(start, artifacts, the run's status) retry the same way in the caller. `tracking/outage_s` reports
the time spent in outages; past the deadline a one-line `ServiceOutage` names the store and what
was kept.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections import Counter, deque
from functools import partial
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before mlflow is imported
# MLflow's own HTTP retries (minutes per call) would hide deadlines.service_outage_s: RunTracker retries
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")

import requests  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import Metric, Param, RunStatus, RunTag  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.utils.validation import (  # noqa: E402
    MAX_ENTITIES_PER_BATCH,
    MAX_ENTITY_KEY_LENGTH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
)

from factory.core.types import Batch  # noqa: E402
from factory.recording import lineage  # noqa: E402
from factory.recording.sinks import Sink  # noqa: E402
from factory.support import profile  # noqa: E402
from factory.support.failures import ServiceOutage  # noqa: E402
from factory.recording.outage import GuardedClient, Outage  # noqa: E402
from factory.paths import state_dir  # noqa: E402

log = logging.getLogger(__name__)
MAX_QUEUED = 256  # batches (a step's metrics is one) waiting in memory while the store is unreachable
# the sender stores at most one merged batch per this many seconds (flush and end do not wait for it):
# a store call's CPU cost is mostly per call, whatever its size, so a few steps share one
SEND_INTERVAL_S = 2.0

DEFAULT_EXPERIMENT = "factory"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # values in MLflow's UI: genai_development, custom_model_development
RUN_TAG = "factory.run"  # the RL run's name, to find its MLflow run again on resume
REWARD_METRIC = "rollout/reward_mean"
THROUGHPUT_METRIC = "perf/samples_per_s"  # trained samples / seconds since training started: a running mean
# samples/s over the last steps (factory.support.throughput.WindowedRate): generated (every finished sample,
# filtered ones included) and trained; a slowdown shows in these, the running mean hides it
WINDOWED_THROUGHPUT = {"generated": "perf/generated_samples_per_s", "trained": "perf/trained_samples_per_s"}


def default_tracking_uri() -> str:
    """The profile's tracking server, else $MLFLOW_TRACKING_URI, else `sqlite:///<state>/mlflow/mlflow.db`
    (created on first use)."""
    server = profile.tracking_uri() or os.environ.get("MLFLOW_TRACKING_URI")
    if server:
        return server
    root = state_dir() / "mlflow"
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def transient(error: BaseException) -> bool:
    """An error of an unreachable or overloaded store: connection refused, a timeout, HTTP 408/429/5xx
    (a server whose database is down answers 503). A request MLflow rejects (4xx) is not retried."""
    if isinstance(error, MlflowException):
        status = error.get_http_status_code()
        return status >= 500 or status in (408, 429)
    return isinstance(error, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, OSError))


def shown_uri(uri: str) -> str:
    """A tracking URI without its password, for messages."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", uri)


def ui_hint(uri: str, mlflow_bin: str = "mlflow") -> str:
    """How to see runs of the store at `uri`: a server's own URL, or the `mlflow ui` command that serves
    a local store (a server already holds its port: starting a UI on it would fail)."""
    if uri.startswith(("http://", "https://")):
        return shown_uri(uri)
    return f"{mlflow_bin} ui --backend-store-uri {uri} --port 5000, then http://127.0.0.1:5000"


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dict → {"a.b.c": str(value)}; lists as JSON; keys and values cut to MLflow's limits."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, prefix=f"{name}."))
            continue
        text = json.dumps(value, default=str) if isinstance(value, (list, tuple, Mapping)) else str(value)
        flat[mlflow_key(name)] = text[:MAX_PARAM_VAL_LENGTH]
    return flat


def mlflow_key(name: str) -> str:
    """A metric/param name MLflow accepts: allowed characters only, no leading '/', ≤ 250 chars."""
    key = re.sub(r"[^/\w.\- :]", "_", name).lstrip("/")
    key = re.sub(r"/+", "/", key)
    return key[:MAX_ENTITY_KEY_LENGTH] or "_"


class RunTracker(GuardedClient):
    """One MLflow run for one RL run: `start` → `log_metrics`/`log_artifact`/`log_plots` → `end`."""

    _transient = staticmethod(transient)

    def __init__(self, tracking_uri: str | None = None, experiment: str = DEFAULT_EXPERIMENT, *,
                 outage_deadline_s: float = 300.0, spill_path: Path | None = None,
                 max_queued: int = MAX_QUEUED, send_interval_s: float = SEND_INTERVAL_S) -> None:
        uri = tracking_uri or default_tracking_uri()
        self.tracking_uri = uri
        self._client: MlflowClient | None = None
        self.experiment = experiment
        self.run_id: str | None = None
        self.outage = Outage(lambda _: f"the MLflow tracking store ({shown_uri(uri)})", outage_deadline_s)
        self.spill_path = Path(spill_path) if spill_path is not None else None  # None: the queue is unbounded
        self.max_queued = max_queued
        self._lock = threading.Condition()
        self._queue: deque[dict[str, Any]] = deque()  # batches to send: {"run_id", "metrics", "tags"}
        self._spilled = 0  # batches in the spill file not yet sent (sent from `_spill_offset` on)
        self._spill_offset = 0
        self._spilled_total = 0
        self.send_interval_s = send_interval_s
        self._busy = False
        self._closing = False
        self._hurry = 0  # callers waiting in `flush`: the sender does not pause between calls for them
        self._sender: threading.Thread | None = None
        self._error: BaseException | None = None  # a batch the store refused
        self._gave_up: ServiceOutage | None = None
        if self.spill_path is not None:
            # a crashed attempt's unsent batches: steps past its checkpoint, which the resumed run logs anew
            self.spill_path.unlink(missing_ok=True)

    @property
    def client(self) -> MlflowClient:
        """The MLflow client, opened on first use (opening a SQLite store creates/migrates it)."""
        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _experiment_id(self) -> str:
        found = self._call(partial(self.client.get_experiment_by_name, self.experiment))
        if found is not None:
            return found.experiment_id
        artifacts = None  # a server chooses its own artifact store
        if self.tracking_uri.startswith("sqlite:///"):  # beside the database, not MLflow's ./mlruns
            db = Path(self.tracking_uri.removeprefix("sqlite:///"))
            artifacts = (db.parent / "artifacts").resolve().as_uri()
        return self._call(partial(self.client.create_experiment, self.experiment, artifact_location=artifacts))

    def find_run(self, run_name: str) -> str | None:
        """The MLflow run id of the newest run started for RL run `run_name`, if any."""
        found = self._call(partial(self.client.get_experiment_by_name, self.experiment))
        if found is None:
            return None
        runs = self._call(partial(self.client.search_runs, [found.experiment_id],
                                  filter_string=f"tags.`{RUN_TAG}` = '{run_name}'",
                                  order_by=["attributes.start_time DESC"], max_results=1))
        return runs[0].info.run_id if runs else None

    def start(self, run_name: str, params: Mapping[str, Any] | None = None,
              tags: Mapping[str, str] | None = None, resume_run_id: str | None = None) -> str:
        """Create (or, with `resume_run_id`, reopen) the MLflow run; return its id.

        On resume, params already logged are kept (MLflow params are immutable); a param whose
        value changed is recorded as tag `factory.param_changed.<key>`.
        """
        tags = {RUN_TAG: run_name, **(tags or {})}
        flat = flatten_params(params or {})
        if resume_run_id is not None:
            run = self._call(partial(self.client.get_run, resume_run_id))
            self.run_id = run.info.run_id
            self._call(partial(self.client.update_run, self.run_id, status=RunStatus.to_string(RunStatus.RUNNING)))
            old = run.data.params
            changed = {f"factory.param_changed.{k}": v for k, v in flat.items() if k in old and old[k] != v}
            flat = {k: v for k, v in flat.items() if k not in old}
            resumes = int(run.data.tags.get("factory.resumed", "0")) + 1
            tags = {**tags, **changed, "factory.resumed": str(resumes)}
        else:
            # a retried create whose answer was lost leaves an empty run behind; the RL run uses the last one
            run = self._call(partial(self.client.create_run, self._experiment_id(), run_name=run_name))
            self.run_id = run.info.run_id
        run_id = self.run_id
        entities: list[Param | RunTag] = [Param(k, v) for k, v in flat.items()]
        entities += [RunTag(mlflow_key(k), str(v)[:MAX_TAG_VAL_LENGTH]) for k, v in tags.items()]
        for chunk in _chunks(entities, MAX_PARAMS_TAGS_PER_BATCH):
            self._call(partial(self.client.log_batch, run_id, params=[e for e in chunk if isinstance(e, Param)],
                               tags=[e for e in chunk if isinstance(e, RunTag)]))
        return run_id

    def set_experiment_tag(self, key: str, value: str) -> None:
        """Tag the open run's experiment."""
        run = self._call(partial(self.client.get_run, self._id()))
        self._call(partial(self.client.set_experiment_tag, run.info.experiment_id, key, value))

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags on the open run (e.g. its lineage: git sha, recipe hash, base policy, Dagster run); queued."""
        run_id = self._id()
        items = [[mlflow_key(k), str(v)[:MAX_TAG_VAL_LENGTH]] for k, v in tags.items()]
        for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            self._enqueue({"run_id": run_id, "metrics": [], "tags": chunk})

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Queue one step's numeric metrics (non-numbers are skipped) for the sender thread: the
        training loop never waits for the store. `flush` (and `end`) wait until they are stored."""
        run_id, now = self._id(), int(time.time() * 1000)
        batch = [[mlflow_key(k), float(v), now, int(step)] for k, v in metrics.items() if isinstance(v, (int, float))]
        for chunk in _chunks(batch, MAX_METRICS_PER_BATCH):
            self._enqueue({"run_id": run_id, "metrics": chunk, "tags": []})

    def metrics(self) -> dict[str, float]:
        """tracking/outage_s: seconds the store was unreachable so far; tracking/queued_batches: batches
        not yet stored; tracking/spilled_batches: batches that waited on disk."""
        with self._lock:
            queued = len(self._queue) + self._spilled + int(self._busy)
            spilled = self._spilled_total
        return {"tracking/outage_s": self.outage.seconds(), "tracking/queued_batches": float(queued),
                "tracking/spilled_batches": float(spilled)}

    def flush(self) -> None:
        """Wait until every batch queued so far is in the store (or raise why it is not)."""
        with self._lock:
            self._hurry += 1
            self._lock.notify_all()
            try:
                while (self._queue or self._spilled or self._busy) and self._gave_up is None and self._error is None:
                    self._lock.wait(timeout=1.0)
            finally:
                self._hurry -= 1
            gave_up, error, self._error = self._gave_up, self._error, None
        if gave_up is not None:
            raise gave_up
        if error is not None:
            raise error

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy a file (or directory) into the run's artifacts."""
        run_id, path = self._id(), Path(path)
        if path.is_dir():
            self._call(partial(self.client.log_artifacts, run_id, str(path), artifact_path))
        else:
            self._call(partial(self.client.log_artifact, run_id, str(path), artifact_path))

    def log_plots(self, metrics_jsonl: str | Path, staleness: Iterable[int] | Mapping[int, int] = (),
                  out_dir: str | Path | None = None) -> list[Path]:
        """Plot the reward curve, throughput and staleness histogram as PNGs; log them under `plots/`.

        The throughput plot shows generated and trained samples/s per window of steps (older runs,
        without them: the running mean).

        `metrics_jsonl` is the run's metrics file (one `{"step": s, name: value, ...}` per line);
        `staleness` the per-sample staleness of trained samples, or their counts by value (what a run
        keeps: a run of days trains millions). Plots whose data is absent are skipped. Returns the PNG
        paths.
        """
        metrics_jsonl = Path(metrics_jsonl)
        out = Path(out_dir) if out_dir is not None else metrics_jsonl.parent / "plots"
        out.mkdir(parents=True, exist_ok=True)
        series = read_series(metrics_jsonl, [REWARD_METRIC, THROUGHPUT_METRIC, *WINDOWED_THROUGHPUT.values()])
        made = []
        if series[REWARD_METRIC]:
            made.append(_line_plot(series[REWARD_METRIC], "reward (mean per step)", REWARD_METRIC,
                                   out / "reward.png"))
        if series[THROUGHPUT_METRIC] or any(series[k] for k in WINDOWED_THROUGHPUT.values()):
            made.append(throughput_plot(series, out / "throughput.png"))
        counts = Counter(staleness)  # a Counter counts an iterable's values, and copies a mapping's counts
        if sum(counts.values()):
            made.append(_staleness_histogram(counts, out / "staleness.png"))
        for path in made:
            self.log_artifact(path, "plots")
        return made

    def end(self, status: str = "FINISHED") -> None:
        """Close the run with FINISHED, FAILED or KILLED (after its queued batches are stored)."""
        try:
            if self.run_id is not None:
                try:
                    self.flush()
                finally:  # closed even when a queued batch failed to store (not after an outage: it would wait again)
                    self._call(partial(self.client.set_terminated, self.run_id, status=status))
        finally:
            with self._lock:
                self._closing = True
                self._lock.notify_all()
            if self._sender is not None:
                self._sender.join(timeout=10)

    def _id(self) -> str:
        if self.run_id is None:
            raise RuntimeError("RunTracker: call start() first")
        return self.run_id

    # ---- the sender thread: queued batches into the store, in order ---------------------------

    def _enqueue(self, batch: dict[str, Any]) -> None:
        with self._lock:
            if self._gave_up is not None:
                raise self._gave_up
            if self.spill_path is not None and (self._spilled or len(self._queue) >= self.max_queued):
                with open(self.spill_path, "a") as out:  # after the memory queue, in order
                    out.write(json.dumps(batch) + "\n")
                self._spilled += 1
                self._spilled_total += 1
            else:
                self._queue.append(batch)
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_all, name="mlflow-sender", daemon=True)
                self._sender.start()
            self._lock.notify_all()

    def _next_batch(self) -> dict[str, Any]:
        """The oldest unsent batch: memory first (merged with the batches queued after it for the same
        run, within MLflow's limits per call), then the spill file (lock held)."""
        if self._queue:
            batch = self._queue.popleft()
            merged = {"run_id": batch["run_id"], "metrics": list(batch["metrics"]), "tags": list(batch["tags"])}
            while self._queue and self._queue[0]["run_id"] == merged["run_id"]:
                after = self._queue[0]
                metrics, tags = len(merged["metrics"]) + len(after["metrics"]), len(merged["tags"]) + len(after["tags"])
                if (metrics > MAX_METRICS_PER_BATCH or tags > MAX_PARAMS_TAGS_PER_BATCH
                        or metrics + tags > MAX_ENTITIES_PER_BATCH):
                    break
                merged["metrics"] += after["metrics"]
                merged["tags"] += after["tags"]
                self._queue.popleft()
            return merged
        assert self.spill_path is not None and self._spilled
        with open(self.spill_path) as spill:
            spill.seek(self._spill_offset)
            line = spill.readline()
            self._spill_offset = spill.tell()
        self._spilled -= 1
        if not self._spilled:  # all sent: new batches go to memory again
            self.spill_path.unlink(missing_ok=True)
            self._spill_offset = 0
        return json.loads(line)

    def _send_all(self) -> None:
        sent_at = -math.inf
        while True:
            with self._lock:
                while not (self._queue or self._spilled or self._closing):
                    self._lock.wait()
                # let a few steps' batches gather into one call, unless someone waits for them
                self._lock.wait_for(lambda: self._closing or self._hurry > 0,
                                    timeout=max(0.0, sent_at + self.send_interval_s - time.monotonic()))
                if not (self._queue or self._spilled):
                    return
                batch = self._next_batch()
                self._busy = True
            try:
                sent_at = time.monotonic()
                self._call(partial(self._store, batch))
            except ServiceOutage:
                with self._lock:
                    self._queue.appendleft(batch)
                    if self.spill_path is not None:  # keep every unsent batch on disk
                        while self._queue:
                            with open(self.spill_path, "a") as out:
                                out.write(json.dumps(self._queue.pop()) + "\n")
                            self._spilled += 1
                    self._busy = False  # the batch in hand is back in the queue (or the spill file): not counted twice
                    self._gave_up = self.outage.error(self._kept())
                    log.error("%s", self._gave_up)
                    self._lock.notify_all()
                return
            except Exception as error:  # the store refused it (not an outage): `flush` raises it
                log.warning("MLflow refused a batch of run %s: %s", batch["run_id"], error)
                with self._lock:
                    self._error = error
            with self._lock:
                self._busy = False
                self._lock.notify_all()

    def _store(self, batch: dict[str, Any]) -> None:
        self.client.log_batch(batch["run_id"], metrics=[Metric(k, v, t, s) for k, v, t, s in batch["metrics"]],
                              tags=[RunTag(k, v) for k, v in batch["tags"]])

    def _kept(self) -> str:
        with self._lock:
            memory, spilled = len(self._queue) + int(self._busy), self._spilled
        where = f"{spilled} unsent batches in {self.spill_path}" if spilled else "nothing on disk"
        return (f"every step's metrics in the run dir's metrics.jsonl; {where}"
                f"{f', {memory} in memory' if memory else ''}")


class TrackingSink(Sink):
    """MLflow as a run's sink: the recipe as params, each step's metrics, the run's lineage as tags,
    evaluation summaries, and at the end plots and the run's files. A relaunched run continues its
    MLflow run; a sweep's child run names its parent."""

    def __init__(self, recipe, run_dir: Path, run_id: str, resumed_from: int | None = None,
                 parent_run_id: str | None = None) -> None:
        self.dir = run_dir
        self.staleness: Counter[int] = Counter()  # trained samples by staleness (counts: runs last days)
        self.tracker = RunTracker(recipe.tracking.uri, recipe.tracking.experiment,
                                  outage_deadline_s=recipe.deadlines.service_outage_s,
                                  spill_path=run_dir / "tracking-spill.jsonl")
        resume = self.tracker.find_run(run_id)  # a relaunched run continues its MLflow run
        tags = {"factory.resumed_from_step": str(resumed_from)} if resumed_from is not None else {}
        if parent_run_id:  # a sweep's child run
            tags["mlflow.parentRunId"] = parent_run_id
        self.tracker.start(run_id, params=recipe.dump(), tags=tags, resume_run_id=resume)
        # MLflow 3's UI opens an experiment without this tag on its GenAI (traces) view; ours hold training runs
        self.tracker.set_experiment_tag(EXPERIMENT_KIND_TAG, "custom_model_development")

    def ids(self) -> dict[str, Any]:
        return {"mlflow_run_id": self.tracker.run_id}

    def metrics(self) -> dict[str, float]:  # tracking/outage_s: how long MLflow was unreachable so far
        return self.tracker.metrics()

    def start(self, origin: dict[str, Any], ids: dict[str, Any]) -> None:
        self.tracker.set_tags(lineage.mlflow_tags(origin))

    def samples(self, step: int, batch: Batch | None = None, discarded: Sequence = (), failed: Sequence = (),
                dropped: Sequence = ()) -> None:
        if batch is not None:
            self.staleness.update(batch.version - s.oldest_version for s in batch.samples)

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self.tracker.log_metrics(step, metrics)

    def evaluation(self, step: int, version: int, suite: str, tag: str, result: dict[str, Any], episodes: list | None,
                   checkpoint: Path | None, manifest: dict[str, Any]) -> None:
        self.tracker.log_metrics(step, {f"eval/{suite}_mean": result["mean"], f"eval/{suite}_stderr": result["stderr"]})

    def flush(self, checkpoint_step: int | None = None) -> None:
        self.tracker.flush()

    def finish(self, results: dict[str, Any] | None, status: str) -> None:
        if results is not None:
            self.tracker.log_plots(self.dir / "metrics.jsonl", self.staleness)
            for name in ("recipe.yaml", "results.json"):
                self.tracker.log_artifact(self.dir / name)
        self.tracker.end(status)


def read_series(metrics_jsonl: Path, names: Iterable[str]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) pairs of each named metric from a metrics.jsonl file (finite values only)."""
    series: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    if not metrics_jsonl.exists():
        return series
    for line in metrics_jsonl.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        for name in series:
            value = record.get(name)
            if isinstance(value, (int, float)) and math.isfinite(value) and "step" in record:
                series[name].append((int(record["step"]), float(value)))
    return series


def _line_plot(points: list[tuple[int, float]], title: str, ylabel: str, path: Path) -> Path:
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    steps, values = zip(*points)
    ax.plot(steps, values, lw=1.2)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def throughput_plot(series: Mapping[str, list[tuple[int, float]]], path: Path) -> Path:
    """Generated and trained samples/s per window of steps, and the trained running mean (dashed)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    lines = [(WINDOWED_THROUGHPUT["generated"], "generated (window)", "-"),
             (WINDOWED_THROUGHPUT["trained"], "trained (window)", "-"),
             (THROUGHPUT_METRIC, "trained (running mean)", "--")]
    for name, label, style in lines:
        if series.get(name):
            steps, values = zip(*series[name])
            ax.plot(steps, values, style, lw=1.2, label=label)
    ax.set(title="throughput", xlabel="step", ylabel="samples / s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _staleness_histogram(counts: Counter, path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    values = sorted(v for v in counts if counts[v])
    ax.bar(values, [counts[v] for v in values], width=0.8)
    ax.set(title=f"staleness of trained samples (n={sum(counts.values())})", xlabel="versions behind",
           ylabel="samples", xticks=values)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
