"""Where a run's records go: the `Sink` every destination implements (the run directory's files here,
the lake in `factory.lake.sink`, MLflow in `factory.recording.tracking`). `RunRecorder` hands each
record to every sink the same way; a sink does nothing with what it does not keep.

The run's lineage is computed by the recorder and handed down (`start`, and a manifest with each
checkpoint and evaluation); a sink hands up only the ids lineage names it by (`ids`, `snapshots`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from factory.core.types import Batch
from factory.recording import lineage


class Sink:
    """One destination of a run's records; each method does nothing unless the sink keeps that record."""

    keeps_all_samples = False  # records untrained samples (discarded, failed, dropped, evaluation episodes)
    rewinds = False  # a resumed run rewinds its records to the checkpoint, which it then records again

    def ids(self) -> dict[str, Any]:
        """The ids the run's lineage names this sink's records by (e.g. {"mlflow_run_id": …})."""
        return {}

    def snapshots(self) -> dict[str, int | None]:
        """Snapshot ids of the tables holding the run's records so far (read after `flush`)."""
        return {}

    def metrics(self) -> dict[str, float]:
        """The sink's own health (outage seconds, queued rows…), recorded with each step's metrics."""
        return {}

    def start(self, origin: dict[str, Any], ids: dict[str, Any]) -> None:
        """The run's lineage (`lineage.origin`), once, with every sink's `ids`."""

    def samples(self, step: int, batch: Batch | None = None, discarded: Sequence = (), failed: Sequence = (),
                dropped: Sequence = ()) -> None:
        """Samples recorded at `step`, on the recorder's thread: the batch trained; untrained ones as the
        buffer hands them out ((status, sample, reason) each), failed groups ((group id, EpisodeFailure)),
        tasks dropped at the start ((task id, why))."""

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        """One step's metrics (every sink's own included)."""

    def checkpoint(self, step: int, version: int, path: Path, manifest: dict[str, Any]) -> None:
        """A checkpoint at `path` and its lineage manifest."""

    def evaluation(self, step: int, version: int, suite: str, tag: str, result: dict[str, Any], episodes: list | None,
                   checkpoint: Path | None, manifest: dict[str, Any]) -> None:
        """An evaluation's summary and episodes; `checkpoint` the one evaluated (None: the base policy)."""

    def flush(self, checkpoint_step: int | None = None) -> None:
        """Wait until everything recorded so far is stored (before the checkpoint of `checkpoint_step`)."""

    def finish(self, results: dict[str, Any] | None, status: str) -> None:
        """Close: a run that ended (`results`, FINISHED) or one that crashed (None, FAILED)."""


class RunFiles(Sink):
    """The run directory: recipe.yaml, metrics.jsonl (every step), samples.jsonl (trained samples),
    results.json, and each checkpoint's manifest.json."""

    def __init__(self, recipe, run_dir: Path) -> None:
        self.dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(recipe.to_yaml())
        self.metrics_file = open(run_dir / "metrics.jsonl", "a")
        self.samples_file = open(run_dir / "samples.jsonl", "a")

    def samples(self, step: int, batch: Batch | None = None, discarded: Sequence = (), failed: Sequence = (),
                dropped: Sequence = ()) -> None:
        if batch is None:
            return
        for s in batch.samples:
            row = s.to_dict()
            row.update(trained_step=step, trained_version=batch.version, staleness=batch.version - s.oldest_version)
            self.samples_file.write(json.dumps(row) + "\n")
        self.samples_file.flush()

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()

    def checkpoint(self, step: int, version: int, path: Path, manifest: dict[str, Any]) -> None:
        # a resumed run keeps the manifest its first attempt wrote
        if path.is_dir() and not (path / "manifest.json").is_file():
            lineage.write_manifest(path, manifest)

    def finish(self, results: dict[str, Any] | None, status: str) -> None:
        if results is not None:
            (self.dir / "results.json").write_text(json.dumps(results, indent=2))
        self.metrics_file.close()
        self.samples_file.close()
