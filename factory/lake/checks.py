"""Data checks over the `samples` table (pure functions of an Arrow table; DuckDB does the work).

Each check returns a CheckResult with the number of offending rows and a few examples; an asset
check passes when the count is 0. The token columns are aligned with `completion_ids`; only
positions with loss_mask = 1 (tokens the policy sampled) carry a meaningful version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.expressions import EqualTo

from factory.lake.catalog import open_catalog
from factory.lake.schemas import NAMESPACE, SAMPLE_STATUSES

CHECK_COLUMNS = ("run_id", "sample_id", "versions", "loss_mask", "trained_version", "trained_step", "status", "error")


@dataclass
class CheckResult:
    """Offending row count and up to `limit` example rows of one check."""

    name: str
    count: int
    examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.count == 0


def load_samples(run_id: str, catalog: Catalog | None = None, namespace: str = NAMESPACE) -> pa.Table:
    """The columns the checks need, for one run's partition of the samples table."""
    catalog = catalog if catalog is not None else open_catalog(namespace=namespace)
    table = catalog.load_table((namespace, "samples"))
    if table.current_snapshot() is None:
        return table.schema().select(*CHECK_COLUMNS).as_arrow().empty_table()
    return table.scan(row_filter=EqualTo(term="run_id", value=run_id), selected_fields=CHECK_COLUMNS).to_arrow()


def _query(samples: pa.Table, run_id: str | None, body: str, params: list[Any], limit: int) -> tuple[int, list]:
    """Run `body` (a SELECT over relation `s`, the run's samples) and return (count, examples)."""
    con = duckdb.connect()
    try:
        con.register("s", samples if run_id is None else samples.filter(pc.field("run_id") == run_id))
        found = con.sql(body, params=params or None).to_arrow_table()
    finally:
        con.close()
    return found.num_rows, found.slice(0, limit).to_pylist()


# One row per sampled token: r = row number of its sample, i = position in the completion.
_SAMPLED_TOKENS = """
    SELECT r, run_id, sample_id, trained_version, i, versions[i] AS version
    FROM (SELECT *, unnest(range(1, len(versions) + 1)) AS i
          FROM (SELECT row_number() OVER () AS r, * FROM s))
    WHERE loss_mask[i] = 1
"""


def duplicate_sample_ids(samples: pa.Table, run_id: str | None = None, limit: int = 5) -> CheckResult:
    """Sample ids that occur more than once in the run (the writer commits each key once)."""
    body = "SELECT run_id, sample_id, count(*) AS n FROM s GROUP BY ALL HAVING count(*) > 1 ORDER BY n DESC, sample_id"
    count, examples = _query(samples, run_id, body, [], limit)
    return CheckResult("duplicate_sample_ids", count, examples)


def staleness_violations(samples: pa.Table, max_staleness: int, run_id: str | None = None,
                         limit: int = 5) -> CheckResult:
    """Samples trained too far off-policy: trained_version − min{versions[i] : loss_mask[i] = 1} > η."""
    body = f"""
        SELECT sample_id, trained_version, min(version) AS oldest_version,
               trained_version - min(version) AS staleness
        FROM ({_SAMPLED_TOKENS}) GROUP BY r, sample_id, trained_version
        HAVING trained_version - min(version) > ? ORDER BY staleness DESC, sample_id
    """
    count, examples = _query(samples, run_id, body, [max_staleness], limit)
    return CheckResult("staleness_violations", count, examples)


def version_order_violations(samples: pa.Table, run_id: str | None = None, limit: int = 5) -> CheckResult:
    """Samples whose sampled tokens' versions decrease somewhere: need versions[i] ≤ versions[j] for i < j.

    Reported per sample with the first token position where the version went down.
    """
    body = f"""
        SELECT sample_id, min(i) AS first_position, count(*) AS decreases
        FROM (SELECT *, lag(version) OVER (PARTITION BY r ORDER BY i) AS previous FROM ({_SAMPLED_TOKENS}))
        WHERE version < previous GROUP BY r, sample_id ORDER BY sample_id
    """
    count, examples = _query(samples, run_id, body, [], limit)
    return CheckResult("version_order_violations", count, examples)


def status_violations(samples: pa.Table, run_id: str | None = None, limit: int = 5) -> CheckResult:
    """Rows whose fate does not add up: an unknown status; a trained row without its step or version;
    a row of another status claiming a trained step; a failed or dropped row without its error. (A row with no
    status predates the column: a trained sample.)"""
    known = ", ".join(f"'{s}'" for s in SAMPLE_STATUSES)
    body = f"""
        SELECT sample_id, status, trained_step, trained_version, error FROM s
        WHERE (status IS NOT NULL AND status NOT IN ({known}))
           OR (coalesce(status, 'trained') = 'trained' AND (trained_step IS NULL OR trained_version IS NULL))
           OR (status <> 'trained' AND trained_step IS NOT NULL)
           OR (status IN ('failed', 'dropped') AND (error IS NULL OR error = ''))
        ORDER BY sample_id
    """
    count, examples = _query(samples, run_id, body, [], limit)
    return CheckResult("status_violations", count, examples)


def run_checks(run_id: str, max_staleness: int, catalog: Catalog | None = None,
               namespace: str = NAMESPACE) -> dict[str, CheckResult]:
    """All sample checks for one run, read from the lake."""
    samples = load_samples(run_id, catalog, namespace)
    return {c.name: c for c in (duplicate_sample_ids(samples, run_id),
                                staleness_violations(samples, max_staleness, run_id),
                                version_order_violations(samples, run_id), status_violations(samples, run_id))}
