"""The lake as a run's sink: every sample (trained, untrained, failed, dropped, evaluation episodes),
every step, the run's lineage once per attempt (`runs`), checkpoints and evaluations, through one
`TrajectoryWriter`. A resumed run first rewinds its rows to the checkpoint it resumes from."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from factory.core.types import Batch
from factory.lake.catalog import open_catalog
from factory.lake.rows import dropped_row, evaluation_rows, failed_row, sample_row, sample_rows
from factory.lake.writer import TrajectoryWriter
from factory.recording.sinks import Sink

LAKE_BATCH_ROWS = 8192  # a table this far behind commits at once, whatever its interval


class LakeSink(Sink):
    keeps_all_samples = True
    rewinds = True

    def __init__(self, recipe, run_dir: Path, run_id: str, start_step: int) -> None:
        self.run_id = run_id
        self.start_step = start_step
        self.env = recipe.environment.name
        # a run started (or relaunched) while the catalog's database or the object store restarts waits for it
        catalog = open_catalog(recipe.lake.catalog or None, namespace=recipe.lake.namespace,
                               outage_deadline_s=recipe.deadlines.service_outage_s)
        # commits by time, not by a step's worth of rows: one per table every few seconds
        # an outage of the catalog or object store: rows wait (memory, then the run dir) while training goes on
        self.writer = TrajectoryWriter(catalog, recipe.lake.namespace, run_id=run_id, batch_rows=LAKE_BATCH_ROWS,
                                       flush_interval_s=recipe.lake.commit_interval_s,
                                       outage_deadline_s=recipe.deadlines.service_outage_s,
                                       spill_dir=run_dir / "lake-spill")
        self.rewound = self.writer.rewind(start_step)  # {table: rows deleted}; empty for a new run

    def snapshots(self) -> dict[str, int | None]:
        return self.writer.snapshot_ids()

    def metrics(self) -> dict[str, float]:
        return self.writer.metrics()

    def start(self, origin: dict[str, Any], ids: dict[str, Any]) -> None:
        self.writer.append("runs", [{
            "run_id": self.run_id, "start_step": self.start_step, "recipe_hash": origin["recipe_hash"],
            "recipe_yaml": origin["recipe_yaml"], "git_sha": origin["git_sha"],
            "git_dirty": str(origin["git_dirty"]).lower(), "base_policy_fingerprint": origin["base_policy_fingerprint"],
            "dagster_run_id": origin.get("dagster_run_id"), "mlflow_run_id": ids.get("mlflow_run_id"),
            "parent": origin.get("parent_run_id") or origin.get("sweep_run_id"),
            "origin": {k: v for k, v in origin.items() if k != "recipe_yaml"},
        }])

    def samples(self, step: int, batch: Batch | None = None, discarded: Sequence = (), failed: Sequence = (),
                dropped: Sequence = ()) -> None:
        if batch is not None:
            self.writer.append("samples", sample_rows(batch, self.run_id, step))
        if discarded or failed:
            rows = [sample_row(sample, self.run_id, status, step, info={"reason": reason})
                    for status, sample, reason in discarded]
            rows += [failed_row(self.run_id, group_id, f.task_id, f.env, f.error, step) for group_id, f in failed]
            self.writer.append("samples", rows)
        if dropped:
            self.writer.append("samples", [dropped_row(self.run_id, task, self.env, why) for task, why in dropped])

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self.writer.append("steps", [{"run_id": self.run_id, "step": step, "metrics": metrics}])

    def checkpoint(self, step: int, version: int, path: Path, manifest: dict[str, Any]) -> None:
        self.writer.append("checkpoints", [{"run_id": self.run_id, "step": step, "version": version,
                                            "path": str(path), "lineage": manifest}])

    def evaluation(self, step: int, version: int, suite: str, tag: str, result: dict[str, Any], episodes: list | None,
                   checkpoint: Path | None, manifest: dict[str, Any]) -> None:
        if episodes:  # ids `eval-{step}-{tag}-…`: two evaluations of one run never share one
            self.writer.append("samples", evaluation_rows(self.run_id, step, version, suite, tag, episodes))
        self.writer.append("evaluations", [{
            "run_id": self.run_id, "step": step, "version": version, "suite": suite, "n": result["n"],
            "mean": result["mean"], "stderr": result["stderr"], "by_family": json.dumps(result["by_family"]),
            "tasks_digest": result.get("tasks_digest"),
            "checkpoint": str(checkpoint) if checkpoint is not None else None,  # None: the base policy (step 0)
            "lineage": manifest,
        }])

    def flush(self, checkpoint_step: int | None = None) -> None:
        self.writer.flush()
        if checkpoint_step is not None:  # the writer forgets the keys of the rows before the checkpoint
            self.writer.committed_through(self.run_id, checkpoint_step)

    def finish(self, results: dict[str, Any] | None, status: str) -> None:
        self.writer.close()
