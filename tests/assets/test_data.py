import dagster as dg

from assets.data import task_dataset
from assets.resources import resources_for
from factory.lake import sql

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
