"""`factory runs compare`'s recipe diff: pure logic over two recorded recipes."""

from factory.lake.runs import flatten, recipe_diff


def test_recipe_diff_names_each_changed_field_and_ignores_the_name():
    a = {"name": "a", "train": {"lr": 5e-5, "steps": 10}, "async": {"max_staleness": 0}}
    b = {"name": "b", "train": {"lr": 1e-4, "steps": 10}, "async": {"max_staleness": 2}, "eval": {"seed": 3}}
    assert flatten(a)["train.lr"] == 5e-5
    assert recipe_diff(a, b) == [("async.max_staleness", 0, 2), ("eval.seed", "—", 3), ("train.lr", 5e-5, 1e-4)]
    assert recipe_diff(a, a) == []
