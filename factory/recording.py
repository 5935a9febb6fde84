"""Where a run's outputs go: files in the run directory always; the Iceberg lake and MLflow when
the recipe enables them. The loop calls one `RunRecorder` and never knows which are on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from factory.types import Batch

LAKE_BATCH_ROWS = 8192  # a table this far behind commits at once, whatever its interval


def checkpoint_version(checkpoint: Path) -> int:
    """The policy version (= optimizer steps taken) a checkpoint holds: a resumed run trains from version + 1."""
    return int(json.loads((Path(checkpoint) / "state.json").read_text())["version"])


class RunRecorder:
    """Fans each step's batch and metrics out to run-dir files, the lake and MLflow.

    A run resumed from a checkpoint (`resume_from`) continues the same lake partition and MLflow
    run; first the lake is rewound to the checkpoint (rows of later steps, written by the attempt
    that crashed, are deleted), so every step and sample is recorded once, from the attempt whose
    training the checkpoint chain holds.
    """

    def __init__(self, recipe, run_dir: Path, run_id: str | None = None, resume_from: Path | None = None):
        self.dir = run_dir
        self.run_id = run_id or run_dir.name
        start = checkpoint_version(resume_from) if resume_from is not None else 0
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(recipe.to_yaml())
        self.metrics_file = open(run_dir / "metrics.jsonl", "a")
        self.samples_file = open(run_dir / "samples.jsonl", "a")
        self.staleness: list[int] = []
        self.lake = None
        self.rewound: dict[str, int] = {}
        if recipe.lake.enabled:
            from factory.lake.catalog import open_catalog
            from factory.lake.writer import TrajectoryWriter

            catalog = open_catalog(recipe.lake.catalog or None, namespace=recipe.lake.namespace)
            # commits by time, not by a step's worth of rows: one per table every few seconds
            self.lake = TrajectoryWriter(catalog, recipe.lake.namespace, run_id=self.run_id, batch_rows=LAKE_BATCH_ROWS,
                                         flush_interval_s=recipe.lake.commit_interval_s)
            self.rewound = self.lake.rewind(start)  # {table: rows deleted}; empty for a new run
            if resume_from is not None:  # its row may not have been committed before the crash
                self.log_checkpoint(start, start, Path(resume_from))
        self.tracker = None
        if recipe.tracking.enabled:
            from factory.tracking import RunTracker

            self.tracker = RunTracker(recipe.tracking.uri, recipe.tracking.experiment)
            resume = self.tracker.find_run(self.run_id)  # a relaunched run continues its MLflow run
            tags = {"factory.resumed_from_step": str(start)} if resume_from is not None else {}
            self.tracker.start(self.run_id, params=recipe.dump(), tags=tags, resume_run_id=resume)

    def log_batch(self, batch: Batch, step: int) -> None:
        for s in batch.samples:
            row = s.to_dict()
            row.update(trained_step=step, trained_version=batch.version, staleness=batch.version - s.oldest_version)
            self.samples_file.write(json.dumps(row) + "\n")
            self.staleness.append(row["staleness"])
        self.samples_file.flush()
        if self.lake is not None:
            from factory.lake.writer import sample_rows

            self.lake.append("samples", sample_rows(batch, self.run_id, step))

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        if self.lake is not None:
            metrics = {**metrics, **self.lake.metrics()}
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()
        if self.lake is not None:
            self.lake.append("steps", [{"run_id": self.run_id, "step": step, "metrics": metrics}])
        if self.tracker is not None:
            self.tracker.log_metrics(step, metrics)

    def log_checkpoint(self, step: int, version: int, path: Path) -> None:
        if self.lake is not None:
            self.lake.append("checkpoints", [{"run_id": self.run_id, "step": step, "version": version,
                                              "path": str(path)}])

    def flush(self) -> None:
        """Wait until the lake has committed every row recorded so far (before a checkpoint is saved:
        a run resumed from it re-sends nothing up to it)."""
        if self.lake is not None:
            self.lake.flush()

    def log_evaluation(self, step: int, version: int, suite: str, result: dict[str, Any]) -> None:
        if self.lake is not None:
            self.lake.append("evaluations", [{
                "run_id": self.run_id, "step": step, "version": version, "suite": suite, "n": result["n"],
                "mean": result["mean"], "stderr": result["stderr"], "by_family": json.dumps(result["by_family"]),
                "tasks_digest": result.get("tasks_digest"),
            }])
        if self.tracker is not None:
            self.tracker.log_metrics(step, {f"eval/{suite}_mean": result["mean"], f"eval/{suite}_stderr": result["stderr"]})

    def fail(self) -> None:
        """Close what is open after a crash: committed lake rows stay, MLflow marks the run FAILED."""
        self.metrics_file.close()
        self.samples_file.close()
        if self.lake is not None:
            try:
                self.lake.close()
            except Exception:  # the original error matters more than a failed last flush
                pass
        if self.tracker is not None:
            try:
                self.tracker.end("FAILED")
            except Exception:  # as above: a metric that failed to store must not hide the crash
                pass

    def finish(self, results: dict[str, Any], status: str = "FINISHED") -> None:
        (self.dir / "results.json").write_text(json.dumps(results, indent=2))
        self.metrics_file.close()
        self.samples_file.close()
        if self.lake is not None:
            self.lake.close()
        if self.tracker is not None:
            self.tracker.log_plots(self.dir / "metrics.jsonl", self.staleness)
            for name in ("recipe.yaml", "results.json"):
                self.tracker.log_artifact(self.dir / name)
            self.tracker.end(status)
