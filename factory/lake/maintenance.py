"""Lake upkeep: expire old snapshots, compact small files, delete files no snapshot references.

Why: every streamed commit adds a snapshot (the metadata file, and with it commit latency, grows
with their number) and a small data file (scans open every one). PyIceberg 0.12 has snapshot
expiry (`table.maintenance.expire_snapshots()`) but no compaction, so `compact` rewrites a
partition's rows as one overwrite; expiry drops metadata only, so `remove_orphan_files` deletes
the data, manifest and manifest-list files no remaining snapshot can reach (local warehouses).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, ValidationException
from pyiceberg.expressions import AlwaysTrue, BooleanExpression, EqualTo
from pyiceberg.manifest import ManifestFile
from pyiceberg.table import Table

from factory.lake.schemas import NAMESPACE, TABLES
from factory.recording.outage import backoff_s

log = logging.getLogger(__name__)

_CONFLICTS = (CommitFailedException, ValidationException, ValueError)  # ValueError: snapshot gone meanwhile


def expire_snapshots(table: Table, keep_last: int = 5, retries: int = 5) -> int:
    """Expire all but the newest `keep_last` snapshots (branch and tag heads always stay).

    Returns the number expired. Retries on a concurrent commit, recomputing the victims.
    """
    for attempt in range(retries + 1):
        table.refresh()
        snapshots = sorted(table.metadata.snapshots, key=lambda s: (s.timestamp_ms, s.sequence_number or 0))
        protected = {ref.snapshot_id for ref in table.metadata.refs.values()}
        victims = [s.snapshot_id for s in snapshots[: max(0, len(snapshots) - keep_last)]
                   if s.snapshot_id not in protected]
        if not victims:
            return 0
        try:
            table.maintenance.expire_snapshots().by_ids(victims).commit()
            return len(victims)
        except _CONFLICTS:
            if attempt == retries:
                raise
            time.sleep(backoff_s(attempt))
    return 0


@dataclass
class Compaction:
    """What `compact` did to one table: live data files before/after and the rows rewritten."""

    files_before: int
    files_after: int
    rows: int


ALL_ROWS = AlwaysTrue()


def data_file_count(table: Table, row_filter: BooleanExpression = ALL_ROWS) -> int:
    """Live data files of the current snapshot that may hold rows matching `row_filter`."""
    if table.current_snapshot() is None:
        return 0
    return sum(1 for _ in table.scan(row_filter=row_filter).plan_files())


def compact(table: Table, run_id: str | None = None, retries: int = 5) -> Compaction:
    """Rewrite small files into one file per partition; rows are unchanged.

    With `run_id`, only that run's partition; without, every partition holding more than one
    file. Each partition is an `overwrite(rows, overwrite_filter=partition)`; a writer appending
    to the same partition meanwhile makes the commit fail validation (serializable isolation),
    and the partition is re-read and retried — no concurrent row is lost.
    """
    table.refresh()
    before = data_file_count(table)
    rows = 0
    for row_filter in _partitions_to_compact(table, run_id):
        for attempt in range(retries + 1):
            table.refresh()
            snapshot = table.current_snapshot()
            if snapshot is None or data_file_count(table, row_filter) <= 1:
                break
            data = table.scan(row_filter=row_filter, snapshot_id=snapshot.snapshot_id).to_arrow()
            try:
                table.overwrite(data, overwrite_filter=row_filter, snapshot_properties={"factory.compaction": "true"})
                rows += data.num_rows
                break
            except _CONFLICTS:
                if attempt == retries:
                    raise
                time.sleep(backoff_s(attempt))
    table.refresh()
    return Compaction(files_before=before, files_after=data_file_count(table), rows=rows)


def _partitions_to_compact(table: Table, run_id: str | None) -> list[BooleanExpression]:
    partitioned = "run_id" in {f.name for f in table.spec().fields}
    if run_id is not None:
        return [EqualTo(term="run_id", value=run_id)]
    if not partitioned or table.current_snapshot() is None:
        return [AlwaysTrue()]
    files_per_run: dict[str, int] = {}
    position = [f.name for f in table.spec().fields].index("run_id")
    for task in table.scan().plan_files():
        run = task.file.partition[position]
        files_per_run[run] = files_per_run.get(run, 0) + 1
    return [EqualTo(term="run_id", value=run) for run, n in sorted(files_per_run.items()) if n > 1]


def referenced_files(table: Table) -> set[str]:
    """Every file some snapshot of `table` can reach: metadata, manifest lists, manifests, data."""
    refs = {table.metadata_location, *(entry.metadata_file for entry in table.metadata.metadata_log)}
    manifests: dict[str, ManifestFile] = {}
    for snapshot in table.metadata.snapshots:
        refs.add(snapshot.manifest_list)
        for manifest in snapshot.manifests(table.io):
            manifests.setdefault(manifest.manifest_path, manifest)
    for path, manifest in manifests.items():
        refs.add(path)
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=False):
            refs.add(entry.data_file.file_path)
    return {_local_path(p) for p in refs}


def remove_orphan_files(table: Table, older_than_s: float = 3600.0) -> int:
    """Delete files under the table's location that no snapshot references; return how many.

    Only files older than `older_than_s` go: a younger one may belong to a commit in flight.
    Local (`file://`) warehouses only; other stores are left to their own lifecycle rules.
    """
    location = urlparse(table.location())
    if location.scheme not in ("", "file"):
        log.info("remove_orphan_files: %s is not local; skipped", table.location())
        return 0
    table.refresh()
    keep = referenced_files(table)
    cutoff = time.time() - older_than_s
    removed = 0
    for root in (Path(location.path) / "data", Path(location.path) / "metadata"):
        for dirpath, _, names in os.walk(root):
            for name in names:
                path = os.path.join(dirpath, name)
                if path not in keep and os.path.getmtime(path) < cutoff:
                    os.remove(path)
                    removed += 1
    return removed


def live_files_on_disk(table: Table) -> int:
    """Files under the table's (local) location: what `remove_orphan_files` shrinks."""
    root = Path(urlparse(table.location()).path)
    return sum(len(names) for _, _, names in os.walk(root))


def maintain(catalog: Catalog, namespace: str = NAMESPACE, keep_last: int = 5,
             orphan_older_than_s: float = 3600.0) -> dict[str, dict[str, int]]:
    """Compact, expire and clean every lake table; return per-table counts."""
    report = {}
    for name in TABLES:
        table = catalog.load_table((namespace, name))
        snapshots_before = len(table.metadata.snapshots)
        done = compact(table)
        expired = expire_snapshots(table, keep_last=keep_last)
        removed = remove_orphan_files(table, older_than_s=orphan_older_than_s)
        report[name] = {"files_before": done.files_before, "files_after": done.files_after,
                        "rows_rewritten": done.rows, "snapshots_before": snapshots_before,
                        "snapshots_expired": expired, "orphans_removed": removed}
    return report


def _local_path(uri: str) -> str:
    parsed = urlparse(uri)
    return parsed.path if parsed.scheme in ("", "file") else uri
