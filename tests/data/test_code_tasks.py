"""Code tasks: the JSONL loader (common HumanEval-style shape, one-line errors), a stable disjoint
split, and the family selectable from a recipe beside reasoning-gym families."""

from __future__ import annotations

import json

import pytest

from factory.data.code_tasks import DEFAULT_PATH, code_family_tasks, load_code_tasks
from factory.data.tasks import ReasoningGymSource, TaskFamilySpec
from factory.recipe import recipe_from_dict

ROW = {"prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n", "entry_point": "add", "canonical_solution": "    return a + b\n",
       "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"}


def write(tmp_path, rows) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_the_repository_set():
    tasks = load_code_tasks()
    assert len(tasks) >= 30 and len({t.task_id for t in tasks}) == len(tasks)
    for t in tasks:
        assert t.family == "code_tasks" and t.metadata["prompt"] in t.question
        assert t.answer == t.metadata["prompt"] + t.metadata["canonical_solution"]
        compile(t.answer, t.task_id, "exec")


def test_common_shape_with_defaults_and_extra_fields(tmp_path):
    path = write(tmp_path, [ROW, "", {**ROW, "task_id": "HumanEval/7", "difficulty": "easy"}])
    first, second = load_code_tasks(path)
    assert first.task_id == "tasks/1"  # no task_id: file stem and line number
    assert second.task_id == "HumanEval/7" and second.metadata["difficulty"] == "easy"
    assert first.metadata["entry_point"] == "add" and first.answer.endswith("return a + b\n")


@pytest.mark.parametrize("line, message", [
    ("{not json", r"tasks.jsonl:1: invalid JSON"),
    ("[1, 2]", r"tasks.jsonl:1: expected a JSON object, got list"),
    (json.dumps({k: v for k, v in ROW.items() if k != "test"}), r"tasks.jsonl:1: field 'test' must be a non-empty string"),
    (json.dumps({**ROW, "entry_point": "not a name"}), r"tasks.jsonl:1: entry_point 'not a name' is not a Python name"),
    (json.dumps({**ROW, "test": "assert add(1, 2) == 3"}), r"tasks.jsonl:1: test must define check\(candidate\)"),
])
def test_malformed_lines_are_one_line_errors(tmp_path, line, message):
    with pytest.raises(ValueError, match=message) as err:
        load_code_tasks(write(tmp_path, [line]))
    assert "\n" not in str(err.value)


def test_duplicates_missing_and_empty_files(tmp_path):
    with pytest.raises(ValueError, match=r":2: duplicate task_id 'a'"):
        load_code_tasks(write(tmp_path, [{**ROW, "task_id": "a"}, {**ROW, "task_id": "a"}]))
    with pytest.raises(ValueError, match="no such code task file"):
        load_code_tasks(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="holds no tasks"):
        load_code_tasks(write(tmp_path, [""]))


def test_split_is_stable_disjoint_and_configurable():
    train = code_family_tasks({}, "train", seed=0)
    heldout = code_family_tasks({}, "heldout", seed=0)
    assert {t.task_id for t in train}.isdisjoint(t.task_id for t in heldout)
    assert len(train) + len(heldout) == len(load_code_tasks(DEFAULT_PATH))
    assert [t.task_id for t in heldout] == [t.task_id for t in code_family_tasks({}, "heldout", seed=0)]
    assert [t.task_id for t in heldout] != [t.task_id for t in code_family_tasks({}, "heldout", seed=1)]
    assert len(code_family_tasks({"heldout_fraction": 0.9}, "heldout", seed=0)) > len(heldout)
    with pytest.raises(ValueError, match=r"code_tasks: unknown option\(s\) \['size'\]"):
        code_family_tasks({"size": 3}, "train", seed=0)
    with pytest.raises(ValueError, match="heldout_fraction must lie in"):
        code_family_tasks({"heldout_fraction": 1.5}, "train", seed=0)


def test_selectable_from_a_recipe_beside_reasoning_gym(tmp_path):
    rows = [{**ROW, "task_id": f"t{i}", "prompt": ROW["prompt"].replace("add", f"add{i}"), "entry_point": f"add{i}"}
            for i in range(40)]
    recipe = recipe_from_dict({"data": {"families": [
        {"name": "code_tasks", "config": {"path": str(write(tmp_path, rows)), "heldout_fraction": 0.5}},
        {"name": "basic_arithmetic", "config": {"min_digits": 1, "max_digits": 1}},
    ], "train_size": 60, "heldout_size": 20}})
    source = ReasoningGymSource.from_recipe(recipe.data)
    code_train = [t for t in source.train if t.family == "code_tasks"]
    code_heldout = [t for t in source.heldout if t.family == "code_tasks"]
    assert len(code_heldout) == 10 and 0 < len(code_train) <= 30  # weights 1 : 1 of 20 held out
    assert {t.task_id for t in code_train}.isdisjoint(t.task_id for t in code_heldout)
    assert {t.family for t in source.train} == {"code_tasks", "basic_arithmetic"}
    alone = ReasoningGymSource([TaskFamilySpec("code_tasks", {})], train_size=1000, heldout_size=1000)
    assert len(alone.train) + len(alone.heldout) == len(load_code_tasks())  # a small family gives what it has
