"""Where a run's outputs go: files in the run directory always; the Iceberg lake and MLflow when
the recipe enables them. The loop calls one `RunRecorder` and never knows which are on."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from factory.recording import lineage
from factory.core.types import Batch

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # values in MLflow's UI: genai_development, custom_model_development
LAKE_BATCH_ROWS = 8192  # a table this far behind commits at once, whatever its interval


def checkpoint_version(checkpoint: Path) -> int:
    """The policy version (= optimizer steps taken) a checkpoint holds: a resumed run trains from version + 1."""
    return int(json.loads((Path(checkpoint) / "state.json").read_text())["version"])


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (a checkpoint dir is renamed into place when whole)."""
    found = []
    for path in (Path(run_dir) / "checkpoints").glob("step-*"):
        step = path.name.removeprefix("step-")
        if path.is_dir() and step.isdigit():
            found.append((int(step), path))
    return [path for _, path in sorted(found)]


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints of a run (0: keep all); return the deleted.
    Each is first renamed out of the `step-*` names, so a checkpoint half deleted (a crash meanwhile) is
    never resumed from; what such a crash left is deleted here next time."""
    if keep <= 0:
        return []
    folder = Path(run_dir) / "checkpoints"
    for left in folder.glob(".pruned-step-*"):
        shutil.rmtree(left, ignore_errors=True)
    old = checkpoints(run_dir)[:-keep]
    for path in old:
        doomed = path.with_name(f".pruned-{path.name}")
        path.rename(doomed)
        shutil.rmtree(doomed)
    return old


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


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
        self.recipe = recipe
        self._origin: dict[str, Any] | None = None  # lineage.origin, once the base policy exists
        self.tracker = None
        start = checkpoint_version(resume_from) if resume_from is not None else 0
        self.start_step = start
        self.step = start  # the last step logged
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(recipe.to_yaml())
        self.metrics_file = open(run_dir / "metrics.jsonl", "a")
        self.samples_file = open(run_dir / "samples.jsonl", "a")
        self.staleness: Counter[int] = Counter()  # trained samples by staleness (counts: runs last days)
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder")
        self._queued: list[concurrent.futures.Future] = []
        self.lake = None
        self.rewound: dict[str, int] = {}
        if recipe.lake.enabled:
            from factory.lake.catalog import open_catalog
            from factory.lake.writer import TrajectoryWriter

            # a run started (or relaunched) while the catalog's database or the object store restarts waits for it
            catalog = open_catalog(recipe.lake.catalog or None, namespace=recipe.lake.namespace,
                                   outage_deadline_s=recipe.deadlines.service_outage_s)
            # commits by time, not by a step's worth of rows: one per table every few seconds
            # an outage of the catalog or object store: rows wait (memory, then the run dir) while training goes on
            self.lake = TrajectoryWriter(catalog, recipe.lake.namespace, run_id=self.run_id, batch_rows=LAKE_BATCH_ROWS,
                                         flush_interval_s=recipe.lake.commit_interval_s,
                                         outage_deadline_s=recipe.deadlines.service_outage_s,
                                         spill_dir=run_dir / "lake-spill")
            self.rewound = self.lake.rewind(start)  # {table: rows deleted}; empty for a new run
        if recipe.tracking.enabled:
            from factory.recording.tracking import RunTracker

            self.tracker = RunTracker(recipe.tracking.uri, recipe.tracking.experiment,
                                      outage_deadline_s=recipe.deadlines.service_outage_s,
                                      spill_path=run_dir / "tracking-spill.jsonl")
            resume = self.tracker.find_run(self.run_id)  # a relaunched run continues its MLflow run
            tags = {"factory.resumed_from_step": str(start)} if resume_from is not None else {}
            if lineage.context().get("mlflow_parent_run_id"):  # a sweep's child run
                tags["mlflow.parentRunId"] = lineage.context()["mlflow_parent_run_id"]
            self.tracker.start(self.run_id, params=recipe.dump(), tags=tags, resume_run_id=resume)
            # MLflow 3's UI opens an experiment without this tag on its GenAI (traces) view; ours hold training runs
            self.tracker.set_experiment_tag(EXPERIMENT_KIND_TAG, "custom_model_development")
        if resume_from is not None and self.lake is not None:  # its row may not have been committed before the crash
            self.log_checkpoint(start, start, Path(resume_from))

    # ---- sample rows: written by one background thread, in order, off the training loop ------------

    def _submit(self, fn, *args) -> None:
        """Run `fn(*args)` on the recorder's thread after everything submitted before; an error it
        raised surfaces here (or at `drain`)."""
        done = [f for f in self._queued if f.done()]
        self._queued = [f for f in self._queued if not f.done()]
        for f in done:
            f.result()
        self._queued.append(self._worker.submit(fn, *args))

    def drain(self) -> None:
        """Wait until every submitted sample row is written (files) and handed to the lake writer."""
        queued, self._queued = self._queued, []
        for f in queued:
            f.result()

    def log_batch(self, batch: Batch, step: int) -> None:
        """The samples a step trained on: samples.jsonl and the lake (on the recorder's thread)."""
        self._submit(self._write_batch, batch, step)

    def _write_batch(self, batch: Batch, step: int) -> None:
        for s in batch.samples:
            row = s.to_dict()
            row.update(trained_step=step, trained_version=batch.version, staleness=batch.version - s.oldest_version)
            self.samples_file.write(json.dumps(row) + "\n")
            self.staleness[row["staleness"]] += 1
        self.samples_file.flush()
        if self.lake is not None:
            from factory.lake.writer import sample_rows

            self.lake.append("samples", sample_rows(batch, self.run_id, step))

    @property
    def keeps_all_samples(self) -> bool:
        """Whether untrained samples (discarded, failed, evaluation episodes) are recorded: with the lake."""
        return self.lake is not None

    def log_discarded(self, step: int, discarded, failed: list | None = None) -> None:
        """Samples that will never be trained, recorded at `step` with their fate: `discarded` as the
        buffer hands them out ((status, sample, reason)), `failed` as (group id, EpisodeFailure); or
        `discarded` is a callable returning the pair (e.g. fetching it from the buffer actor), called on
        the recorder's thread."""
        if self.lake is not None:
            self._submit(self._write_discarded, step, discarded, failed)

    def _write_discarded(self, step: int, discarded, failed: list | None) -> None:
        if failed is None:  # a callable that fetches (discarded, failed)
            discarded, failed = discarded()
        if not (discarded or failed):
            return
        assert self.lake is not None  # log_discarded submits this only with a lake
        from factory.lake.writer import failed_row, sample_row

        rows = [sample_row(sample, self.run_id, status, step, info={"reason": reason})
                for status, sample, reason in discarded]
        rows += [failed_row(self.run_id, group_id, f.task_id, f.env, f.error, step) for group_id, f in failed]
        self.lake.append("samples", rows)

    def log_dropped(self, dropped: list[tuple[str, str]]) -> None:
        """Tasks left out at the run's start ((task id, why) each: `data.overlong: drop`), one `dropped`
        row each at step 0 (a resumed run's are known keys: not recorded twice)."""
        if self.lake is not None and dropped:
            from factory.lake.writer import dropped_row

            env = self.recipe.environment.name
            self._submit(self.lake.append, "samples", [dropped_row(self.run_id, task, env, why) for task, why in dropped])

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self.step = step
        self.origin()
        if self.lake is not None:
            metrics = {**metrics, **self.lake.metrics()}
        if self.tracker is not None:  # tracking/outage_s: how long MLflow was unreachable so far
            metrics = {**metrics, **self.tracker.metrics()}
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()
        if self.lake is not None:
            self.lake.append("steps", [{"run_id": self.run_id, "step": step, "metrics": metrics}])
        if self.tracker is not None:
            self.tracker.log_metrics(step, metrics)

    def origin(self) -> dict[str, Any]:
        """The run's lineage (`factory.recording.lineage.origin`). First called once the base policy exists (the
        first evaluation, step or checkpoint); then recorded: a `runs` row per attempt, MLflow tags."""
        if self._origin is None:
            from factory.model.policy_cache import base_policy_path

            self._origin = lineage.origin(self.recipe, base_policy_path(self.recipe))  # never builds one
            mlflow_run_id = self.tracker.run_id if self.tracker is not None else None
            if self.lake is not None:
                o = self._origin
                self.lake.append("runs", [{
                    "run_id": self.run_id, "start_step": self.start_step, "recipe_hash": o["recipe_hash"],
                    "recipe_yaml": o["recipe_yaml"], "git_sha": o["git_sha"], "git_dirty": str(o["git_dirty"]).lower(),
                    "base_policy_fingerprint": o["base_policy_fingerprint"], "dagster_run_id": o.get("dagster_run_id"),
                    "mlflow_run_id": mlflow_run_id, "parent": o.get("parent_run_id") or o.get("sweep_run_id"),
                    "origin": {k: v for k, v in o.items() if k != "recipe_yaml"},
                }])
            if self.tracker is not None:
                self.tracker.set_tags(lineage.mlflow_tags(self._origin))
        return self._origin

    def checkpoint_lineage(self, step: int, version: int) -> dict[str, Any]:
        """What a checkpoint (or an evaluation of one) at `step` came from; the lake's snapshots are
        read after `flush`, so they hold every sample trained up to it."""
        snapshots = self.lake.snapshot_ids() if self.lake is not None else {}
        return lineage.checkpoint_manifest(self.run_id, step, version, self.origin(), snapshots,
                                           self.tracker.run_id if self.tracker is not None else None)

    def log_checkpoint(self, step: int, version: int, path: Path) -> None:
        """Record a checkpoint: its manifest (`manifest.json` in it; a resumed run keeps the one its
        first attempt wrote) and a `checkpoints` row carrying the same."""
        path = Path(path)
        if (path / "manifest.json").is_file():
            manifest = lineage.read_manifest(path)
        else:
            manifest = self.checkpoint_lineage(step, version)
            if path.is_dir():
                lineage.write_manifest(path, manifest)
        if self.lake is not None:
            self.lake.append("checkpoints", [{"run_id": self.run_id, "step": step, "version": version,
                                              "path": str(path), "lineage": manifest}])

    def flush(self, checkpoint_step: int | None = None) -> None:
        """Wait until the lake has committed every row recorded so far and MLflow holds every step logged
        so far (before a checkpoint is saved: a run resumed from it re-sends nothing up to it, and a
        crashed attempt's unsent steps are only those past it). Before the checkpoint of
        `checkpoint_step`, the lake writer then forgets the keys of the rows before it
        (`committed_through`): its memory holds a checkpoint interval's keys, not a run of days'."""
        self.drain()
        if self.lake is not None:
            self.lake.flush()
            if checkpoint_step is not None:
                self.lake.committed_through(self.run_id, checkpoint_step)
        if self.tracker is not None:
            self.tracker.flush()

    def log_evaluation(self, step: int, version: int, suite: str, result: dict[str, Any], episodes: list | None = None,
                       tag: str = "") -> None:
        """An evaluation's summary, and (lake) its episodes as `evaluation` samples with ids
        `eval-{step}-{tag}-…`, so two evaluations of one run never share an id."""
        if self.lake is not None and episodes:
            from factory.lake.writer import evaluation_rows

            self.lake.append("samples", evaluation_rows(self.run_id, step, version, suite, tag, episodes))
        if self.lake is not None:
            checkpoint = self.dir / "checkpoints" / f"step-{step:06d}"
            self.lake.append("evaluations", [{
                "run_id": self.run_id, "step": step, "version": version, "suite": suite, "n": result["n"],
                "mean": result["mean"], "stderr": result["stderr"], "by_family": json.dumps(result["by_family"]),
                "tasks_digest": result.get("tasks_digest"),
                "checkpoint": str(checkpoint) if checkpoint.is_dir() else None,  # step 0: the base policy
                "lineage": lineage.read_manifest(checkpoint) if (checkpoint / "manifest.json").is_file()
                else self.checkpoint_lineage(step, version),
            }])
        if self.tracker is not None:
            self.tracker.log_metrics(step, {f"eval/{suite}_mean": result["mean"], f"eval/{suite}_stderr": result["stderr"]})

    def fail(self) -> None:
        """Close what is open after a crash: committed lake rows stay, MLflow marks the run FAILED."""
        try:
            self.drain()
        except Exception:  # noqa: BLE001  (the original error matters more)
            pass
        self._worker.shutdown()
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
        self.drain()
        self._worker.shutdown()
        self.origin()
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
