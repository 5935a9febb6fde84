"""SQL over the lake: DuckDB on PyIceberg scans.

Each lake table named in the query is scanned (current snapshot) and registered in an in-memory
DuckDB connection under its plain name, so `SELECT run_id, count(*) FROM samples GROUP BY 1` works.
(DuckDB's iceberg extension cannot be installed offline; scanning through PyIceberg needs none.)
"""

from __future__ import annotations

import re
from typing import Any

import duckdb
import pyarrow as pa
from pyiceberg.catalog import Catalog

from factory.lake.catalog import open_catalog
from factory.lake.schemas import NAMESPACE, TABLES
from factory.recording.outage import first_line


class LakeQueryError(ValueError):
    """The query failed (syntax, unknown column, …); the message is DuckDB's first line."""


def referenced_tables(query: str) -> list[str]:
    """Lake tables whose name appears as a word in the query."""
    return [name for name in TABLES if re.search(rf"\b{name}\b", query, flags=re.IGNORECASE)]


def connect(query: str = "", catalog: Catalog | None = None, namespace: str = NAMESPACE,
            tables: list[str] | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the lake tables the query names (or `tables`) registered."""
    catalog = catalog if catalog is not None else open_catalog(namespace=namespace)
    con = duckdb.connect()
    for name in tables if tables is not None else referenced_tables(query):
        table = catalog.load_table((namespace, name))
        if table.current_snapshot() is None:  # never written: an empty relation with the right columns
            con.register(name, table.schema().as_arrow().empty_table())
        else:
            table.scan().to_duckdb(name, connection=con)
    return con


def sql(query: str, catalog: Catalog | None = None, namespace: str = NAMESPACE,
        params: list[Any] | None = None) -> pa.Table:
    """Run one DuckDB SQL statement over the lake and return its result as an Arrow table.

    Raises LakeQueryError with a one-line message when DuckDB rejects the query.
    """
    con = connect(query, catalog, namespace)
    try:
        relation = con.sql(query, params=params) if params else con.sql(query)
        return relation.to_arrow_table() if relation is not None else pa.table({})
    except duckdb.CatalogException as e:  # a wrong table name: say which ones exist
        raise LakeQueryError(f"{first_line(e, with_type=False)} (lake tables: {', '.join(TABLES)}; "
                             "`factory lake tables` shows their columns)") from None
    except duckdb.Error as e:
        raise LakeQueryError(first_line(e, with_type=False)) from None
    finally:
        con.close()


def table_summaries(catalog: Catalog | None = None, namespace: str = NAMESPACE) -> pa.Table:
    """One row per lake table: its name, committed rows (from the current snapshot's summary), what a
    row is, and its columns."""
    catalog = catalog if catalog is not None else open_catalog(namespace=namespace)
    rows = []
    for name in TABLES:
        table = catalog.load_table((namespace, name))
        snapshot = table.current_snapshot()
        total = snapshot.summary.additional_properties.get("total-records") if snapshot and snapshot.summary else None
        rows.append({"table": name, "rows": int(total) if total is not None else 0,
                     "columns": ", ".join(f.name for f in table.schema().fields)})
    return pa.Table.from_pylist(rows)


def find_evaluation(run_id: str, step: int, suite: str, catalog: Catalog | None = None,
                    namespace: str = NAMESPACE) -> dict[str, Any] | None:
    """The `evaluations` row of (run, step, suite), if that checkpoint was already evaluated."""
    from pyiceberg.expressions import And, EqualTo

    catalog = catalog if catalog is not None else open_catalog(namespace=namespace)
    table = catalog.load_table((namespace, "evaluations"))
    if table.current_snapshot() is None:
        return None
    row_filter = And(EqualTo(term="run_id", value=run_id), EqualTo(term="step", value=step),
                     EqualTo(term="suite", value=suite))
    found = table.scan(row_filter=row_filter, limit=1).to_arrow().to_pylist()
    return found[0] if found else None


def format_table(result: pa.Table, max_rows: int = 50, max_width: int = 60) -> str:
    """Render an Arrow table as aligned text columns for the terminal (first `max_rows` rows)."""
    names = result.column_names
    rows = [[_cell(v, max_width) for v in row.values()] for row in result.slice(0, max_rows).to_pylist()]
    widths = [max([len(n)] + [len(r[i]) for r in rows]) for i, n in enumerate(names)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    more = f", showing {max_rows}" if result.num_rows > max_rows else ""
    lines.append(f"({result.num_rows} row{'s' if result.num_rows != 1 else ''}{more})")
    return "\n".join(line.rstrip() for line in lines)


def _cell(value: Any, max_width: int) -> str:
    text = "NULL" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)
    text = text.replace("\n", " ")
    return text if len(text) <= max_width else text[: max_width - 1] + "…"
