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
        assert partitions == ([("run_id", "identity")] if spec.run_scoped else [])
