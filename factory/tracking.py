"""RunTracker: one MLflow run per RL run — flattened recipe as params, step metrics, plots, artifacts.

Store: the tracking URI given (from the recipe), else the production profile's tracking server,
else $MLFLOW_TRACKING_URI, else a SQLite store at `<state>/mlflow/mlflow.db` with artifacts under
`<state>/mlflow/artifacts`.
A resumed RL run continues its MLflow run (`start(..., resume_run_id=...)`), so its curves stay one.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Mapping

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before mlflow is imported

from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import Metric, Param, RunStatus, RunTag  # noqa: E402
from mlflow.utils.validation import (  # noqa: E402
    MAX_ENTITY_KEY_LENGTH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
)

from factory import profile  # noqa: E402
from factory.paths import state_dir  # noqa: E402

DEFAULT_EXPERIMENT = "factory"
RUN_TAG = "factory.run"  # the RL run's name, to find its MLflow run again on resume
REWARD_METRIC = "rollout/reward_mean"
THROUGHPUT_METRIC = "perf/samples_per_s"  # trained samples / seconds since training started: a running mean
# samples/s over the last steps (factory.throughput.WindowedRate): generated (every finished sample,
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


class RunTracker:
    """One MLflow run for one RL run: `start` → `log_metrics`/`log_artifact`/`log_plots` → `end`."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = DEFAULT_EXPERIMENT) -> None:
        uri = tracking_uri or default_tracking_uri()
        self.tracking_uri = uri
        self._client: MlflowClient | None = None
        self.experiment = experiment
        self.run_id: str | None = None
        self._queued: list = []  # MLflow RunOperations of metrics not yet known to be stored

    @property
    def client(self) -> MlflowClient:
        """The MLflow client, opened on first use (opening a SQLite store creates/migrates it)."""
        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        artifacts = None  # a server chooses its own artifact store
        if self.tracking_uri.startswith("sqlite:///"):  # beside the database, not MLflow's ./mlruns
            db = Path(self.tracking_uri.removeprefix("sqlite:///"))
            artifacts = (db.parent / "artifacts").resolve().as_uri()
        return self.client.create_experiment(self.experiment, artifact_location=artifacts)

    def find_run(self, run_name: str) -> str | None:
        """The MLflow run id of the newest run started for RL run `run_name`, if any."""
        found = self.client.get_experiment_by_name(self.experiment)
        if found is None:
            return None
        runs = self.client.search_runs([found.experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_name}'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
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
            run = self.client.get_run(resume_run_id)
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            old = run.data.params
            changed = {f"factory.param_changed.{k}": v for k, v in flat.items() if k in old and old[k] != v}
            flat = {k: v for k, v in flat.items() if k not in old}
            resumes = int(run.data.tags.get("factory.resumed", "0")) + 1
            tags = {**tags, **changed, "factory.resumed": str(resumes)}
        else:
            run = self.client.create_run(self._experiment_id(), run_name=run_name)
            self.run_id = run.info.run_id
        self._log_params_and_tags(flat, tags)
        return self.run_id

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags on the open run (e.g. its lineage: git sha, recipe hash, base policy, Dagster run)."""
        self._log_params_and_tags({}, tags)

    def _log_params_and_tags(self, params: dict[str, str], tags: Mapping[str, str]) -> None:
        run_id = self._id()
        entities: list[Param | RunTag] = [Param(k, v) for k, v in params.items()]
        entities += [RunTag(mlflow_key(k), str(v)[:MAX_TAG_VAL_LENGTH]) for k, v in tags.items()]
        for chunk in _chunks(entities, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=[e for e in chunk if isinstance(e, Param)],
                                  tags=[e for e in chunk if isinstance(e, RunTag)])

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log one step's numeric metrics in one `log_batch` call (non-numbers are skipped).

        Asynchronous (MLflow's logging queue): a SQLite write took ~50 ms of the training loop's
        ~0.8 s step here. `flush` (and `end`) wait for every queued batch and raise its error."""
        run_id, now = self._id(), int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), float(v), now, int(step)) for k, v in metrics.items()
                 if isinstance(v, (int, float))]
        for chunk in _chunks(batch, MAX_METRICS_PER_BATCH):
            op = self.client.log_batch(run_id, metrics=chunk, synchronous=False)
            if op is not None:
                self._queued.append(op)

    def flush(self) -> None:
        """Wait until every metric logged so far is in the store."""
        queued, self._queued = self._queued, []
        for op in queued:
            op.wait()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy a file (or directory) into the run's artifacts."""
        run_id, path = self._id(), Path(path)
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(run_id, str(path), artifact_path)

    def log_plots(self, metrics_jsonl: str | Path, staleness: Iterable[int] = (),
                  out_dir: str | Path | None = None) -> list[Path]:
        """Plot the reward curve, throughput and staleness histogram as PNGs; log them under `plots/`.

        The throughput plot shows generated and trained samples/s per window of steps (older runs,
        without them: the running mean).

        `metrics_jsonl` is the run's metrics file (one `{"step": s, name: value, ...}` per line);
        `staleness` the per-sample staleness of trained samples. Plots whose data is absent are
        skipped. Returns the PNG paths.
        """
        run_id, metrics_jsonl = self._id(), Path(metrics_jsonl)
        out = Path(out_dir) if out_dir is not None else metrics_jsonl.parent / "plots"
        out.mkdir(parents=True, exist_ok=True)
        series = read_series(metrics_jsonl, [REWARD_METRIC, THROUGHPUT_METRIC, *WINDOWED_THROUGHPUT.values()])
        made = []
        if series[REWARD_METRIC]:
            made.append(_line_plot(series[REWARD_METRIC], "reward (mean per step)", REWARD_METRIC,
                                   out / "reward.png"))
        if series[THROUGHPUT_METRIC] or any(series[k] for k in WINDOWED_THROUGHPUT.values()):
            made.append(throughput_plot(series, out / "throughput.png"))
        staleness = list(staleness)
        if staleness:
            made.append(_staleness_histogram(staleness, out / "staleness.png"))
        for path in made:
            self.client.log_artifact(run_id, str(path), "plots")
        return made

    def end(self, status: str = "FINISHED") -> None:
        """Close the run with FINISHED, FAILED or KILLED (after its queued metrics are stored)."""
        if self.run_id is not None:
            try:
                self.flush()
            finally:  # closed even when a queued metric failed to store
                self.client.set_terminated(self.run_id, status=status)

    def _id(self) -> str:
        if self.run_id is None:
            raise RuntimeError("RunTracker: call start() first")
        return self.run_id


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


def _staleness_histogram(staleness: list[int], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    counts = Counter(staleness)
    values = sorted(counts)
    ax.bar(values, [counts[v] for v in values], width=0.8)
    ax.set(title=f"staleness of trained samples (n={len(staleness)})", xlabel="versions behind",
           ylabel="samples", xticks=values)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
