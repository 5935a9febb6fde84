"""The embedded catalog lives under FACTORY_HOME; tables are created once, with the schemas' specs."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from factory.lake import TABLES, ensure_tables, open_catalog


def test_default_catalog_and_warehouse_are_under_the_state_dir(catalog, tmp_path):
    assert (tmp_path / "lake" / "catalog.db").is_file()
    location = Path(urlparse(catalog.load_table(("factory", "samples")).location()).path)
    assert location.is_relative_to(tmp_path / "lake" / "warehouse")


def test_ensure_tables_is_idempotent_and_restores_properties(catalog):
    uuids = {name: catalog.load_table(("factory", name)).metadata.table_uuid for name in TABLES}
    table = catalog.load_table(("factory", "steps"))
    with table.transaction() as tx:
        tx.set_properties({"commit.manifest-merge.enabled": "false"})
    again = ensure_tables(open_catalog(namespace=None))
    assert {name: t.metadata.table_uuid for name, t in again.items()} == uuids
    assert catalog.load_table(("factory", "steps")).properties["commit.manifest-merge.enabled"] == "true"


def test_tables_follow_their_specs(catalog):
    for name, spec in TABLES.items():
        table = catalog.load_table(("factory", name))
        assert [f.name for f in table.schema().fields] == [f.name for f in spec.schema.fields]
        assert all(table.schema().find_field(column).required for column in spec.key)
        partitions = [(f.name, str(f.transform)) for f in table.spec().fields]
        assert partitions == [(spec.scope, "identity")]


def test_an_older_tasks_table_gains_the_dataset_column_and_partition(tmp_path, monkeypatch):
    """A lake made before `tasks.dataset` existed: ensure_tables adds the column (old rows: NULL) and
    the partition field, and the writer's rows (built with the new schema) still land."""
    import pyarrow as pa
    from pyiceberg.partitioning import PartitionSpec
    from pyiceberg.schema import Schema

    from factory.lake import TrajectoryWriter
    from factory.lake.schemas import TABLES

    monkeypatch.setenv("FACTORY_HOME", str(tmp_path))
    catalog = open_catalog(namespace=None)
    catalog.create_namespace("factory")
    old = Schema(*[f for f in TABLES["tasks"].schema.fields if f.name != "dataset"])
    table = catalog.create_table(("factory", "tasks"), schema=old, partition_spec=PartitionSpec())
    table.append(pa.Table.from_pylist([{"task_id": "a/train/0", "family": "a", "question": "q", "answer": "1",
                                        "split": "train"}], schema=old.as_arrow()))

    catalog = open_catalog()
    table = catalog.load_table(("factory", "tasks"))
    assert [f.name for f in table.schema().fields][-1] == "dataset"
    assert [(f.name, str(f.transform)) for f in table.spec().fields] == [("dataset", "identity")]
    with TrajectoryWriter(catalog) as writer:
        row = {"task_id": "a/train/0", "family": "a", "question": "q2", "answer": "2", "split": "train"}
        assert writer.append("tasks", [{**row, "dataset": "d1"}]) == 1
    rows = sorted(table.refresh().scan().to_arrow().to_pylist(), key=lambda r: r["question"])
    assert [(r["dataset"], r["question"]) for r in rows] == [(None, "q"), ("d1", "q2")]


def test_a_catalog_opened_while_another_process_creates_its_tables_retries(tmp_path, monkeypatch):
    """Two processes opening a fresh SQL catalog at once both find its tables absent and both create
    them; on Postgres the loser gets a unique-key error (CI saw a writer die of it). The loser here
    finds the tables made by the winner mid-create and fails as Postgres does; open_catalog retries."""
    from pyiceberg.catalog.sql import SqlCatalog
    from sqlalchemy.exc import IntegrityError

    monkeypatch.setenv("FACTORY_HOME", str(tmp_path))
    real_create, calls = SqlCatalog.create_tables, []

    def lose_the_race_once(self):
        calls.append(self)
        real_create(self)  # the winner's tables now exist ...
        if len(calls) == 1:  # ... and the loser's own CREATE collides with them
            raise IntegrityError("CREATE TABLE iceberg_tables", {}, Exception("duplicate key: pg_type_typname_nsp_index"))

    monkeypatch.setattr(SqlCatalog, "create_tables", lose_the_race_once)
    catalog = open_catalog()
    assert len(calls) == 1  # the second attempt found the tables and created nothing
    assert {t for _, t in catalog.list_tables("factory")} == set(TABLES)
