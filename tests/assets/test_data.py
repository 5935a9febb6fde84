import json

import dagster as dg

from assets.data import task_dataset
from assets.resources import resources_for
from factory.lake import sql
from factory.paths import REPO_ROOT

SMALL = {"ops": {"task_dataset": {"config": {"overrides": ["data.train_size=24", "data.heldout_size=8"]}}}}


def test_task_dataset_writes_the_tasks_table(instance):
    result = dg.materialize([task_dataset], instance=instance, resources=resources_for(), run_config=SMALL)
    assert result.success
    metadata = result.asset_materializations_for_node("task_dataset")[0].metadata
    assert (metadata["train"].value, metadata["heldout"].value, metadata["new_rows"].value) == (24, 8, 32)
    assert metadata["counts"].value == {"heldout/basic_arithmetic": 8, "train/basic_arithmetic": 24}
    query = "SELECT split, count(*) AS n, count(DISTINCT task_id) AS ids FROM tasks GROUP BY 1 ORDER BY 1"
    rows = sql(query).to_pylist()
    assert rows == [{"split": "heldout", "n": 8, "ids": 8}, {"split": "train", "n": 24, "ids": 24}]

    again = dg.materialize([task_dataset], instance=instance, resources=resources_for(), run_config=SMALL)
    assert again.asset_materializations_for_node("task_dataset")[0].metadata["new_rows"].value == 0
    assert sql("SELECT count(*) AS n FROM tasks").to_pylist() == [{"n": 32}]

    # another dataset (another seed) reuses the task ids basic_arithmetic/train/0, …: its rows are kept apart
    other = {"ops": {"task_dataset": {"config": {"overrides": SMALL["ops"]["task_dataset"]["config"]["overrides"]
                                                 + ["data.seed=1"]}}}}
    third = dg.materialize([task_dataset], instance=instance, resources=resources_for(), run_config=other)
    meta = third.asset_materializations_for_node("task_dataset")[0].metadata
    assert meta["new_rows"].value == 32 and meta["dataset"].value != metadata["dataset"].value
    rows = sql("SELECT dataset, count(*) AS n, count(DISTINCT task_id) AS ids FROM tasks GROUP BY 1 ORDER BY 2").to_pylist()
    assert sorted(r["dataset"] for r in rows) == sorted([metadata["dataset"].value, meta["dataset"].value])
    assert [(r["n"], r["ids"]) for r in rows] == [(32, 32), (32, 32)]
    assert sql("SELECT count(DISTINCT task_id) AS n FROM tasks").to_pylist()[0]["n"] < 64  # ids shared by both


def test_a_bad_recipe_is_a_one_line_failure(instance):
    config = {"ops": {"task_dataset": {"config": {"overrides": ["data.train_size=-1"]}}}}
    result = dg.materialize([task_dataset], instance=instance, resources=resources_for(), run_config=config,
                            raise_on_error=False)
    assert not result.success
    failure = result.get_step_failure_events()[0].step_failure_data
    assert "data.train_size: must be > 0" in failure.user_failure_data.description


def gsm8k_config(train, test) -> dict:
    overrides = [f"data.sources[0].path={train}", f"data.sources[0].heldout.path={test}"]
    return {"ops": {"task_dataset": {"config": {"recipe": "recipes/gsm8k_format.yaml", "overrides": overrides}}}}


def write_rows(path, sums) -> None:
    path.write_text("".join(json.dumps({"question": f"Calculate {a} + {b}.", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
                            + "\n" for a, b in sums))


def test_a_file_source_is_written_under_its_content_fingerprint(instance, tmp_path):
    from factory.data.tasks import dataset_fingerprint
    from factory.recipe import load_recipe

    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    write_rows(train, [(1, 2), (3, 4), (5, 6)])
    write_rows(test, [(7, 8)])
    config = gsm8k_config(train, test)
    result = dg.materialize([task_dataset], instance=instance, resources=resources_for(), run_config=config)
    metadata = result.asset_materializations_for_node("task_dataset")[0].metadata
    recipe = load_recipe(REPO_ROOT / "recipes" / "gsm8k_format.yaml", config["ops"]["task_dataset"]["config"]["overrides"])
    assert metadata["dataset"].value == dataset_fingerprint(recipe.data)
    assert metadata["counts"].value == {"heldout/gsm8k_format": 1, "train/gsm8k_format": 3}
    assert "gsm8k_format (jsonl" in metadata["sources"].value
    rows = sql("SELECT dataset, split, task_id, answer FROM tasks ORDER BY task_id").to_pylist()
    assert rows[0] == {"dataset": metadata["dataset"].value, "split": "heldout", "task_id": "gsm8k_format/heldout/0",
                       "answer": "7 + 8 = 15\n#### 15"}

    write_rows(train, [(1, 2), (3, 4), (5, 7)])  # one row changes: another dataset
    again = dg.materialize([task_dataset], instance=instance, resources=resources_for(), run_config=config)
    changed = again.asset_materializations_for_node("task_dataset")[0].metadata
    assert changed["dataset"].value != metadata["dataset"].value and changed["new_rows"].value == 4


def test_a_bad_source_fails_in_one_line_and_writes_nothing(instance, tmp_path):
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    write_rows(train, [(1, 2), (3, 4)])
    test.write_text(json.dumps({"q": "Calculate 7 + 8.", "answer": "#### 15"}) + "\n")
    result = dg.materialize([task_dataset], instance=instance, resources=resources_for(),
                            run_config=gsm8k_config(train, test), raise_on_error=False)
    assert not result.success
    failure = result.get_step_failure_events()[0].step_failure_data
    assert failure.user_failure_data.description == \
        f"data.sources[0].prompt.field: no column 'question' in {test}:1; columns: answer, q"
    assert sql("SELECT count(*) AS n FROM tasks").to_pylist() == [{"n": 0}]
