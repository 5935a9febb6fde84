"""The lake's tables in one place: Iceberg schema, partitioning, row key and resume position of each.

| table        | one row per                          | key                     | partitioned by |
|--------------|--------------------------------------|-------------------------|----------------|
| tasks        | task of one dataset                  | dataset, task_id        | dataset        |
| samples      | generated trajectory, with its fate  | run_id, sample_id       | run_id         |
| steps        | optimizer step (its metrics)         | run_id, step            | run_id         |
| evaluations  | (checkpoint, suite) evaluation       | run_id, step, suite     | run_id         |
| checkpoints  | saved checkpoint                     | run_id, step            | run_id         |

Token-level columns of `samples` (`completion_ids`, `logprobs`, `versions`, `loss_mask`) are
aligned: element i of each describes completion token i (see `factory.core.types.Sample`).
`routed_experts` (mixture-of-experts policies with routing replay) packs the same per-token
alignment into bytes: `factory.lake.rows.pack_routing`.
`tasks.dataset` is the fingerprint of the recipe's `data` section and of each file source's rows
(`factory.data.tasks.dataset_fingerprint`; runs name it in `runs.origin`): task ids like
`basic_arithmetic/train/0` repeat across datasets, so they are unique only within one.
`samples.status` is each generated sample's fate (`SAMPLE_STATUSES`): `trained` (exactly once, with
`trained_step`), `filtered` (its group had no reward variance), `rejected` (too stale, or its group
was left too small), `unused` (queued when the run ended), `failed` (its group raised: one row per
group with `error`, no tokens), `evaluation` (a held-out episode; `info.suite`, `info.tag`) and `dropped`
(a task left out at the run's start, its prompt longer than the engines' context: `data.overlong: drop`;
one row per task at step 0 with `error`, no tokens).
`batch_position` is a trained sample's index in its step's batch (the order the trainer saw).
`step` is the optimizer step at which the row was recorded (= `trained_step` for trained rows): a
resumed run deletes its rows beyond the checkpoint by it. Rows written before `status` existed have
none; they are trained samples.
New columns go at the end of a schema: `catalog.ensure_tables` adds them to existing tables.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import pyarrow as pa
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import (
    BinaryType,
    DoubleType,
    FloatType,
    IcebergType,
    IntegerType,
    ListType,
    MapType,
    NestedField,
    PrimitiveType,
    StringType,
    TimestamptzType,
)

NAMESPACE = "factory"

# (name, type, required); a type is a primitive, ("list", element) or ("map", key, value).
_Column = tuple[str, Any, bool]


@dataclass(frozen=True)
class TableSpec:
    """Everything the writer, the queries and the checks need to know about one table."""

    name: str
    schema: Schema
    partition_spec: PartitionSpec
    key: tuple[str, ...]  # columns that identify a row: the writer commits each key once
    scope: str | None = None  # the partition column; the writer reads committed keys one value of it at a time
    position: str | None = None  # column whose max is "how far this run got" (resume point)
    json_columns: tuple[str, ...] = ()  # string columns holding JSON (dicts are dumped on write)
    now_columns: tuple[str, ...] = ()  # timestamp columns the writer fills with the append time
    number_maps: tuple[str, ...] = ()  # map<string,double> columns: non-numeric values are dropped
    properties: dict[str, str] = field(default_factory=dict)

    @cached_property
    def arrow(self) -> pa.Schema:
        """The Arrow schema rows are validated against (with the Iceberg field ids)."""
        return self.schema.as_arrow()

    @cached_property
    def columns(self) -> frozenset[str]:
        return frozenset(self.arrow.names)

    @property
    def run_scoped(self) -> bool:
        return "run_id" in self.key


def _typed(spec: Any, ids: itertools.count) -> IcebergType:
    """Turn a column type spec into an Iceberg type, numbering nested fields from `ids`."""
    if isinstance(spec, PrimitiveType):
        return spec
    kind, *args = spec
    if kind == "list":
        return ListType(element_id=next(ids), element_type=_typed(args[0], ids), element_required=False)
    if kind == "map":
        key_id, value_id = next(ids), next(ids)
        return MapType(key_id=key_id, key_type=_typed(args[0], ids), value_id=value_id,
                       value_type=_typed(args[1], ids), value_required=False)
    raise ValueError(f"unknown column type {spec!r}")


def _schema(columns: list[_Column]) -> Schema:
    # top-level columns get ids 1..n so partition specs can name them by position; nested after
    top = itertools.count(1)
    nested = itertools.count(len(columns) + 1)
    return Schema(*[NestedField(next(top), name, _typed(typ, nested), required=required)
                    for name, typ, required in columns])


def _by(schema: Schema, column: str) -> PartitionSpec:
    """One partition per value of `column`: `identity(column)`."""
    source = schema.find_field(column).field_id
    return PartitionSpec(PartitionField(source_id=source, field_id=1000, transform=IdentityTransform(),
                                        name=column))


_TABLE_PROPERTIES = {
    # old metadata files are deleted on commit, keeping 100 so that a slow reader on a shared table
    # still finds the file it was pointed to (a writer that does not reloads and retries)
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": "100",
    # merge small manifests once 20 pile up: each streamed commit adds one, and every later commit reads them all
    "commit.manifest-merge.enabled": "true",
    "commit.manifest.min-count-to-merge": "20",
}

_S, _I, _D, _F, _T = StringType(), IntegerType(), DoubleType(), FloatType(), TimestamptzType()

_TASKS = _schema([
    ("task_id", _S, True), ("family", _S, False), ("question", _S, False), ("answer", _S, False),
    ("split", _S, False), ("dataset", _S, True),
])
_SAMPLES = _schema([
    ("run_id", _S, True), ("sample_id", _S, True), ("group_id", _S, False), ("task_id", _S, False),
    ("prompt_ids", ("list", _I), False), ("completion_ids", ("list", _I), False),
    ("logprobs", ("list", _F), False), ("versions", ("list", _I), False),
    ("loss_mask", ("list", _I), False), ("reward", _D, False), ("turns", _I, False),
    ("env", _S, False), ("finish_reason", _S, False), ("timings", _S, False), ("info", _S, False),
    ("trained_step", _I, False), ("trained_version", _I, False), ("staleness", _I, False),
    ("written_at", _T, False), ("status", _S, False), ("step", _I, False), ("error", _S, False),
    ("prompt_text", _S, False), ("completion_text", _S, False), ("support", ("list", ("list", _I)), False),
    ("teacher_logprobs", ("list", _F), False), ("batch_position", _I, False),
    ("routed_experts", BinaryType(), False),
])
SAMPLE_STATUSES = ("trained", "filtered", "rejected", "unused", "failed", "evaluation", "dropped")
_STEPS = _schema([
    ("run_id", _S, True), ("step", _I, True), ("metrics", ("map", _S, _D), False), ("time", _T, False),
])
_EVALUATIONS = _schema([
    ("run_id", _S, True), ("step", _I, True), ("version", _I, False), ("suite", _S, True),
    ("n", _I, False), ("mean", _D, False), ("stderr", _D, False), ("by_family", _S, False),
    ("time", _T, False), ("tasks_digest", _S, False), ("checkpoint", _S, False), ("lineage", _S, False),
])
_CHECKPOINTS = _schema([
    ("run_id", _S, True), ("step", _I, True), ("version", _I, False), ("path", _S, False),
    ("time", _T, False), ("lineage", _S, False),
])
# One row per attempt of a run (start_step 0, or the checkpoint step it resumed from): where it came from
_RUNS = _schema([
    ("run_id", _S, True), ("start_step", _I, True), ("recipe_hash", _S, False), ("recipe_yaml", _S, False),
    ("git_sha", _S, False), ("git_dirty", _S, False), ("base_policy_fingerprint", _S, False),
    ("dagster_run_id", _S, False), ("mlflow_run_id", _S, False), ("parent", _S, False), ("origin", _S, False),
    ("started_at", _T, False),
])

TABLES: dict[str, TableSpec] = {
    "tasks": TableSpec("tasks", _TASKS, _by(_TASKS, "dataset"), key=("dataset", "task_id"), scope="dataset",
                       properties=_TABLE_PROPERTIES),
    "samples": TableSpec("samples", _SAMPLES, _by(_SAMPLES, "run_id"), key=("run_id", "sample_id"), scope="run_id",
                         position="step", json_columns=("timings", "info"),
                         now_columns=("written_at",), properties=_TABLE_PROPERTIES),
    "steps": TableSpec("steps", _STEPS, _by(_STEPS, "run_id"), key=("run_id", "step"), scope="run_id",
                       position="step", now_columns=("time",), number_maps=("metrics",),
                       properties=_TABLE_PROPERTIES),
    "evaluations": TableSpec("evaluations", _EVALUATIONS, _by(_EVALUATIONS, "run_id"),
                             key=("run_id", "step", "suite"), scope="run_id", position="step",
                             json_columns=("by_family", "lineage"), now_columns=("time",),
                             properties=_TABLE_PROPERTIES),
    "checkpoints": TableSpec("checkpoints", _CHECKPOINTS, _by(_CHECKPOINTS, "run_id"), key=("run_id", "step"),
                             scope="run_id", position="step", now_columns=("time",), json_columns=("lineage",),
                             properties=_TABLE_PROPERTIES),
    "runs": TableSpec("runs", _RUNS, _by(_RUNS, "run_id"), key=("run_id", "start_step"), scope="run_id",
                      json_columns=("origin",), now_columns=("started_at",), properties=_TABLE_PROPERTIES),
}


def table_spec(name: str) -> TableSpec:
    try:
        return TABLES[name]
    except KeyError:
        raise ValueError(f"unknown lake table {name!r}; known: {', '.join(TABLES)}") from None
