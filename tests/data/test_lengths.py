"""Prompt lengths against the engines' context (factory/data/lengths.py): the summary and the one-line
error of the recipe check, `data.overlong` (error, drop, truncate) at a run's start, the lake's `dropped`
rows, and the default recipe's fingerprints left as they were."""

from __future__ import annotations

import json
import random
import re
import string
from pathlib import Path

import pytest

from factory.data.lengths import PromptLengths, fit_prompts, measure, prompt_lengths
from factory.data.tasks import ReasoningGymSource, dataset_fingerprint
from factory.model.tiny import build_tokenizer
from factory.model.tokens import encode_chat, load_tokenizer
from factory.recipe import RecipeError, recipe_from_dict
from factory.core.types import Task

LIMIT = 256 - 8  # the default rollout.max_model_len - rollout.max_new_tokens
ERROR_END = "raise rollout.max_model_len, lower rollout.max_new_tokens, or set data.overlong: drop | truncate"


def long_rows(n: int = 40, every: int = 4) -> list[dict]:
    """`n` sums; every `every`-th preceded by 300 random letters (~300 tokens of the tiny tokenizer, which
    learns no merges for them), with its question also as chat messages."""
    rng = random.Random(0)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        pad = "".join(rng.choice(string.ascii_letters) for _ in range(300)) + ". " if i % every == 0 else ""
        question = f"{pad}Calculate {a} + {b}."
        rows.append({"question": question, "answer": str(a + b),
                     "messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": question}]})
    return rows


def long_source(tmp_path: Path, prompt: dict | None = None) -> dict:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in long_rows()))
    return {"name": "long", "kind": "jsonl", "path": str(path), "prompt": prompt or {"field": "question"},
            "heldout": {"size": 8}}


def policy_tokenizer(tmp_path: Path) -> Path:
    """A tiny policy dir holding only its tokenizer (what a run's data check loads)."""
    out = tmp_path / "policy"
    out.mkdir()
    build_tokenizer([r["question"] for r in long_rows()], 300, out)
    return out


def test_the_summary_and_the_error_name_the_limit_and_both_fields():
    tasks = [Task(f"f/train/{i}", "f", "q", "a") for i in range(20)]
    lengths = PromptLengths(tasks, [*range(10, 29), 290], max_model_len=256, max_new_tokens=64)
    assert lengths.limit == 192 and lengths.overlong == [19]
    assert lengths.summary() == ("prompt tokens: median 19, p95 28, max 290 (limit 256 - 64 = 192: "
                                 "rollout.max_model_len - rollout.max_new_tokens)")
    assert lengths.error() == ("data: 1 of 20 prompts are longer than rollout.max_model_len - rollout.max_new_tokens "
                               f"= 192 tokens (longest 290: task f/train/19); {ERROR_END}")


def test_lengths_are_those_of_the_ids_the_gateway_sends(tmp_path):
    tokenizer = load_tokenizer(policy_tokenizer(tmp_path))
    recipe = recipe_from_dict({"environment": {"system_prompt": "Add."}})
    tasks = [Task(f"t{i}", "f", r["question"], r["answer"]) for i, r in enumerate(long_rows(8))]
    expected = [len(encode_chat(tokenizer, [{"role": "system", "content": "Add."}, {"role": "user", "content": t.question}]))
                for t in tasks]
    assert measure(recipe, tokenizer, tasks).lengths == expected
    assert expected[0] > LIMIT > expected[1]  # the padded prompts are over the default limit, the others well under
    assert prompt_lengths(tokenizer, lambda t: [], []) == []


def test_data_overlong_takes_three_values_and_names_itself_otherwise():
    assert recipe_from_dict({"data": {"overlong": "drop"}}).data.overlong == "drop"
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({"data": {"overlong": "cut"}})
    assert str(err.value) == "<recipe>: data.overlong: must be one of 'error', 'drop' or 'truncate', got 'cut'"


def test_data_overlong_at_its_default_leaves_the_fingerprints_as_they_were():
    from factory.model.policy_cache import policy_fingerprint

    recipe = recipe_from_dict({})
    dump = recipe.data.model_dump(mode="json")
    assert "overlong" not in dump and dump == recipe.data.model_dump(mode="json", exclude={"overlong"})
    explicit = recipe_from_dict({"data": {"overlong": "error"}})
    assert policy_fingerprint(explicit) == policy_fingerprint(recipe)
    assert dataset_fingerprint(explicit.data) == dataset_fingerprint(recipe.data)
    assert "overlong" not in recipe.dump()["data"]  # nor in a run dir's recipe.yaml
    assert recipe_from_dict({"data": {"overlong": "drop"}}).data.model_dump(mode="json") == {**dump, "overlong": "drop"}


def test_a_run_refuses_overlong_prompts_in_one_line(tmp_path):
    recipe = recipe_from_dict({"data": {"sources": [long_source(tmp_path)]}})
    source = ReasoningGymSource.from_recipe(recipe.data)
    with pytest.raises(RecipeError) as err:
        fit_prompts(recipe, policy_tokenizer(tmp_path), source)
    (line,) = str(err.value).splitlines()
    assert line.startswith("data: 10 of 40 prompts are longer than rollout.max_model_len - rollout.max_new_tokens = "
                           "248 tokens (longest ") and line.endswith(ERROR_END)


def test_drop_leaves_the_overlong_tasks_out_of_train_and_heldout(tmp_path, caplog):
    recipe = recipe_from_dict({"data": {"sources": [long_source(tmp_path)], "overlong": "drop"}})
    source = ReasoningGymSource.from_recipe(recipe.data)
    before = {t.task_id: t for t in [*source.train, *source.heldout]}
    policy = policy_tokenizer(tmp_path)
    with caplog.at_level("WARNING", logger="factory.data"):
        dropped = fit_prompts(recipe, policy, source)
    long = {i for i, t in before.items() if len(t.question) > 300}
    assert {task for task, _ in dropped} == long and len(long) == 10
    assert [t.task_id for t in source.train + source.heldout] == [i for i in before if i not in long]
    assert source.heldout and all(t.task_id.endswith(tuple("0123456789")) for t in source.heldout)
    assert all(why.startswith("prompt of ") and why.endswith(" tokens is longer than rollout.max_model_len - "
                                                             "rollout.max_new_tokens = 248") for _, why in dropped)
    assert [r.getMessage() for r in caplog.records] == [
        "dropped 10 of 40 tasks whose prompts are longer than rollout.max_model_len - rollout.max_new_tokens = 248 "
        "tokens (data.overlong=drop)"]


@pytest.mark.parametrize("prompt", [{"field": "question"}, {"messages_field": "messages"}])
def test_truncate_cuts_the_user_message_from_its_start_until_the_prompt_fits(tmp_path, prompt):
    recipe = recipe_from_dict({"data": {"sources": [long_source(tmp_path, prompt)], "overlong": "truncate"}})
    source = ReasoningGymSource.from_recipe(recipe.data)
    before = [*source.train, *source.heldout]
    policy = policy_tokenizer(tmp_path)
    assert fit_prompts(recipe, policy, source) == []
    after = [*source.train, *source.heldout]
    lengths = measure(recipe, load_tokenizer(policy), after)
    assert [t.task_id for t in after] == [t.task_id for t in before] and not lengths.overlong

    def user(t: Task) -> str:
        return t.metadata["messages"][-1]["content"] if "messages" in t.metadata else t.question

    cut = [(old, new, n) for old, new, n in zip(before, after, lengths.lengths) if user(old) != user(new)]
    assert len(cut) == 10
    for old, new, n in cut:  # the question's end kept, cut no further than a few tokens under the limit
        assert user(old).endswith(user(new)) and user(new).endswith(user(old)[-20:]) and n > LIMIT - 8
        if "messages" in old.metadata:
            assert new.metadata["messages"][0] == {"role": "system", "content": "Add."}


class EnginesStarting(Exception):
    """Raised where the run would start Ray and its engines: the test's run ends there."""


@pytest.mark.parametrize("overlong", ["error", "drop"])
def test_a_run_checks_its_prompts_before_any_engine_starts(tmp_path, monkeypatch, overlong):
    """`run()` called directly (Dagster, tests) refuses overlong prompts before Ray starts, or drops
    them with one `dropped` row each in the lake."""
    import factory.run as loop
    from factory.lake import sql
    from factory.lake.checks import load_samples, status_violations

    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "state"))
    policy = policy_tokenizer(tmp_path)
    monkeypatch.setattr(loop, "ensure_base_policy", lambda recipe, progress=None: policy)

    def local_ray():
        raise EnginesStarting

    monkeypatch.setattr(loop, "local_ray", local_ray)
    recipe = recipe_from_dict({"data": {"sources": [long_source(tmp_path)], "overlong": overlong},
                               "lake": {"enabled": True}, "tracking": {"enabled": False}})
    with pytest.raises(RecipeError if overlong == "error" else EnginesStarting) as err:
        loop.run(recipe, tmp_path / "run-1")
    if overlong == "error":
        assert len(str(err.value).splitlines()) == 1 and str(err.value).endswith(ERROR_END)
        return
    rows = sql("SELECT task_id, status, step, error, prompt_ids FROM samples ORDER BY task_id").to_pylist()
    assert len(rows) == 10 and {(r["status"], r["step"], r["prompt_ids"]) for r in rows} == {("dropped", 0, None)}
    assert all(r["error"].endswith("is longer than rollout.max_model_len - rollout.max_new_tokens = 248") for r in rows)
    assert status_violations(load_samples("run-1"), "run-1").count == 0


def test_recipe_check_refuses_overlong_prompts_and_prints_the_lengths_when_they_are_dropped(tmp_path, capsys):
    import yaml

    from factory.cli import main

    recipe = tmp_path / "overlong.yaml"
    recipe.write_text(yaml.safe_dump({"name": "overlong", "data": {"sources": [long_source(tmp_path)]}}))
    assert main(["recipe", "check", str(recipe)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert re.fullmatch(re.escape(f"{recipe}: data: 10 of 40 prompts are longer than rollout.max_model_len - "
                                  "rollout.max_new_tokens = 248 tokens (longest ") + r"3\d\d: task long/\d+\); "
                        + re.escape(ERROR_END), line), line
    assert main(["recipe", "check", str(recipe), "data.overlong=drop"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"  prompt tokens: median 1\d, p95 3\d\d, max 3\d\d \(limit 256 - 8 = 248: "
                        r"rollout.max_model_len - rollout.max_new_tokens\)", out[-2]), out
    assert out[-1] == "  10 of 40 prompts are longer than 248 tokens: dropped at the run's start (data.overlong=drop)"
    assert main(["recipe", "check", str(recipe), "rollout.max_model_len=512", "model.max_position=512"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("(limit 512 - 8 = 504: rollout.max_model_len - "
                                                             "rollout.max_new_tokens)")


def test_truncate_names_a_prompt_that_no_cut_of_its_user_message_fits(tmp_path):
    system = "".join(random.Random(1).choice(string.ascii_letters) for _ in range(300))
    recipe = recipe_from_dict({"data": {"sources": [long_source(tmp_path)], "overlong": "truncate"},
                               "environment": {"system_prompt": system}})
    with pytest.raises(RecipeError) as err:
        fit_prompts(recipe, policy_tokenizer(tmp_path), ReasoningGymSource.from_recipe(recipe.data))
    assert re.fullmatch(r"data.overlong: truncate cannot fit task long/\d+: its prompt is \d+ tokens with no user "
                        r"text left, over rollout.max_model_len - rollout.max_new_tokens = 248", str(err.value))
