"""The lake's rows: a run's samples as `samples` rows (trained, untrained, failed, dropped, evaluation
episodes), and any row checked and normalised against its table's spec before the writer queues it."""

from __future__ import annotations

import json
import sys
from array import array
from datetime import datetime, UTC
from typing import Any

from factory.core.types import Batch, Sample
from factory.lake.schemas import TableSpec


def normalize(spec: TableSpec, row: dict[str, Any], run_id: str | None) -> dict[str, Any]:
    """`row` as `spec`'s table stores it: known columns only, its run (`run_id`, the writer's, when it
    names none), every key column set, JSON columns as text, number maps of numbers, timestamps filled in."""
    row = dict(row)
    unknown = row.keys() - spec.columns
    if unknown:
        raise ValueError(f"lake table {spec.name!r} has no column(s) {sorted(unknown)}")
    if spec.run_scoped and row.get("run_id") is None:
        if run_id is None:
            raise ValueError(f"lake table {spec.name!r}: row has no run_id and the writer has none")
        row["run_id"] = run_id
    for column in spec.key:
        if row.get(column) is None:
            raise ValueError(f"lake table {spec.name!r}: row is missing key column {column!r}")
    for column in spec.json_columns:
        value = row.get(column)
        if value is not None and not isinstance(value, str):
            row[column] = json.dumps(value, sort_keys=True, default=str)
    for column in spec.number_maps:  # a step's metrics may carry a stray string or None
        if isinstance(row.get(column), dict):
            row[column] = {str(k): float(v) for k, v in row[column].items()
                           if isinstance(v, (int, float))}
    for column in spec.now_columns:
        if row.get(column) is None:
            row[column] = datetime.now(UTC)
    return row



def pack_routing(routed: list[list[list[int]]]) -> bytes | None:
    """A sample's per-token routing (`Sample.routed_experts`) as the lake's `routed_experts` bytes:
    int16 little-endian, a header (layers, experts per token) then tokens x layers x k expert ids,
    -1 for a token with none. Two bytes per expert id, the least a list column would take per value."""
    first = next((r for r in routed if r), None)
    if first is None:
        return None
    layers, k = len(first), len(first[0])
    flat = [layers, k]
    for experts in routed:
        flat.extend(e for layer in experts for e in layer) if experts else flat.extend([-1] * (layers * k))
    packed = array("h", flat)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_routing(blob: bytes | None) -> list[list[list[int]]]:
    """`pack_routing`'s inverse ([] for None)."""
    if not blob:
        return []
    flat = array("h")
    flat.frombytes(blob)
    if sys.byteorder != "little":
        flat.byteswap()
    layers, k = flat[0], flat[1]
    width = layers * k
    out: list[list[list[int]]] = []
    for t in range(2, len(flat), width):
        token = flat[t: t + width]
        out.append([] if token[0] < 0 else [list(token[i * k: (i + 1) * k]) for i in range(layers)])
    return out


def sample_row(sample: Sample, run_id: str, status: str, step: int, *, trained_version: int | None = None,
               sample_id: str | None = None, info: dict[str, Any] | None = None,
               batch_position: int | None = None) -> dict[str, Any]:
    """The `samples` row of one generated sample whose fate is `status` (`schemas.SAMPLE_STATUSES`),
    recorded at optimizer step `step`. Trained rows carry `trained_version` and their staleness."""
    trained = status == "trained"
    if trained and trained_version is None:
        raise ValueError(f"sample {sample.sample_id}: a trained row needs its trained_version")
    return {
        "run_id": run_id, "sample_id": sample_id or sample.sample_id, "group_id": sample.group_id,
        "task_id": sample.task_id, "prompt_ids": sample.prompt_ids, "completion_ids": sample.completion_ids,
        "logprobs": sample.logprobs, "versions": sample.versions, "loss_mask": sample.loss_mask,
        "reward": sample.reward, "turns": sample.turns, "env": sample.env,
        "finish_reason": sample.finish_reason, "timings": sample.timings, "info": {**sample.info, **(info or {})} or None,
        "trained_step": step if trained else None, "trained_version": trained_version if trained else None,
        "staleness": trained_version - sample.oldest_version if trained and trained_version is not None else None,
        "status": status, "step": step, "prompt_text": sample.prompt_text or None,
        "completion_text": sample.completion_text or None, "support": sample.support or None,
        "teacher_logprobs": sample.teacher_logprobs or None, "batch_position": batch_position,
        "routed_experts": pack_routing(sample.routed_experts),
    }


def sample_rows(batch: Batch, run_id: str, step: int) -> list[dict[str, Any]]:
    """Rows for the `samples` table from the batch the trainer consumed at optimizer step `step`.

    staleness = batch.version − (version of the sample's oldest sampled token).
    """
    return [sample_row(s, run_id, "trained", step, trained_version=batch.version, batch_position=i)
            for i, s in enumerate(batch.samples)]


def evaluation_rows(run_id: str, step: int, version: int, suite: str, tag: str, episodes: list) -> list[dict[str, Any]]:
    """`samples` rows of an evaluation's episodes (status `evaluation`), ids `eval-{step}-{episode id}`: two
    evaluations of one run never share an id (their episode ids carry the evaluation's tag)."""
    return [sample_row(e, run_id, "evaluation", step, sample_id=f"eval-{step}-{e.sample_id}",
                       info={"suite": suite, "tag": tag, "version": version}) for e in episodes if e is not None]


def failed_row(run_id: str, group_id: str, task_id: str, env: str, error: str, step: int) -> dict[str, Any]:
    """The one `samples` row of a group whose episode raised: no tokens, the error's first line."""
    return {"run_id": run_id, "sample_id": f"{group_id}-failed", "group_id": group_id, "task_id": task_id,
            "env": env, "status": "failed", "step": step, "error": error}


def dropped_row(run_id: str, task_id: str, env: str, error: str) -> dict[str, Any]:
    """The one `samples` row of a task left out at the run's start (`data.overlong: drop`): step 0, no tokens."""
    return {"run_id": run_id, "sample_id": f"dropped-{task_id}", "task_id": task_id, "env": env, "status": "dropped",
            "step": 0, "error": error}
