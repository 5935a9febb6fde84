"""Verifiers by name: each with hand-checked replies it must accept and replies it must refuse, the
spec check a recipe relies on, and scoring through a task's spec (extractor, then verifier)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from factory.rewards import score_answer, verifier_spec, verifier_specs
from factory.rewards.verifiers import (
    VERIFIERS,
    exact_match,
    math_verify_match,
    normalise,
    numeric_match,
    parse_number,
    reasoning_gym_reward,
    regex_match,
    score_with,
    spec_problems,
)
from factory.core.types import Task


def test_every_verifier_the_recipe_names_is_registered():
    assert VERIFIERS.names() == ["code", "exact", "math_verify", "numeric", "reasoning_gym", "regex"]


# ---- exact ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("reply, reference", [
    ("Paris", "Paris"), ("  paris. ", "Paris"), ("New   York", "new york"), ("ｆｕｌｌ width", "full width"),
])
def test_exact_accepts_equal_text_after_normalising(reply, reference):
    assert exact_match(reply, reference) == 1.0


@pytest.mark.parametrize("reply, reference", [
    ("Paris, France", "Paris"), ("Pari", "Paris"), ("", "Paris"), ("4.0", "4"),
])
def test_exact_refuses_different_text(reply, reference):
    assert exact_match(reply, reference) == 0.0


def test_exact_case_sensitive_on_request():
    assert exact_match("paris", "Paris", case_sensitive=True) == 0.0
    assert exact_match("Paris.", "Paris", case_sensitive=True) == 1.0
    assert normalise(" A \n b. ") == "a b"


# ---- numeric -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("-3", -3.0), ("1,234.5", 1234.5), ("$12", 12.0), ("50%", 50.0), ("3/4", 0.75),
    ("-1/2", -0.5), ("1e-3", 0.001), (".5", 0.5), (" 7 ", 7.0),
])
def test_parse_number_reads_numbers_as_written(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["12 apples", "1.2.3", "x", "", "1/0", "3/x", "- 4"])
def test_parse_number_refuses_what_is_not_one_number(text):
    assert parse_number(text) is None


@pytest.mark.parametrize("reply, reference, kwargs", [
    ("72", "72", {}), ("72.0", "72", {}), ("1,000", "1000", {}), ("0.3333334", "1/3", {}),
    ("3.14", "3.14159", {"abs_tol": 0.01}), ("101", "100", {"rel_tol": 0.02}),
])
def test_numeric_accepts_numbers_within_tolerance(reply, reference, kwargs):
    assert numeric_match(reply, reference, **kwargs) == 1.0


@pytest.mark.parametrize("reply, reference, kwargs", [
    ("71", "72", {}), ("72.001", "72", {}), ("3.14", "3.14159", {"abs_tol": 0.001}),
    ("103", "100", {"rel_tol": 0.02}), ("seventy-two", "72", {}), ("", "72", {}),
])
def test_numeric_refuses_numbers_outside_tolerance_or_not_numbers(reply, reference, kwargs):
    assert numeric_match(reply, reference, **kwargs) == 0.0


# ---- math_verify ---------------------------------------------------------------------------------


@pytest.mark.parametrize("reply, reference", [
    (r"The answer is \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    ("0.5", r"\frac{1}{2}"),
    (r"$x(x+2)$", "x^2+2x"),
    (r"\boxed{\sqrt 2}", r"\sqrt{2}"),
    ("68", "68"),
])
def test_math_verify_accepts_equivalent_answers(reply, reference):
    assert math_verify_match(reply, reference) == 1.0


@pytest.mark.parametrize("reply, reference", [
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}"), ("67", "68"), ("no answer here", "68"), (r"\boxed{x^2}", "x^3"),
])
def test_math_verify_refuses_different_answers(reply, reference):
    assert math_verify_match(reply, reference) == 0.0


def test_math_verify_runs_off_the_main_thread():
    # env workers score inside an event loop's thread, where SIGALRM timeouts cannot be set
    async def off_main():
        return await asyncio.to_thread(math_verify_match, r"\boxed{2}", "2")

    assert asyncio.run(off_main()) == 1.0


# ---- regex ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("reply, reference, kwargs", [
    ("colour", "colou?r", {}), ("color", "colou?r", {}),
    (" 42 ", r"\d+", {}),  # the whole stripped reply
    ("The answer is 42.", "42", {"pattern": r"The answer is {answer}\.?"}),
    ("YES", "yes", {"ignore_case": True}),
    ("I think it is B, surely", "B", {"pattern": r"\b{answer}\b", "search": True}),
])
def test_regex_accepts_matching_replies(reply, reference, kwargs):
    assert regex_match(reply, reference, **kwargs) == 1.0


@pytest.mark.parametrize("reply, reference, kwargs", [
    ("colouur", "colou?r", {}), ("42 and more", r"\d+", {}), ("YES", "yes", {}),
    ("I think it is BC", "B", {"pattern": r"\b{answer}\b", "search": True}),
])
def test_regex_refuses_other_replies(reply, reference, kwargs):
    assert regex_match(reply, reference, **kwargs) == 0.0


# ---- reasoning_gym -------------------------------------------------------------------------------


def test_reasoning_gym_scores_with_the_named_family():
    # a row from a file names its family in the verifier's config; the task's family is the source's name
    task = Task("mine/1", "mine", "Calculate 2 + 3.", "5", {"reference": "5"})
    assert reasoning_gym_reward("5", task, "basic_arithmetic") == 1.0
    assert reasoning_gym_reward(" 5\n", task, "basic_arithmetic") == 1.0
    assert reasoning_gym_reward("6", task, "basic_arithmetic") == 0.0
    assert reasoning_gym_reward(None, task, "basic_arithmetic") == 0.0


# ---- specs and scoring through them ----------------------------------------------------------------


@pytest.mark.parametrize("name, extract, config, expected", [
    ("numeric", "gsm8k", {"abs_tol": 0.5}, []),
    ("nope", None, {}, ["name: unknown verifier 'nope'; choose one of "
                        "['code', 'exact', 'math_verify', 'numeric', 'reasoning_gym', 'regex']"]),
    ("numeric", "last", {}, ["extract: unknown answer extractor 'last'; choose one of ['boxed', 'final_line', 'gsm8k']"]),
    ("numeric", None, {"tolerance": 1}, ["config.tolerance: numeric has no option 'tolerance'; its options: abs_tol, rel_tol"]),
    ("numeric", None, {"abs_tol": "small"}, ["config.abs_tol: expected a number, got 'small'"]),
    ("exact", None, {"case_sensitive": 1}, ["config.case_sensitive: expected true or false, got 1"]),
    ("numeric", None, {"abs_tol": True}, ["config.abs_tol: expected a number, got True"]),
    ("reasoning_gym", None, {}, ["config.family: reasoning_gym needs this option"]),
    ("reasoning_gym", None, {"family": "basic_arithmetc"}, ["config.family: unknown reasoning-gym dataset 'basic_arithmetc'"]),
    ("math_verify", None, {"x": 1}, ["config.x: math_verify has no option 'x'; its options: none"]),
])
def test_spec_problems_name_the_field(name, extract, config, expected):
    assert spec_problems(name, extract, config) == expected


def gsm8k_task(reference: str = "72") -> Task:
    return Task("gsm/1", "gsm", "How many?", f"48 + 24 = 72\n#### {reference}",
                {"reference": reference, "verifier": {"name": "numeric", "extract": "gsm8k", "config": {}}})


def test_a_task_is_scored_by_its_own_spec_after_extraction():
    task = gsm8k_task()
    assert asyncio.run(score_answer("48 + 24 = 72\n#### 72", task)) == (1.0, {"extracted": "72"})
    assert asyncio.run(score_answer("#### 72.0", task))[0] == 1.0
    assert asyncio.run(score_answer("#### 71", task)) == (0.0, {"extracted": "71"})
    assert asyncio.run(score_answer("72", task)) == (0.0, {"extracted": None})  # no `####`: no answer
    assert asyncio.run(score_answer(None, task)) == (0.0, {"extracted": None})


def test_tasks_without_a_spec_keep_their_family_scorer():
    rg = Task("basic_arithmetic/train/0", "basic_arithmetic", "Calculate 2 + 3.", "5")
    assert verifier_spec(rg) == {"name": "reasoning_gym", "config": {"family": "basic_arithmetic"}}
    assert asyncio.run(score_answer("5", rg)) == (1.0, {})
    code = Task("code/x", "code_tasks", "q", "a", {"test": "def check(c):\n    assert c() == 1\n", "entry_point": "f",
                                                 "prompt": ""})
    assert verifier_spec(code) == {"name": "code"}
    assert verifier_spec(gsm8k_task())["name"] == "numeric"


def test_a_verifier_that_runs_code_needs_a_sandbox():
    task = Task("c/1", "c", "q", "a", {"verifier": {"name": "code", "extract": None, "config": {}},
                                      "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"})
    with pytest.raises(ValueError, match="the code verifier needs a sandbox"):
        asyncio.run(score_with(task.metadata["verifier"], "def f():\n    return 1\n", task, None))


def test_code_rows_are_scored_by_their_own_unit_tests(tmp_path, sandbox):
    from factory.data.sources import FileTaskSource
    from factory.recipe import DataSource

    row = {"task": "add", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n", "fn": "add", "solution": "    return a + b\n",
           "tests": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"}
    (tmp_path / "code.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "train.jsonl").write_text(json.dumps({**row, "task": "add2", "prompt": "def add(a, b):\n"}) + "\n")
    spec = DataSource.model_validate({
        "name": "mine", "kind": "jsonl", "path": str(tmp_path / "train.jsonl"), "id": "task",
        "prompt": {"template": "Complete:\n{prompt}"}, "answer": {"field": "solution"},
        "heldout": {"path": str(tmp_path / "code.jsonl")},
        "verifier": {"name": "code", "config": {"test_field": "tests", "entry_point_field": "fn", "prefix_field": "prompt"}}})
    (task,) = FileTaskSource(spec, 0).heldout
    right = asyncio.run(score_answer("```python\n    return a + b\n```", task, sandbox))
    wrong = asyncio.run(score_answer("def add(a, b):\n    return a - b\n", task, sandbox))
    assert right[0] == 1.0 and right[1]["tests"]["passed"] == 2
    # a - b: 1 - 2 = -1 fails `== 3`; -1 - 1 = -2 fails `== 0`: no case passes
    assert wrong[0] == 0.0 and (wrong[1]["tests"]["passed"], wrong[1]["tests"]["reason"]) == (0, "ok")


def test_verifier_specs_are_the_distinct_specs_tasks_are_scored_by():
    own = {"name": "numeric", "config": {"abs_tol": 0.5}}
    tasks = [Task(f"basic_arithmetic/train/{i}", "basic_arithmetic", "Calculate 2 + 3.", "5") for i in range(3)]
    tasks += [Task("chain_sum/train/0", "chain_sum", "Sum.", "6"), Task("mine/1", "mine", "?", "1", {"verifier": own}),
              Task("mine/2", "mine", "?", "2", {"verifier": dict(own)})]
    assert verifier_specs(tasks) == [{"name": "reasoning_gym", "config": {"family": "basic_arithmetic"}},
                                     {"name": "reasoning_gym", "config": {"family": "chain_sum"}}, own]


def test_warm_up_loads_a_scorer_before_the_first_reply_and_a_bad_spec_only_warns():
    # a fresh process: this one may have imported reasoning-gym already
    code = """
import logging, sys
from factory.rewards.verifiers import _score_fn, warm_up
assert "reasoning_gym" not in sys.modules
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("factory.rewards.verifiers").addHandler(Keep())
warm_up([{"name": "reasoning_gym", "config": {"family": "basic_arithmetic"}}, {"name": "reasoning_gym", "config": {}}])
print("reasoning_gym" in sys.modules, _score_fn.cache_info().currsize, records)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded, scorers, warnings = done.stdout.strip().splitlines()[-1].split(" ", 2)
    assert (loaded, scorers) == ("True", "1")
    assert "verifier reasoning_gym did not warm up" in warnings and "family" in warnings
