"""Task datasets: a recipe's train and held-out tasks, written to the lake's `tasks` table."""

import hashlib
import json
from collections import Counter

import dagster as dg

from assets.resources import LakeResource
from assets.runs import RecipeConfig


def _task_rows(tasks, split: str) -> list[dict]:
    return [{"task_id": t.task_id, "family": t.family, "question": t.question, "answer": t.answer, "split": split}
            for t in tasks]


@dg.asset(group_name="data", kinds={"iceberg"})
def task_dataset(context: dg.AssetExecutionContext, config: RecipeConfig, lake: LakeResource) -> dg.MaterializeResult:
    """The recipe's reasoning-gym tasks (disjoint train and held-out splits) in the lake's `tasks` table."""
    from factory.data.tasks import ReasoningGymSource

    recipe = config.load()
    source = ReasoningGymSource.from_recipe(recipe.data)
    splits = {"train": source.train, "heldout": source.heldout}
    rows = [row for split, tasks in splits.items() for row in _task_rows(tasks, split)]
    with lake.writer(recipe) as writer:
        new = writer.append("tasks", rows)
    context.log.info(f"{len(rows)} tasks, {new} new in the lake")

    counts = Counter((row["split"], row["family"]) for row in rows)
    families = sorted({family for _, family in counts})
    table = "| family | train | heldout |\n|---|---:|---:|\n" + "".join(
        f"| {f} | {counts['train', f]} | {counts['heldout', f]} |\n" for f in families)
    data_hash = hashlib.sha256(json.dumps(recipe.data.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    return dg.MaterializeResult(metadata={
        "tasks": len(rows),
        "train": len(splits["train"]),
        "heldout": len(splits["heldout"]),
        "new_rows": new,
        "per_family": dg.MetadataValue.md(table),
        "counts": {f"{split}/{family}": n for (split, family), n in sorted(counts.items())},
        "recipe": recipe.name,
        "data_fingerprint": data_hash[:12],
        "table": f"{lake.namespace_for(recipe)}.tasks",
    }, data_version=dg.DataVersion(data_hash[:12]))
