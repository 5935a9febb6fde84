"""The GSM8K-layout example data: the shipped files are what the generator makes, in GSM8K's layout,
disjoint, and the recipe reads them as a user's own JSONL."""

from __future__ import annotations

import json
import re

from factory.data.gsm8k_format import gsm8k_rows, jsonl
from factory.data.tasks import ReasoningGymSource
from factory.paths import REPO_ROOT
from factory.recipe import load_recipe

DATA = REPO_ROOT / "recipes" / "data" / "gsm8k_format"


def test_the_shipped_files_are_the_generators_output():
    rows = gsm8k_rows()
    for split in ("train", "test"):
        assert (DATA / f"{split}.jsonl").read_text(encoding="utf-8") == jsonl(rows[split]), split


def test_rows_have_gsm8k_layout_with_the_right_sums_and_the_splits_are_disjoint():
    splits = {s: [json.loads(line) for line in (DATA / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "test")}
    assert (len(splits["train"]), len(splits["test"])) == (2000, 500)
    for row in splits["train"] + splits["test"]:
        assert set(row) == {"question", "answer"}
        terms = re.fullmatch(r"Calculate (\d+) \+ (\d+)\.", row["question"]).groups()
        total = sum(map(int, terms))
        assert row["answer"] == f"{terms[0]} + {terms[1]} = {total}\n#### {total}"
    assert not {r["question"] for r in splits["train"]} & {r["question"] for r in splits["test"]}


def test_the_recipe_reads_them_with_the_gsm8k_extractor_and_numeric_verifier():
    recipe = load_recipe(REPO_ROOT / "recipes" / "gsm8k_format.yaml")
    assert recipe.data.families == [] and [s.name for s in recipe.data.sources] == ["gsm8k_format"]
    source = ReasoningGymSource.from_recipe(recipe.data)
    task = source.train[0]
    assert (task.question, task.metadata["reference"]) == ("Calculate 47 + 97.", "144")
    assert task.metadata["verifier"] == {"name": "numeric", "extract": "gsm8k", "config": {}}
    assert len(source.heldout) == 500
