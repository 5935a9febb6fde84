"""The trajectory lake: Iceberg tables of tasks, samples, steps, evaluations and checkpoints.

`open_catalog()` opens (and initialises) the catalog, `TrajectoryWriter` streams rows into it,
`sql()` queries it with DuckDB, `maintenance` keeps it small, `checks` validates its samples.
"""

from factory.lake.catalog import ensure_tables, open_catalog
from factory.lake.query import LakeQueryError, format_table, sql
from factory.lake.schemas import NAMESPACE, TABLES, table_spec
from factory.lake.writer import LakeWriteError, TrajectoryWriter, sample_rows

__all__ = ["NAMESPACE", "TABLES", "LakeQueryError", "LakeWriteError", "TrajectoryWriter", "ensure_tables",
           "format_table", "open_catalog", "sample_rows", "sql", "table_spec"]
