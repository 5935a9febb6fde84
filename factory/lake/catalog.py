"""Open the lake's Iceberg catalog and make sure its tables exist.

Default (embedded profile): a PyIceberg SqlCatalog on SQLite at `<state>/lake/catalog.db` with the
warehouse at `file://<state>/lake/warehouse`. The production profile (`factory.support.profile`): a SQL
catalog on PostgreSQL with the warehouse on S3. Any other PyIceberg catalog is given as properties,
e.g. `{"type": "rest", "uri": "http://…", "warehouse": "s3://…"}`.

`transient` says which errors an outage of the catalog's database or the object store raises, and
`service_of` names the service for a message; `open_catalog(outage_deadline_s=…)` waits such an
outage out (a run that starts, or is relaunched, while Postgres restarts).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError, TableAlreadyExistsError
from pyiceberg.table import Table
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, InterfaceError, OperationalError, ProgrammingError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from factory.support import profile
from factory.lake.schemas import NAMESPACE, TABLES, TableSpec
from factory.recording.outage import Outage, retry
from factory.paths import state_dir

CATALOG_NAME = "factory"
# Answers that say the object or row exists or not, or is forbidden: not an outage
_DEFINITE_OS_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def transient(error: BaseException) -> bool:
    """An error that an unreachable catalog database or object store raises (a commit may have landed)."""
    if isinstance(error, (OperationalError, InterfaceError, PoolTimeoutError)):
        return True
    if isinstance(error, DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(error, OSError) and not isinstance(error, _DEFINITE_OS_ERRORS)


def service_of(props: dict[str, Any], error: BaseException | None) -> str:
    """Which service of a catalog with properties `props` an error came from: its database, or the
    object store (warehouse); the database's URL without its password."""
    if isinstance(error, DBAPIError) or error is None:
        try:
            uri = make_url(props.get("uri", "")).render_as_string(hide_password=True)
        except ArgumentError:
            uri = "?"
        return f"the lake's catalog ({uri})"
    endpoint = props.get("s3.endpoint")
    return f"the lake's object store ({props.get('warehouse', '?')}{' at ' + endpoint if endpoint else ''})"


def default_catalog_props() -> dict[str, str]:
    """The embedded SQLite catalog under the state dir ($FACTORY_HOME overrides the state dir)."""
    lake = state_dir() / "lake"
    (lake / "warehouse").mkdir(parents=True, exist_ok=True)
    return {"type": "sql", "uri": f"sqlite:///{lake / 'catalog.db'}", "warehouse": (lake / "warehouse").as_uri()}


def open_catalog(props: dict[str, Any] | None = None, namespace: str | None = NAMESPACE,
                 outage_deadline_s: float | None = None) -> Catalog:
    """Open a catalog and, unless `namespace` is None, create the namespace and tables if missing.

    `props` without a `type`/`uri` are layered over the profile's catalog (embedded: SQLite under the
    state dir, so `{"warehouse": ...}` alone moves only the warehouse); with one they are used as given.
    `outage_deadline_s`: retry through an outage of the database or object store (`transient` errors)
    for up to that long, then raise the one-line `ServiceOutage`; None: the first error raises.
    """
    props = dict(props or {})
    if "type" not in props and "uri" not in props:
        props = {**(profile.lake_catalog_props() or default_catalog_props()), **props}
    props = {k: str(v) for k, v in props.items()}
    if outage_deadline_s is not None:
        outage = Outage(lambda error: service_of(props, error), outage_deadline_s)
        return retry(lambda: open_catalog(props, namespace), outage, transient, kept=lambda: "nothing yet")
    if props.get("type") == "sql" or props.get("uri", "").startswith(("sqlite:", "postgresql")):
        # a pooled connection that died with its database (a restart) is replaced before use, not failed on
        props.setdefault("pool_pre_ping", "true")
    if props.get("uri", "").startswith("sqlite:///"):
        _use_wal(Path(props["uri"].removeprefix("sqlite:///").split("?", 1)[0]))
    catalog = _load(props.pop("name", CATALOG_NAME), props)
    if namespace is not None:
        ensure_tables(catalog, namespace)
    return catalog


def _load(name: str, props: dict[str, str], attempts: int = 4) -> Catalog:
    """`load_catalog`, again after losing the race to create the SQL catalog's own tables.

    A SqlCatalog checks for its tables, then creates them: processes that open a fresh catalog at
    the same moment both create, and the losers get the database's unique-key error (Postgres:
    `pg_type_typname_nsp_index`). The tables exist by then, so the next attempt only finds them.
    """
    for attempt in range(attempts):
        try:
            return load_catalog(name, **props)
        except (IntegrityError, OperationalError, ProgrammingError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


def ensure_tables(catalog: Catalog, namespace: str = NAMESPACE) -> dict[str, Table]:
    """Create `namespace` and every table of `schemas.TABLES` in it if absent; return the tables.

    Existing tables made by an older version are brought up to date: the spec's table properties,
    its columns that the table lacks (added as optional: existing rows hold NULL there) and its
    partition fields (new data is partitioned by them; old files stay as they are).
    """
    try:
        catalog.create_namespace_if_not_exists(namespace)
    except Exception:
        # the SQL catalog checks, then inserts: two first writers at once both insert, and the loser
        # gets the database's unique-key error (seen on Postgres) rather than "already exists"
        if (namespace,) not in catalog.list_namespaces():
            raise
    tables = {}
    for name, spec in TABLES.items():
        identifier = (namespace, name)
        try:
            table = catalog.load_table(identifier)
            stale = {k: v for k, v in spec.properties.items() if table.properties.get(k) != v}
            if stale:  # a lake made by an older version: bring its table properties up to date
                try:
                    with table.transaction() as tx:
                        tx.set_properties(stale)
                except CommitFailedException:  # a concurrent commit won; the next open retries
                    pass
            tables[name] = evolve(table, spec)
        except NoSuchTableError:
            try:
                tables[name] = catalog.create_table(identifier, schema=spec.schema,
                                                    partition_spec=spec.partition_spec,
                                                    properties=spec.properties)
            except TableAlreadyExistsError:  # another process created it between our two calls
                tables[name] = catalog.load_table(identifier)
    return tables


def evolve(table: Table, spec: TableSpec) -> Table:
    """Add the spec's columns and partition fields that `table` lacks (a lake made by an older version)."""
    have = {f.name for f in table.schema().fields}
    missing = [f for f in spec.schema.fields if f.name not in have]
    partitioned = {table.schema().find_column_name(f.source_id) for f in table.spec().fields}
    unpartitioned = [name for f in spec.partition_spec.fields
                     if (name := spec.schema.find_column_name(f.source_id)) is not None and name not in partitioned]
    try:
        if missing:
            with table.update_schema() as update:
                for field in missing:
                    update.add_column(field.name, field.field_type, doc=field.doc)
        if unpartitioned:
            with table.update_spec() as update:
                for column in unpartitioned:
                    update.add_identity(column)
    except CommitFailedException:  # another process evolved it first; reload below
        pass
    return table.refresh() if missing or unpartitioned else table


def _use_wal(db: Path) -> None:
    # WAL lets readers (queries, other writers' refreshes) proceed while one writer commits.
    db.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(db, timeout=30)
    try:
        con.execute("PRAGMA journal_mode=WAL")
    finally:
        con.close()
