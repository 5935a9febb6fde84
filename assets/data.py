"""Task datasets: a recipe's train and held-out tasks, written to the lake's `tasks` table."""

from collections import Counter

import dagster as dg

from assets.resources import LakeResource
from assets.runs import RecipeConfig, user_error


def _task_rows(tasks, split: str, dataset: str) -> list[dict]:
    return [{"task_id": t.task_id, "family": t.family, "question": t.question, "answer": t.answer, "split": split,
             "dataset": dataset} for t in tasks]


@dg.asset(group_name="data", kinds={"iceberg"})
def task_dataset(context: dg.AssetExecutionContext, config: RecipeConfig, lake: LakeResource) -> dg.MaterializeResult:
    """The recipe's tasks (reasoning-gym families and file sources; disjoint train and held-out splits) in
    the lake's `tasks` table, under the dataset's fingerprint (`dataset`: the data section, and each file
    source's content). Every source is read and checked before anything is written."""
    from factory.data.tasks import ReasoningGymSource, dataset_fingerprint

    recipe = config.load()
    source = ReasoningGymSource.from_recipe(recipe.data)
    try:
        splits = {"train": source.train, "heldout": source.heldout}
    except ValueError as err:  # a bad family or source: one line naming the field, file and row
        raise user_error(str(err)) from None
    dataset = dataset_fingerprint(recipe.data, source.files)
    rows = [row for split, tasks in splits.items() for row in _task_rows(tasks, split, dataset)]
    with lake.writer(recipe) as writer:
        new = writer.append("tasks", rows)
    context.log.info(f"{len(rows)} tasks, {new} new in the lake")

    counts = Counter((row["split"], row["family"]) for row in rows)
    families = sorted({family for _, family in counts})
    table = "| family | train | heldout |\n|---|---:|---:|\n" + "".join(
        f"| {f} | {counts['train', f]} | {counts['heldout', f]} |\n" for f in families)
    return dg.MaterializeResult(metadata={
        "tasks": len(rows),
        "train": len(splits["train"]),
        "heldout": len(splits["heldout"]),
        "new_rows": new,
        "per_family": dg.MetadataValue.md(table),
        "sources": dg.MetadataValue.md("".join(f"- {f.describe()}; content {f.content_digest}\n" for f in source.files)
                                       or "none (reasoning-gym families only)"),
        "counts": {f"{split}/{family}": n for (split, family), n in sorted(counts.items())},
        "recipe": recipe.name,
        "dataset": dataset,
        "table": f"{lake.namespace_for(recipe)}.tasks",
    }, data_version=dg.DataVersion(dataset))
