"""TrajectoryWriter: stream rows into the lake's Iceberg tables, each key committed exactly once.

Rows are validated against the table's Arrow schema when appended (errors reach the caller), then
batched; a background thread commits a table's batch when it holds `batch_rows` rows or its oldest
row is `flush_interval_s` old. Each commit is one Iceberg append whose snapshot summary carries
`factory.batch` (an idempotency key) and `factory.position.<run_id>` (the highest position column
value — `step` — in the batch).

Exactly once across restarts: row keys are deterministic (`schemas.TableSpec.key`, e.g.
(run_id, sample_id)); the first time a writer sees a partition (`TableSpec.scope`: a run, or a
dataset for tasks) in a table it reads that partition's committed keys back and from then on drops
any row whose key is committed or pending. A crashed writer loses only its uncommitted rows, which
the restarted run re-sends. A run resumed from a checkpoint first rewinds its partitions to it
(`rewind`), so the steps it trains again are recorded once, from the attempt that trained them.

A run of days records millions of rows, so a run's writer does not hold every key: `rewind(p)` and
`committed_through(run, p)` set the run's floor, below which every row of the run is committed
(rewound to it, or flushed before a checkpoint). Keys below the floor are forgotten, a row appended
below it is dropped as a re-send (counted in `lake/skipped_rows`), and reading keys back scans only
the run's rows at or above it (a relaunch after days reads a checkpoint's worth, not the run).

Commits that conflict with another writer are retried by reloading the table, with backoff, up to
`max_retries` times beyond PyIceberg's own retries. So is a table metadata file that reads as gone or
cut short (`unreadable_metadata`): the catalog pointed at it, and concurrent commits replaced and
deleted it before the read ended. Before each retry the writer reloads the table
and checks (by `factory.batch`) that the batch did not land, so a commit whose response was lost is
not written twice.

Outages of the catalog (its database) or the object store are retried with backoff and jitter
(`factory.recording.outage`) for up to `outage_deadline_s`; reads the caller makes (committed keys, positions,
snapshot ids) wait the same way. Meanwhile `append` keeps accepting rows: at most
`max_pending_bytes` wait in memory, the rest spill to `spill_dir` as Arrow files, committed (one
commit each, oldest first) once the service answers. `lake/outage_s` reports the time spent in
outages. Past the deadline the writer stops with a one-line `ServiceOutage` naming the service;
what was still pending is in `spill_dir`.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, ValidationError, ValidationException
from pyiceberg.expressions import AlwaysTrue, And, BooleanExpression, EqualTo, GreaterThan, GreaterThanOrEqual
from pyiceberg.table import Table

from factory.support.failures import ServiceOutage
from factory.lake.catalog import open_catalog, service_of, transient
from factory.lake.maintenance import expire_snapshots
from factory.lake.schemas import NAMESPACE, TABLES, TableSpec, table_spec
from factory.lake.rows import (dropped_row, evaluation_rows, failed_row, normalize,  # noqa: F401  (imported from here)
                               sample_row, sample_rows)
from factory.recording.outage import GuardedClient, Outage, backoff_s, first_line

log = logging.getLogger(__name__)

BATCH_PROPERTY = "factory.batch"
WRITER_PROPERTY = "factory.writer"
POSITION_PROPERTY = "factory.position."  # + run_id
REWIND_PROPERTY = "factory.rewind"  # a run's rows beyond this position were deleted (resume from a checkpoint)

# A concurrent commit, or a concurrent expiry removed the snapshot this append started from: reload
# and re-send (after checking that an earlier attempt did not land after all).
_CONFLICT = (CommitFailedException, ValidationException)
MAX_PENDING_BYTES = 64 << 20  # rows waiting in memory while a table cannot commit; more spill to disk


def unreadable_metadata(error: BaseException) -> bool:
    """Reading a table's metadata file found it gone, or parsed a cut-short file: other writers'
    commits replaced it and deleted it (`write.metadata.previous-versions-max`) between the catalog's
    answer and the read. The catalog points elsewhere now; reloading reads that."""
    if isinstance(error, FileNotFoundError):
        return ".metadata.json" in str(error)
    return isinstance(error, ValidationError)  # PyIceberg's: its metadata's JSON did not parse


class LakeWriteError(RuntimeError):
    """A batch could not be committed after all retries (its rows stay pending)."""


class TrajectoryWriter(GuardedClient):
    """Batching, retrying, exactly-once stream writer for the lake tables.

    Usage: `w = TrajectoryWriter(run_id=...)`; `w.append("samples", rows)` any number of times;
    `w.flush()` to wait for everything appended so far to be committed; `w.close()` at the end.
    """

    _transient = staticmethod(transient)

    def __init__(self, catalog: Catalog | None = None, namespace: str = NAMESPACE, run_id: str | None = None,
                 *, batch_rows: int = 64, flush_interval_s: float = 2.0, expire_every: int = 20,
                 keep_snapshots: int = 5, max_retries: int = 30, outage_deadline_s: float = 300.0,
                 spill_dir: Path | None = None, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.catalog = catalog if catalog is not None else open_catalog(namespace=namespace)
        self.namespace = namespace
        self.run_id = run_id
        self.batch_rows = batch_rows
        self.flush_interval_s = flush_interval_s
        # metadata (deep-copied several times per commit) grows with snapshots: expiring them keeps commits flat
        self.expire_every = expire_every  # 0 disables expiry
        self.keep_snapshots = keep_snapshots
        self.max_retries = max_retries
        self.writer_id = uuid.uuid4().hex
        self.outage = Outage(self._service_of, outage_deadline_s)
        # without a spill dir, rows wait in memory however long the outage
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self.max_pending_bytes = max_pending_bytes
        if self.spill_dir is not None:
            # a previous attempt's spill holds rows past its last checkpoint (a checkpoint waits for every
            # row before it to be committed): the resumed run rewinds to it and records them anew
            shutil.rmtree(self.spill_dir, ignore_errors=True)

        self._lock = threading.Condition()
        self._pending: dict[str, list[pa.Table]] = defaultdict(list)
        self._pending_rows: dict[str, int] = defaultdict(int)
        self._pending_since: dict[str, float] = {}
        self._pending_bytes: dict[str, int] = defaultdict(int)
        self._spilled: dict[str, list[tuple[Path, int]]] = defaultdict(list)  # table → (Arrow file, rows), oldest first
        self._spills = 0
        # (table, scope value) → {key: position} of the rows committed or pending (at or above the run's floor)
        self._keys: dict[tuple[str, str | None], dict[tuple, Any]] = {}
        self._floors: dict[str, int] = {}  # run_id → the position below which every row of the run is committed
        self._tables: dict[str, Table] = {}  # used by the commit thread only
        self._flushing = 0  # callers waiting in flush(): commit everything now
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._gave_up: ServiceOutage | None = None  # an outage passed its deadline: appends and flushes raise it
        self._stats = {"commits": 0, "rows": 0, "commit_s": 0.0, "retries": 0, "skipped": 0, "expired": 0,
                       "spilled": 0}

        self._thread = threading.Thread(target=self._run, name="lake-writer", daemon=True)
        self._thread.start()

    # ---- caller side ------------------------------------------------------------------------

    def append(self, table_name: str, rows: Iterable[dict[str, Any]]) -> int:
        """Queue rows for `table_name`; return how many were new (rows with a known key are dropped)."""
        spec = table_spec(table_name)
        self._raise_pending_error()
        if self._closed:
            raise RuntimeError("TrajectoryWriter is closed")
        normalized = [normalize(spec, row, self.run_id) for row in rows]  # raises before anything is queued
        for value in {_scope_of(spec, row) for row in normalized}:
            self._load_keys(spec, value)  # a scan: outside the lock
        fresh = []
        with self._lock:
            for row in normalized:
                key = tuple(row[c] for c in spec.key)
                scope = _scope_of(spec, row)
                seen = self._seen(spec, scope)
                position = row.get(spec.position) if spec.position is not None else None
                if key in seen or self._below_floor(spec, scope, position):
                    self._stats["skipped"] += 1
                    continue
                seen[key] = position
                fresh.append(row)
            if not fresh:
                return 0
            try:
                data = pa.Table.from_pylist(fresh, schema=spec.arrow)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
                for row in fresh:  # nothing was queued: forget the keys again
                    self._seen(spec, _scope_of(spec, row)).pop(tuple(row[c] for c in spec.key), None)
                raise ValueError(f"lake table {table_name!r}: rows do not match its schema: {e}") from None
            self._pending[table_name].append(data)
            self._pending_rows[table_name] += data.num_rows
            self._pending_bytes[table_name] += data.nbytes
            self._pending_since.setdefault(table_name, time.monotonic())
            if self._pending_rows[table_name] >= self.batch_rows:
                self._lock.notify_all()
            if self.spill_dir is not None and sum(self._pending_bytes.values()) > self.max_pending_bytes:
                self._spill(max(self._pending_bytes, key=self._pending_bytes.__getitem__))
        return len(fresh)

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every row appended so far is committed (or raise LakeWriteError)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            self._flushing += 1
            self._lock.notify_all()
            try:
                while self._unfinished():
                    if self._error is not None or self._gave_up is not None:
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"lake flush did not finish in {timeout_s} s")
                    self._lock.wait(timeout=remaining if remaining is not None else 1.0)
            finally:
                self._flushing -= 1
        self._raise_pending_error()

    def close(self) -> None:
        """Commit what is pending, then stop the commit thread."""
        if self._closed:
            return
        try:
            if self._gave_up is None:  # past an outage's deadline a last flush would only wait again
                self.flush()
        finally:
            with self._lock:
                self._closed = True
                self._lock.notify_all()
            self._thread.join(timeout=30)

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def position(self, table_name: str, run_id: str | None = None) -> int | None:
        """How far `run_id` got in `table_name`: the max committed position value (e.g. step).

        Read from the newest snapshot summary that records it; after expiry removed those, from
        the data.
        """
        spec = table_spec(table_name)
        run_id = run_id or self.run_id
        if spec.position is None or run_id is None:
            return None
        table = self._call(lambda: self.catalog.load_table((self.namespace, table_name)))
        value = summary_position(table, run_id)
        if value is not None:
            return value
        if table.current_snapshot() is None:
            return None
        column = spec.position
        data = self._call(lambda: table.scan(row_filter=EqualTo(term="run_id", value=run_id),
                                             selected_fields=(column,)).to_arrow())
        return None if data.num_rows == 0 else pc.max(data[column]).as_py()

    def snapshot_ids(self, tables: tuple[str, ...] = ("samples", "steps")) -> dict[str, int | None]:
        """The current snapshot id of each table (after `flush`: a snapshot holding every row
        appended so far); time travel to it reads exactly the data a checkpoint was trained on."""
        ids: dict[str, int | None] = {}
        for name in tables:
            snapshot = self._call(partial(self.catalog.load_table, (self.namespace, name))).current_snapshot()
            ids[name] = snapshot.snapshot_id if snapshot is not None else None
        return ids

    def rewind(self, position: int, run_id: str | None = None) -> dict[str, int]:
        """Delete `run_id`'s rows beyond `position` (e.g. the steps after the checkpoint a run resumes
        from) in every table with a position column; return the rows deleted per table.

        Call it before appending that run's rows: the resumed run then records those steps anew,
        and the lake holds what the trained policy saw, each sample and step once.
        """
        run_id = run_id or self.run_id
        if run_id is None:
            raise ValueError("rewind: no run_id given and the writer has none")
        self.flush()
        deleted = {}
        for spec in TABLES.values():
            if spec.position is None or not spec.run_scoped:
                continue
            beyond = And(EqualTo(term="run_id", value=run_id), GreaterThan(term=spec.position, value=position))
            for attempt in range(self.max_retries + 1):
                # not the commit thread's copy; a delete whose answer was lost is seen by the next scan
                table = self._call(partial(self.catalog.load_table, (self.namespace, spec.name)))
                if table.current_snapshot() is None:
                    n = 0
                    break
                n = self._call(partial(_count, table, beyond, spec.position))
                if n == 0:
                    break
                try:
                    self._call(partial(table.delete, beyond, snapshot_properties={
                        POSITION_PROPERTY + run_id: str(position), REWIND_PROPERTY: str(position)}))
                    break
                except _CONFLICT:
                    if attempt == self.max_retries:
                        raise
                    time.sleep(backoff_s(attempt))
            with self._lock:
                self._keys.pop((spec.name, run_id), None)  # read back on next append, from the floor up
            if n:
                deleted[spec.name] = n
        with self._lock:
            self._floors[run_id] = position  # what is left of the run ends at `position`: all committed
        return deleted

    def committed_through(self, run_id: str, position: int) -> None:
        """Every row of `run_id` below `position` is committed (e.g. flushed before a checkpoint at
        `position`) and will not be recorded again: forget their keys, so a run's writer holds a
        checkpoint interval's keys, not the run's; a row appended below it later is dropped as a re-send."""
        with self._lock:
            if position <= self._floors.get(run_id, position - 1):
                return
            self._floors[run_id] = position
            for slot in [(name, scope) for name, scope in self._keys if scope == run_id and _floored(table_spec(name))]:
                self._keys[slot] = {k: at for k, at in self._keys[slot].items() if at is None or at >= position}

    def metrics(self) -> dict[str, float]:
        """Stable names: lake/commits, lake/rows, lake/commit_s_mean, lake/retries, … ; lake/outage_s is
        the time the catalog or object store was unreachable so far, lake/spilled_rows the rows that
        waited on disk for it, lake/held_keys the row keys held for exactly-once (see `committed_through`)."""
        with self._lock:
            s = dict(self._stats)
            pending = sum(self._pending_rows.values()) + sum(n for files in self._spilled.values() for _, n in files)
            held = sum(len(keys) for keys in self._keys.values())
        return {"lake/commits": float(s["commits"]), "lake/rows": float(s["rows"]),
                "lake/commit_s_mean": s["commit_s"] / s["commits"] if s["commits"] else 0.0,
                "lake/retries": float(s["retries"]), "lake/skipped_rows": float(s["skipped"]),
                "lake/pending_rows": float(pending), "lake/snapshots_expired": float(s["expired"]),
                "lake/outage_s": self.outage.seconds(), "lake/spilled_rows": float(s["spilled"]),
                "lake/held_keys": float(held)}

    def _load_keys(self, spec: TableSpec, value: str | None) -> None:
        """On first sight of a partition (scope value) in a table, read back its committed keys (a
        run's: from its floor up)."""
        slot = (spec.name, value)
        if slot in self._keys:
            return
        with self._lock:
            floor = self._floor_of(spec, value)
        keys = self._call(lambda: committed_keys(self.catalog.load_table((self.namespace, spec.name)), spec, value,
                                                 floor))
        with self._lock:
            self._keys.setdefault(slot, keys)

    def _seen(self, spec: TableSpec, value: str | None) -> dict[tuple, Any]:
        """Keys (with their positions) of one partition of this table that are committed or pending
        (after `_load_keys`)."""
        return self._keys[(spec.name, value)]

    def _floor_of(self, spec: TableSpec, value: str | None) -> int | None:
        """The run's floor, for a run-scoped table with a position column (else None)."""
        return self._floors.get(value) if _floored(spec) and value is not None else None

    def _below_floor(self, spec: TableSpec, value: str | None, position: Any) -> bool:
        floor = self._floor_of(spec, value)
        return floor is not None and position is not None and position < floor

    def _raise_pending_error(self) -> None:
        with self._lock:
            if self._gave_up is not None:
                raise self._gave_up
            error, self._error = self._error, None
        if error is not None:
            raise LakeWriteError(f"lake commit failed: {error}") from error

    def _service_of(self, error: BaseException | None) -> str:
        return service_of(getattr(self.catalog, "properties", {}), error)

    def _kept(self) -> str:
        with self._lock:
            memory = sum(self._pending_rows.values())
            spilled = sum(n for files in self._spilled.values() for _, n in files)
        where = f"{spilled} rows spilled to {self.spill_dir}" if self.spill_dir is not None else "nothing on disk"
        return (f"the rows committed before it; {memory} pending rows in memory, {where} (rows past the last "
                f"checkpoint: a resumed run records them anew)")

    def _unfinished(self) -> bool:
        """Rows appended but not yet committed: in memory, on disk or being committed (lock held)."""
        return any(self._pending_rows.values()) or any(self._spilled.values()) or self._busy

    def _spill(self, name: str) -> None:
        """Write `name`'s pending rows to an Arrow file in the spill dir (lock held); committed later."""
        assert self.spill_dir is not None
        data = pa.concat_tables(self._pending.pop(name))
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        self._spills += 1
        path = self.spill_dir / f"{name}-{self._spills:06d}-{uuid.uuid4().hex[:8]}.arrow"
        with ipc.new_file(path, data.schema) as out:
            out.write_table(data)
        self._spilled[name].append((path, data.num_rows))
        self._stats["spilled"] += data.num_rows
        self._pending_rows.pop(name)
        self._pending_bytes.pop(name, None)
        log.warning("lake: %d %s rows spilled to %s while the lake is unreachable", data.num_rows, name, path)

    # ---- commit thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                name = self._next_due()
                while name is None and not self._closed:
                    self._lock.wait(timeout=self._wait_s())
                    name = self._next_due()
                if name is None:  # closed and nothing due
                    return
                spilled = self._spilled[name][0] if self._spilled[name] else None  # oldest rows first
                parts: list[pa.Table] = []
                if spilled is None:
                    parts = self._pending.pop(name)
                    self._pending_rows.pop(name)
                    self._pending_bytes.pop(name, None)
                    self._pending_since.pop(name, None)
                self._busy = True
            try:
                if spilled is not None:
                    with ipc.open_file(spilled[0]) as source:
                        data = source.read_all()
                    self._commit(name, data, batch=spilled[0].stem)  # a stable id: a lost answer is found again
                else:
                    data = pa.concat_tables(parts)
                    self._commit(name, data)
            except BaseException as e:  # keep the rows for the next flush; tell the caller
                outage = isinstance(e, ServiceOutage)
                if not outage:
                    log.warning("lake commit to %s failed: %s", name, e)
                with self._lock:
                    if spilled is None:
                        self._pending[name][:0] = [data]
                        self._pending_rows[name] += data.num_rows
                        self._pending_bytes[name] += data.nbytes
                        self._pending_since.setdefault(name, time.monotonic())
                    if outage:  # past the deadline: keep what is pending on disk, stop
                        for table in [t for t, n in self._pending_rows.items() if n]:
                            if self.spill_dir is not None:
                                self._spill(table)
                        self._gave_up = self._gave_up or self.outage.error(self._kept())
                        log.error("%s", self._gave_up)
                    else:
                        self._error = e
                    self._busy = False
                    self._lock.notify_all()
                    if self._closed or outage:
                        return
                    self._lock.wait(timeout=self.flush_interval_s)  # don't spin on a broken catalog
                continue
            with self._lock:
                if spilled is not None:
                    self._spilled[name].pop(0)
                    spilled[0].unlink(missing_ok=True)
                self._busy = False
                self._lock.notify_all()

    def _next_due(self) -> str | None:
        now = time.monotonic()
        for name, files in self._spilled.items():
            if files:
                return name
        for name, n in self._pending_rows.items():
            if n and (self._flushing or self._closed or n >= self.batch_rows
                      or now - self._pending_since[name] >= self.flush_interval_s):
                return name
        return None

    def _wait_s(self) -> float:
        if not self._pending_since:
            return self.flush_interval_s
        oldest = min(self._pending_since.values())
        return max(0.01, self.flush_interval_s - (time.monotonic() - oldest))

    def _table(self, name: str, reload: bool = False) -> Table:
        if reload or name not in self._tables:
            self._tables[name] = self.catalog.load_table((self.namespace, name))
        return self._tables[name]

    def _commit(self, name: str, data: pa.Table, batch: str | None = None) -> None:
        """One append of `data` (idempotency key `batch`), retried through conflicts (up to `max_retries`)
        and outages (up to the deadline); before each retry, a batch that landed after all is not re-sent."""
        spec = table_spec(name)
        batch = batch or uuid.uuid4().hex
        properties = {BATCH_PROPERTY: batch, WRITER_PROPERTY: self.writer_id}
        if spec.position is not None and spec.run_scoped:
            for run_id, position in _max_position_per_run(data, spec.position).items():
                properties[POSITION_PROPERTY + run_id] = str(position)
        started = time.perf_counter()
        conflicts, retrying = 0, False
        while True:
            attempt_started = self.outage.clock()
            try:
                table = self._table(name, reload=retrying)
                if retrying and _landed(table, batch):  # an earlier attempt landed; its answer was lost
                    self.outage.recovered()
                    break
                table.append(conform(data, table), snapshot_properties=properties)
                self.outage.recovered()
                break
            except Exception as e:
                if isinstance(e, _CONFLICT) or unreadable_metadata(e):
                    self.outage.recovered()  # the catalog answered
                    conflicts += 1
                    if conflicts > self.max_retries:
                        raise
                    if not isinstance(e, _CONFLICT):
                        log.info("lake commit to %s: %s; reloading the table", name, first_line(e))
                    delay = backoff_s(conflicts - 1)
                elif transient(e):
                    self.outage.failed(e, attempt_started)
                    if self.outage.past_deadline():
                        raise self.outage.error("") from e  # the commit thread says what it kept
                    log.info("lake commit to %s: %s unreachable (%.1f s so far), retrying", name,
                             self._service_of(e), self.outage.current_s())
                    delay = backoff_s(self.outage.failures)
                else:
                    raise
            with self._lock:
                self._stats["retries"] += 1
            retrying = True
            time.sleep(delay)
        elapsed = time.perf_counter() - started
        with self._lock:
            self._stats["commits"] += 1
            self._stats["rows"] += data.num_rows
            self._stats["commit_s"] += elapsed
            commits = self._stats["commits"]
        if self.expire_every and commits % self.expire_every == 0:
            try:  # best effort: a conflict only means we expire next time
                expired = expire_snapshots(table, keep_last=self.keep_snapshots)
                with self._lock:
                    self._stats["expired"] += expired
            except Exception as e:  # noqa: BLE001
                log.info("snapshot expiry on %s skipped: %s", name, e)


def summary_position(table: Table, run_id: str) -> int | None:
    """The position `run_id` reached in `table` by its newest snapshot summary that records one
    (None when none does, e.g. after expiry removed them): one metadata read, no data files."""
    for snapshot in sorted(table.metadata.snapshots, key=lambda s: s.timestamp_ms, reverse=True):
        value = snapshot.summary.additional_properties.get(POSITION_PROPERTY + run_id) if snapshot.summary else None
        if value is not None:
            return int(value)
    return None


def _count(table: Table, row_filter: Any, column: str) -> int:
    return table.scan(row_filter=row_filter, selected_fields=(column,)).to_arrow().num_rows


def _floored(spec: TableSpec) -> bool:
    """Whether a run's floor applies to the table: run-scoped, with a position column."""
    return spec.position is not None and spec.run_scoped


def _scope_of(spec: TableSpec, row: dict[str, Any]) -> str | None:
    return row.get(spec.scope) if spec.scope is not None else None


def committed_keys(table: Table, spec: TableSpec, value: str | None, floor: int | None = None) -> dict[tuple, Any]:
    """The key tuples already in `table` (only the partition `spec.scope = value` when given; only rows
    at positions ≥ `floor` when given), each with its row's position (None without a position column)."""
    if table.current_snapshot() is None:
        return {}
    row_filter: BooleanExpression = (EqualTo(term=spec.scope, value=value)
                                     if spec.scope is not None and value is not None else AlwaysTrue())
    if floor is not None and spec.position is not None:
        row_filter = And(row_filter, GreaterThanOrEqual(term=spec.position, value=floor))
    fields = (*spec.key, spec.position) if spec.position is not None and spec.position not in spec.key else spec.key
    data = table.scan(row_filter=row_filter, selected_fields=fields).to_arrow()
    columns = [data[c].to_pylist() for c in spec.key]
    positions = data[spec.position].to_pylist() if spec.position is not None else [None] * data.num_rows
    return dict(zip(zip(*columns), positions))


def conform(data: pa.Table, table: Table) -> pa.Table:
    """`data` (built with the spec's Arrow schema) with the table's own field ids and column order.

    They differ in a table that gained columns after it was created (`ensure_tables` adds them
    with fresh ids); PyIceberg matches columns by field id, so rows are re-labelled by name.
    """
    target = table.schema().as_arrow()
    if data.schema.equals(target, check_metadata=True):
        return data
    columns = [data.column(f.name) if f.name in data.column_names else pa.nulls(data.num_rows, f.type)
               for f in target]
    return pa.Table.from_arrays(columns, schema=target)


def _landed(table: Table, batch: str) -> bool:
    """Did a snapshot with this batch id get committed (e.g. before a lost response)?"""
    return any(s.summary is not None and s.summary.additional_properties.get(BATCH_PROPERTY) == batch
               for s in table.metadata.snapshots)


def _max_position_per_run(data: pa.Table, column: str) -> dict[str, int]:
    grouped = data.group_by("run_id").aggregate([(column, "max")])
    return {run: int(v) for run, v in zip(grouped["run_id"].to_pylist(), grouped[f"{column}_max"].to_pylist())
            if v is not None}
