"""Compaction, snapshot expiry and orphan-file removal keep every row and shrink the table."""

from __future__ import annotations

from factory.lake import TrajectoryWriter
from factory.lake.cli import main as lake_cli
from factory.lake.maintenance import (compact, data_file_count, expire_snapshots, live_files_on_disk, referenced_files,
                                       remove_orphan_files)
from tests.lake.rows import sample_row


def _write_small_commits(catalog, run_id: str, commits: int) -> None:
    with TrajectoryWriter(catalog, run_id=run_id, expire_every=0) as writer:
        for i in range(commits):
            writer.append("samples", [sample_row(run_id, f"{run_id}-{i}-{j}", step=i) for j in range(2)])
            writer.flush()


def _keys(table) -> list[tuple]:
    return sorted((r["run_id"], r["sample_id"], r["trained_step"]) for r in table.scan(
        selected_fields=("run_id", "sample_id", "trained_step")).to_arrow().to_pylist())


def test_expire_compact_and_clean_keep_rows_and_shrink_the_table(catalog):
    _write_small_commits(catalog, "a", 12)
    _write_small_commits(catalog, "b", 3)
    table = catalog.load_table(("factory", "samples"))
    rows_before, snapshots_before, disk_before = _keys(table), len(table.metadata.snapshots), live_files_on_disk(table)
    assert (len(rows_before), snapshots_before, data_file_count(table)) == (30, 15, 15)

    done = compact(table, run_id="a")
    assert (done.files_before, done.files_after, done.rows) == (15, 4, 24)  # a: 12 files → 1; b keeps 3
    assert compact(table).files_after == 2  # every partition with >1 file: b's 3 → 1
    expired = expire_snapshots(table, keep_last=1)
    removed = remove_orphan_files(table, older_than_s=0)

    table = catalog.load_table(("factory", "samples"))
    assert _keys(table) == rows_before
    assert data_file_count(table) == 2
    assert len(table.metadata.snapshots) == 1 < snapshots_before
    assert expired == snapshots_before + 4 - 1  # the two compactions wrote delete + append snapshots each
    assert removed > 0 and live_files_on_disk(table) < disk_before
    assert live_files_on_disk(table) == len(referenced_files(table))  # nothing unreferenced is left


def test_compact_leaves_a_single_file_partition_alone(catalog):
    _write_small_commits(catalog, "a", 1)
    table = catalog.load_table(("factory", "samples"))
    snapshot = table.current_snapshot().snapshot_id
    assert compact(table, run_id="a").rows == 0
    assert table.current_snapshot().snapshot_id == snapshot


def test_orphan_removal_spares_young_files(catalog):
    _write_small_commits(catalog, "a", 4)
    table = catalog.load_table(("factory", "samples"))
    expire_snapshots(table, keep_last=1)
    assert remove_orphan_files(table, older_than_s=3600) == 0  # unreferenced, but could be in flight
    assert len(_keys(table)) == 8


def test_lake_maintain_command(catalog, capsys):
    _write_small_commits(catalog, "a", 5)
    assert lake_cli(["lake", "maintain", "--keep-snapshots", "1", "--orphan-age-s", "0"]) == 0
    out = capsys.readouterr().out
    samples_line = next(line for line in out.splitlines() if line.startswith("samples"))
    assert "files     5 → 1" in samples_line and "rows rewritten      10" in samples_line
    table = catalog.load_table(("factory", "samples"))
    assert len(_keys(table)) == 10 and data_file_count(table) == 1 and len(table.metadata.snapshots) == 1
