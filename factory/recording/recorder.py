"""Where a run's outputs go: files in the run directory always; the Iceberg lake and MLflow when
the recipe enables them. The loop calls one `RunRecorder`, which hands every record to its sinks
(`factory.recording.sinks`) and never knows which are on."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path
from typing import Any

from factory.core.types import Batch
from factory.recording import lineage
from factory.recording.sinks import RunFiles, Sink


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
    """Fans each step's batch and metrics out to its sinks: run-dir files, the lake and MLflow.

    The run's lineage is computed here once (`origin`), from the recipe and the base policy the caller
    names (`base_policy`, set once it exists), and handed to every sink.

    A run resumed from a checkpoint (`resume_from`) continues the same lake partition and MLflow
    run; first the lake is rewound to the checkpoint (rows of later steps, written by the attempt
    that crashed, are deleted), so every step and sample is recorded once, from the attempt whose
    training the checkpoint chain holds.
    """

    def __init__(self, recipe, run_dir: Path, run_id: str | None = None, resume_from: Path | None = None,
                 base_policy: Path | None = None):
        self.dir = run_dir
        self.run_id = run_id or run_dir.name
        self.recipe = recipe
        self.base_policy = base_policy
        self._origin: dict[str, Any] | None = None  # lineage.origin, once the base policy exists
        start = checkpoint_version(resume_from) if resume_from is not None else 0
        self.start_step = start
        self.step = start  # the last step logged
        self.sinks: list[Sink] = [RunFiles(recipe, run_dir)]
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder")
        self._queued: list[concurrent.futures.Future] = []
        self.lake = None  # the lake's TrajectoryWriter, with the lake
        self.tracker = None  # the MLflow RunTracker, with tracking
        self.rewound: dict[str, int] = {}
        if recipe.lake.enabled:
            from factory.lake.sink import LakeSink

            lake = LakeSink(recipe, run_dir, self.run_id, start)
            self.sinks.append(lake)
            self.lake, self.rewound = lake.writer, lake.rewound  # {table: rows deleted}; empty for a new run
        if recipe.tracking.enabled:
            from factory.recording.tracking import TrackingSink

            tracking = TrackingSink(recipe, run_dir, self.run_id, resumed_from=start if resume_from is not None else None,
                                    parent_run_id=lineage.context().get("mlflow_parent_run_id"))
            self.sinks.append(tracking)
            self.tracker = tracking.tracker
        if resume_from is not None and any(s.rewinds for s in self.sinks):  # its row may not have been committed
            self.log_checkpoint(start, start, Path(resume_from))

    # ---- samples: written by one background thread, in order, off the training loop ----------------

    def _submit(self, fn, *args) -> None:
        """Run `fn(*args)` on the recorder's thread after everything submitted before; an error it
        raised surfaces here (or at `drain`)."""
        done = [f for f in self._queued if f.done()]
        self._queued = [f for f in self._queued if not f.done()]
        for f in done:
            f.result()
        self._queued.append(self._worker.submit(fn, *args))

    def drain(self) -> None:
        """Wait until every submitted sample is handed to the sinks (files written, lake rows queued)."""
        queued, self._queued = self._queued, []
        for f in queued:
            f.result()

    def _samples(self, step: int, batch: Batch | None = None, discarded=(), failed=(), dropped=()) -> None:
        for sink in self.sinks:
            sink.samples(step, batch, discarded, failed, dropped)

    def log_batch(self, batch: Batch, step: int) -> None:
        """The samples a step trained on: samples.jsonl and the lake (on the recorder's thread)."""
        self._submit(self._samples, step, batch)

    @property
    def keeps_all_samples(self) -> bool:
        """Whether untrained samples (discarded, failed, evaluation episodes) are recorded: with the lake."""
        return any(s.keeps_all_samples for s in self.sinks)

    def log_discarded(self, step: int, discarded, failed: list | None = None) -> None:
        """Samples that will never be trained, recorded at `step` with their fate: `discarded` as the
        buffer hands them out ((status, sample, reason)), `failed` as (group id, EpisodeFailure); or
        `discarded` is a callable returning the pair (e.g. fetching it from the buffer actor), called on
        the recorder's thread."""
        if self.keeps_all_samples:
            self._submit(self._write_discarded, step, discarded, failed)

    def _write_discarded(self, step: int, discarded, failed: list | None) -> None:
        if failed is None:  # a callable that fetches (discarded, failed)
            discarded, failed = discarded()
        if discarded or failed:
            self._samples(step, discarded=discarded, failed=failed)

    def log_dropped(self, dropped: list[tuple[str, str]]) -> None:
        """Tasks left out at the run's start ((task id, why) each: `data.overlong: drop`), one `dropped`
        row each at step 0 (a resumed run's are known keys: not recorded twice)."""
        if self.keeps_all_samples and dropped:
            self._submit(self._samples, 0, None, (), (), dropped)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self.step = step
        self.origin()
        for sink in self.sinks:
            metrics = {**metrics, **sink.metrics()}
        for sink in self.sinks:
            sink.step(step, metrics)

    def _ids(self) -> dict[str, Any]:
        return {k: v for sink in self.sinks for k, v in sink.ids().items()}

    def origin(self) -> dict[str, Any]:
        """The run's lineage (`factory.recording.lineage.origin`). First called once the base policy exists (the
        first evaluation, step or checkpoint); then handed to every sink: a `runs` row per attempt, MLflow tags."""
        if self._origin is None:
            self._origin = lineage.origin(self.recipe, self.base_policy)
            ids = self._ids()
            for sink in self.sinks:
                sink.start(self._origin, ids)
        return self._origin

    def checkpoint_lineage(self, step: int, version: int) -> dict[str, Any]:
        """What a checkpoint (or an evaluation of one) at `step` came from; the lake's snapshots are
        read after `flush`, so they hold every sample trained up to it."""
        snapshots = {k: v for sink in self.sinks for k, v in sink.snapshots().items()}
        return lineage.checkpoint_manifest(self.run_id, step, version, self.origin(), snapshots,
                                           self._ids().get("mlflow_run_id"))

    def _manifest(self, checkpoint: Path, step: int, version: int) -> dict[str, Any]:
        """A checkpoint's manifest: the one in it (a resumed run keeps its first attempt's), else made now."""
        if (checkpoint / "manifest.json").is_file():
            return lineage.read_manifest(checkpoint)
        return self.checkpoint_lineage(step, version)

    def log_checkpoint(self, step: int, version: int, path: Path) -> None:
        """Record a checkpoint: its manifest (`manifest.json` in it; a resumed run keeps the one its
        first attempt wrote) and a `checkpoints` row carrying the same."""
        path = Path(path)
        manifest = self._manifest(path, step, version)
        for sink in self.sinks:
            sink.checkpoint(step, version, path, manifest)

    def flush(self, checkpoint_step: int | None = None) -> None:
        """Wait until the lake has committed every row recorded so far and MLflow holds every step logged
        so far (before a checkpoint is saved: a run resumed from it re-sends nothing up to it, and a
        crashed attempt's unsent steps are only those past it). Before the checkpoint of
        `checkpoint_step`, the lake writer then forgets the keys of the rows before it
        (`committed_through`): its memory holds a checkpoint interval's keys, not a run of days'."""
        self.drain()
        for sink in self.sinks:
            sink.flush(checkpoint_step)

    def log_evaluation(self, step: int, version: int, suite: str, result: dict[str, Any], episodes: list | None = None,
                       tag: str = "") -> None:
        """An evaluation's summary, and (lake) its episodes as `evaluation` samples with ids
        `eval-{step}-{tag}-…`, so two evaluations of one run never share an id."""
        checkpoint = self.dir / "checkpoints" / f"step-{step:06d}"
        manifest = self._manifest(checkpoint, step, version)
        for sink in self.sinks:
            sink.evaluation(step, version, suite, tag, result, episodes,
                            checkpoint if checkpoint.is_dir() else None, manifest)  # step 0: the base policy

    def fail(self) -> None:
        """Close what is open after a crash: committed lake rows stay, MLflow marks the run FAILED."""
        try:
            self.drain()
        except Exception:  # noqa: BLE001  (the original error matters more)
            pass
        self._worker.shutdown()
        for sink in self.sinks:
            try:
                sink.finish(None, "FAILED")
            except Exception:  # the original error matters more than a failed last flush or metric
                pass

    def finish(self, results: dict[str, Any], status: str = "FINISHED") -> None:
        self.drain()
        self._worker.shutdown()
        self.origin()
        for sink in self.sinks:
            sink.finish(results, status)
