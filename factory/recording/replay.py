"""Replay a run from the lake: retrain its recorded batches, in their order, from its base policy.

The audit tool for "what exactly trained this checkpoint". No rollout engine, no Ray: the trainer runs
in this process on the `samples` rows the run recorded as trained (each step's batch ordered by
`batch_position`, grouped by `group_id`), with the recipe the run recorded, from the base policy it
recorded (checked by fingerprint). At the end the weights are compared with the run's checkpoint of
the last step replayed.

Replaying is exact when the recorded data is complete and the trainer is deterministic, which on one
machine with the recipe's `train.threads` it is (the same float operations in the same order): the
weights come out bitwise equal, at any η, because the batches are read back rather than regenerated.
Another machine (other BLAS kernels) or thread count may differ in the last bits; the result reports
the largest difference. A step whose rows are missing, or fewer than the trainer saw (the `steps`
table's `train/samples`), is reported as incomplete and replay stops before it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from factory.lake.rows import unpack_routing
from factory.lake.schemas import NAMESPACE
from factory.support.threads import shape_of
from factory.core.types import Batch, Group, Sample, Task

# the columns a Sample needs back
_SAMPLE_COLUMNS = ("sample_id", "group_id", "task_id", "prompt_ids", "completion_ids", "logprobs", "loss_mask",
                   "versions", "reward", "env", "turns", "finish_reason", "support", "teacher_logprobs",
                   "routed_experts")

_DECODED = ("support", "teacher_logprobs", "routed_experts")  # columns stored otherwise than a Sample holds them


class ReplayError(ValueError):
    """The run cannot be replayed (unknown run, no recipe, another base policy); the message says why."""


@dataclass
class ReplayResult:
    run_id: str
    steps: int  # steps replayed
    incomplete: list[dict[str, Any]] = field(default_factory=list)  # {step, rows, expected}
    checkpoint: str | None = None  # the run's checkpoint compared against
    max_abs_diff: float | None = None  # largest |replayed − checkpoint| over every weight
    bitwise: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def trained_batches(run_id: str, catalog, namespace: str = NAMESPACE) -> dict[int, tuple[int, list[Group]]]:
    """{step: (trained version, groups in the order the trainer saw them)} from the lake."""
    from pyiceberg.expressions import EqualTo

    table = catalog.load_table((namespace, "samples"))
    if table.current_snapshot() is None:
        return {}
    columns = (*_SAMPLE_COLUMNS, "trained_step", "trained_version", "batch_position", "status")
    rows = table.scan(row_filter=EqualTo(term="run_id", value=run_id), selected_fields=columns).to_arrow().to_pylist()
    by_step: dict[int, list[dict]] = {}
    for row in rows:
        if row["trained_step"] is not None and row["status"] in (None, "trained"):
            by_step.setdefault(row["trained_step"], []).append(row)
    batches = {}
    for step, step_rows in by_step.items():
        step_rows.sort(key=lambda r: (r["batch_position"] is None, r["batch_position"], r["sample_id"]))
        groups: dict[str, Group] = {}  # insertion order = batch order
        for row in step_rows:
            sample = Sample(**{c: row[c] for c in _SAMPLE_COLUMNS if c not in _DECODED},
                            support=row["support"] or [], teacher_logprobs=row["teacher_logprobs"] or [],
                            routed_experts=unpack_routing(row["routed_experts"]))
            group = groups.setdefault(row["group_id"], Group(row["group_id"], Task(row["task_id"], "", "", ""), []))
            group.samples.append(sample)
        batches[step] = (step_rows[0]["trained_version"], list(groups.values()))
    return batches


def recorded_recipe(run_id: str, catalog, namespace: str = NAMESPACE):
    """The recipe and base-policy fingerprint the run recorded (its first attempt's `runs` row)."""
    from pyiceberg.expressions import EqualTo

    import yaml

    from factory.recipe import recipe_from_dict

    table = catalog.load_table((namespace, "runs"))
    rows = [] if table.current_snapshot() is None else table.scan(
        row_filter=EqualTo(term="run_id", value=run_id),
        selected_fields=("start_step", "recipe_yaml", "base_policy_fingerprint"),
    ).to_arrow().to_pylist()
    if not rows:
        raise ReplayError(f"run {run_id!r}: not in the lake's runs table (was lake.enabled on? `factory runs list` "
                          "shows the runs it knows)")
    first = min(rows, key=lambda r: r["start_step"])
    return recipe_from_dict(yaml.safe_load(first["recipe_yaml"]), f"run {run_id}'s recorded recipe"), \
        first["base_policy_fingerprint"]


def expected_samples(run_id: str, catalog, namespace: str = NAMESPACE) -> dict[int, int]:
    """{step: how many samples the trainer took at it}, from the `steps` table's train/samples."""
    from pyiceberg.expressions import EqualTo

    table = catalog.load_table((namespace, "steps"))
    if table.current_snapshot() is None:
        return {}
    rows = table.scan(row_filter=EqualTo(term="run_id", value=run_id),
                      selected_fields=("step", "metrics")).to_arrow().to_pylist()
    return {r["step"]: int(dict(r["metrics"]).get("train/samples", -1)) for r in rows}


def final_checkpoint(run_id: str, step: int, catalog, namespace: str = NAMESPACE) -> Path | None:
    from pyiceberg.expressions import And, EqualTo

    table = catalog.load_table((namespace, "checkpoints"))
    if table.current_snapshot() is None:
        return None
    rows = table.scan(row_filter=And(EqualTo(term="run_id", value=run_id), EqualTo(term="step", value=step)),
                      selected_fields=("path",)).to_arrow().to_pylist()
    paths = [Path(r["path"]) for r in rows if r["path"] and Path(r["path"]).is_dir()]
    return paths[0] if paths else None


def replay(run_id: str, catalog=None, namespace: str = NAMESPACE, checkpoint: Path | None = None,
           out_dir: Path | None = None, on_step: Callable[[int, int], None] | None = None) -> ReplayResult:
    """Retrain `run_id` from its base policy on its recorded batches; compare with `checkpoint` (default:
    the run's checkpoint at the last step replayed). `out_dir`: save the replayed policy there."""
    import torch
    from transformers import AutoModelForCausalLM

    from factory.lake.catalog import open_catalog
    from factory.recording.lineage import policy_fingerprint
    from factory.model.policy_cache import base_policy_path
    from factory.training.trainer import Trainer

    catalog = catalog if catalog is not None else open_catalog(namespace=namespace)
    recipe, fingerprint = recorded_recipe(run_id, catalog, namespace)
    policy = base_policy_path(recipe)
    if policy is None or not (Path(policy) / "config.json").is_file():
        raise ReplayError(f"run {run_id!r}: its base policy {policy} is not on this machine (build it with "
                          "`factory run` on the same recipe, or copy it there)")
    if fingerprint and policy_fingerprint(policy) != fingerprint:
        raise ReplayError(f"run {run_id!r}: the base policy at {policy} is not the one the run started from "
                          f"(fingerprint {policy_fingerprint(policy)} != recorded {fingerprint})")
    batches = trained_batches(run_id, catalog, namespace)
    if not batches:
        raise ReplayError(f"run {run_id!r}: no trained samples in the lake")
    expected = expected_samples(run_id, catalog, namespace)
    last = max(max(batches), max(expected, default=0))
    result = ReplayResult(run_id, 0)
    trainer = Trainer(str(policy), recipe.algorithm, recipe.train, recipe.rollout, shape_of(recipe))
    for step in range(1, last + 1):
        version, groups = batches.get(step, (step - 1, []))
        rows = sum(len(g.samples) for g in groups)
        if not groups or (step in expected and rows != expected[step]):
            result.incomplete.append({"step": step, "rows": rows, "expected": expected.get(step)})
            break  # what follows was trained on weights this replay cannot reproduce
        trainer.train_step(Batch(version=version, groups=groups))
        result.steps = step
        if on_step:
            on_step(step, last)
    if out_dir is not None:
        trainer.save_hf(out_dir)
    checkpoint = checkpoint or final_checkpoint(run_id, result.steps, catalog, namespace)
    if checkpoint is not None and result.steps:
        result.checkpoint = str(checkpoint)
        # loaded as transformers loads it: a mixture of experts' per-expert tensors become the trainer's fused
        # ones, and a sharded checkpoint's files are read through their index
        saved = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
        replayed = trainer.named_weights()
        diffs = [float((w.float() - saved[name].float()).abs().max()) for name, w in replayed.items()]
        result.max_abs_diff = max(diffs)
        result.bitwise = all(torch.equal(w, saved[name]) for name, w in replayed.items())
    return result


def main_text(result: ReplayResult) -> str:
    """What `factory replay` prints."""
    lines = [f"replayed {result.steps} steps of {result.run_id} from its base policy"]
    for gap in result.incomplete:
        lines.append(f"incomplete: step {gap['step']} has {gap['rows']} trained samples in the lake, the trainer took "
                     f"{gap['expected'] if gap['expected'] is not None else 'an unknown number'}; stopped before it")
    if result.checkpoint is None:
        lines.append("no checkpoint of that step to compare with")
    elif result.bitwise:
        lines.append(f"weights: bitwise identical to {result.checkpoint}")
    else:
        lines.append(f"weights: differ from {result.checkpoint} by at most {result.max_abs_diff:.3g}")
    return "\n".join(lines) + "\n" + json.dumps(result.to_dict())
