"""The lake through an outage of its catalog: a real SQLite catalog made unavailable by another
connection holding its write lock (commits fail with "database is locked", as they fail with
"connection refused" while Postgres restarts). Appends go on, rows wait in memory then spill to
disk, and every row lands exactly once; past the deadline the writer stops with one line."""

from __future__ import annotations

import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow.ipc as ipc
import pytest
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table

from factory.support.failures import ServiceOutage
from factory.lake import TrajectoryWriter, open_catalog
from factory.lake.catalog import transient
from tests.lake.rows import sample_row


@pytest.fixture
def lake(tmp_path, monkeypatch) -> tuple:
    """(catalog, its database file): SQLite gives up on a lock after 0.2 s instead of 5."""
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path))
    db = tmp_path / "lake" / "catalog.db"
    open_catalog()  # creates the tables
    catalog = open_catalog({"type": "sql", "uri": f"sqlite:///{db}?timeout=0.2",
                            "warehouse": (tmp_path / "lake" / "warehouse").as_uri()})
    return catalog, db


@contextmanager
def catalog_down(db: Path):
    """The catalog refuses writes while inside (another connection holds its exclusive lock)."""
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        holder.execute("COMMIT")
        holder.close()


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def sample_ids(catalog) -> list[str]:
    return sorted(catalog.load_table(("factory", "samples")).scan().to_arrow()["sample_id"].to_pylist())


def test_an_outage_shorter_than_the_deadline_is_waited_out_rows_spill_and_land_once(lake, tmp_path):
    catalog, db = lake
    spill = tmp_path / "run" / "lake-spill"
    writer = TrajectoryWriter(catalog, run_id="r", flush_interval_s=0.05, outage_deadline_s=60,
                              spill_dir=spill, max_pending_bytes=2000)
    writer.append("samples", [sample_row("r", "before")])
    writer.flush()
    with catalog_down(db):
        writer.append("samples", [sample_row("r", "s0")])
        wait_until(lambda: writer.outage.down)  # the commit thread is retrying s0
        started = time.monotonic()
        for i in range(1, 13):  # the loop goes on: appends return at once, rows beyond the bound go to disk
            assert writer.append("samples", [sample_row("r", f"s{i}", step=i)]) == 1
        assert time.monotonic() - started < 1.0
        spilled = sorted(spill.glob("samples-*.arrow"))
        assert spilled and writer.metrics()["lake/spilled_rows"] > 0
        on_disk = [r for path in spilled for r in ipc.open_file(path).read_all()["sample_id"].to_pylist()]
        assert set(on_disk) < {f"s{i}" for i in range(1, 13)}
        time.sleep(0.3)  # the outage lasts a while
    writer.flush()
    metrics = writer.metrics()
    writer.close()
    assert sample_ids(catalog) == sorted(["before", *(f"s{i}" for i in range(13))])
    assert not list(spill.glob("*.arrow"))
    assert metrics["lake/outage_s"] >= 0.3 and metrics["lake/retries"] >= 1
    assert metrics["lake/pending_rows"] == 0


def test_an_outage_past_the_deadline_stops_the_writer_with_one_line_and_keeps_the_rows(lake, tmp_path):
    catalog, db = lake
    spill = tmp_path / "run" / "lake-spill"
    writer = TrajectoryWriter(catalog, run_id="r", flush_interval_s=0.05, outage_deadline_s=0.5, spill_dir=spill)
    with catalog_down(db):
        writer.append("samples", [sample_row("r", f"s{i}") for i in range(3)])
        with pytest.raises(ServiceOutage) as failed:
            writer.flush()
        started = time.monotonic()
        writer.close()  # gave up already: no second wait
        assert time.monotonic() - started < 1.0
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith("the lake's catalog (sqlite:///") and "deadlines.service_outage_s=0.5 s" in message
    assert "database is locked" in message and f"3 rows spilled to {spill}" in message
    kept = [r for path in spill.glob("samples-*.arrow") for r in ipc.open_file(path).read_all()["sample_id"].to_pylist()]
    assert sorted(kept) == ["s0", "s1", "s2"]
    with pytest.raises(ServiceOutage):
        writer.append("samples", [sample_row("r", "s3")])
    assert sample_ids(catalog) == []
    TrajectoryWriter(catalog, run_id="r", spill_dir=spill).close()  # a resumed run starts with no stale spill
    assert not spill.exists()


def test_a_landed_commit_reported_as_a_conflict_is_not_written_again(lake, monkeypatch):
    catalog, _ = lake
    real_append, calls = Table.append, []

    def landed_then_conflict(self, df, snapshot_properties={}, branch="main"):  # noqa: B006  (PyIceberg's signature)
        calls.append(1)
        real_append(self, df, snapshot_properties=snapshot_properties, branch=branch)
        if len(calls) == 1:  # e.g. a retried request whose first try had landed
            raise CommitFailedException("Table has been updated by another process")

    monkeypatch.setattr(Table, "append", landed_then_conflict)
    with TrajectoryWriter(catalog, run_id="r") as writer:
        writer.append("samples", [sample_row("r", f"s{i}") for i in range(3)])
    assert len(calls) == 1
    assert sample_ids(catalog) == ["s0", "s1", "s2"]


def test_what_counts_as_an_outage():
    from sqlalchemy.exc import IntegrityError, OperationalError

    assert transient(OperationalError("SELECT", {}, Exception("connection refused")))
    assert transient(OSError("AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7"))
    assert transient(ConnectionResetError())
    assert not transient(FileNotFoundError("s3://lake/warehouse/…/metadata.json"))
    assert not transient(IntegrityError("INSERT", {}, Exception("duplicate key")))
    assert not transient(ValueError("rows do not match"))


def test_the_lake_catalog_checks_pooled_connections_before_use(lake):
    catalog, _ = lake
    assert catalog.engine.pool._pre_ping
