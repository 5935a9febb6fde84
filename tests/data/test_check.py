"""The data check before a run: family names and configs, sizes the families can give, file sources
built and reported (rows per split, a sample rendered prompt), each problem one line from the CLI."""

from __future__ import annotations

import json

import pytest

from factory.cli import main
from factory.data.check import check_data, render_prompt
from factory.paths import REPO_ROOT
from factory.recipe import load_recipe, recipe_from_dict

DEFAULT = REPO_ROOT / "recipes" / "default.yaml"
GSM8K = REPO_ROOT / "recipes" / "gsm8k_format.yaml"


def problems(*overrides: str) -> list[str]:
    return check_data(load_recipe(DEFAULT, ["data.train_size=200", "data.heldout_size=50", *overrides])).problems


def test_an_unknown_family_name_with_the_closest_known_one():
    assert problems("data.families[0].name=basic_arithmetc") == [
        "data.families[0].name: unknown task family 'basic_arithmetc'; did you mean 'basic_arithmetic'?"]
    assert problems("data.families[0].name=not_a_family", "data.families[0].config={}")[0].startswith(
        "data.families[0].name: unknown task family 'not_a_family'; ")


def test_a_config_reasoning_gym_refuses():
    (line,) = problems("data.families[0].config.max_terms=1")
    assert line.startswith("data.families[0].config: basic_arithmetic refuses {") and "max_terms" in line


def test_sizes_a_family_cannot_give():
    one_digit = ["data.families[0].config.max_digits=1"]  # 121 distinct sums of two numbers 0..10
    assert problems(*one_digit, "data.heldout_size=500") == [
        "data.heldout_size: basic_arithmetic gives 121 distinct held-out questions of the 500 asked (it holds no "
        "more: lower data.heldout_size or widen its config)",
        "data.train_size: basic_arithmetic has no training question left (all 121 it gives are held out)"]
    assert problems(*one_digit, "data.heldout_size=40") == []  # fewer training questions than asked is fine


def test_a_clean_dataset_reports_its_rows_and_a_rendered_prompt():
    check = check_data(load_recipe(DEFAULT, ["data.train_size=200", "data.heldout_size=50",
                                             "environment.system_prompt=Add."]))
    assert check.problems == [] and check.fingerprint
    assert check.lines[:2] == [f"data {check.fingerprint}: 200 train, 50 heldout tasks",
                               "  basic_arithmetic (reasoning-gym): 200 train, 50 heldout"]
    assert check.lines[2].startswith('    sample prompt (basic_arithmetic/train/0): [system] "Add." [user] "Calculate ')


def test_render_prompt_quotes_text_and_cuts_long_text():
    assert render_prompt([{"role": "user", "content": "a\nb"}]) == '[user] "a\\nb"'
    assert render_prompt([{"role": "user", "content": "x" * 50}], limit=12) == '[user] "xxxxxxx..."'


def test_recipe_check_reports_a_file_source(capsys):
    assert main(["recipe", "check", str(GSM8K)]) == 0
    out = capsys.readouterr().out.splitlines()
    fingerprint = check_data(load_recipe(GSM8K)).fingerprint
    assert out[1] == f"data {fingerprint}: 2000 train, 500 heldout tasks"
    assert out[2] == ("  gsm8k_format (jsonl recipes/data/gsm8k_format/train.jsonl): 2000 train, 500 heldout "
                      "(recipes/data/gsm8k_format/test.jsonl), verifier numeric (extract gsm8k)")
    assert out[3] == '    sample prompt (gsm8k_format/train/0): [user] "Calculate 47 + 97."'


@pytest.mark.parametrize("overrides, expected", [
    (["data.families[0].name=not_a_family"], "data.families[0].name: unknown task family 'not_a_family'; "),
    (["data.heldout_size=100000000"], "data.heldout_size: must be <= 100000, got 100000000"),
    (["data.heldout_size=20000", "data.families[0].config.max_digits=1"],
     "data.heldout_size: basic_arithmetic gives 121 distinct held-out questions of the 20000 asked"),
])
def test_recipe_check_and_run_refuse_bad_data_in_one_line(capsys, overrides, expected):
    for command in (["recipe", "check", str(DEFAULT)], ["run", str(DEFAULT)]):
        assert main([*command, *overrides]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{DEFAULT}: {expected}") and "Traceback" not in err, err


def test_recipe_check_names_a_bad_source_file(capsys, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "Calculate 1 + 2.", "answer": "3"}) + "\n")
    assert main(["recipe", "check", str(GSM8K), f"data.sources[0].path={train}"]) == 2
    assert capsys.readouterr().err == f"{GSM8K}: data.sources[0].answer.extract: {train}:1: gsm8k finds no answer in '3'\n"


def test_sources_without_families_and_neither():
    spec = {"name": "mine", "kind": "jsonl", "path": "x.jsonl", "prompt": {"field": "q"}, "heldout": {"size": 1}}
    assert recipe_from_dict({"data": {"sources": [spec]}}).data.families == []
    kept = recipe_from_dict({"data": {"sources": [spec], "families": [{"name": "chain_sum"}]}}).data
    assert [f.name for f in kept.families] == ["chain_sum"]
