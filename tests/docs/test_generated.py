"""The generated pages (docs/gen.py) match what the recipe model and bench/results hold, and follow them."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from pydantic import Field

from factory.recipe import Recipe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "docs" / "gen.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def results():
    return {p.name: json.loads(p.read_text()) for p in sorted((ROOT / "bench" / "results").glob("*.json"))}


def test_the_committed_pages_are_current(gen):
    for path, content in gen.pages().items():
        rel = path.relative_to(ROOT).as_posix()
        assert path.exists() and path.read_bytes() == content, f"{rel} is stale: run make docs"


def test_the_recipe_reference_follows_the_model(gen):
    class Planted(Recipe):
        planted_knob: int = Field(7, ge=1, description="a field planted by the test")

    now, planted = gen.recipe_reference(), gen.recipe_reference(Planted)
    assert now != planted
    assert "| `planted_knob` | `int` | `7` | ≥ 1 | a field planted by the test |" in planted
    assert now == gen.recipe_reference(), "the recipe reference is not deterministic"


def test_the_recipe_reference_lists_every_section_and_registry_name(gen):
    page = gen.recipe_reference()
    for section in ("model", "data", "environment", "rollout", "algorithm", "async", "train", "eval", "failures",
                    "deadlines", "lake", "tracking", "placement", "train.lora", "data.sources[]"):
        assert f"## `{section}`" in page
    assert "`grpo`" in page and "`ppo_clip`" in page  # registry names from the JSON schema
    assert '`"wait"`, `"abort_resume"`, `"inflight"`' in page  # a Literal's values


def test_the_benchmarks_page_follows_the_results(gen, results):
    page, _ = gen.benchmarks_page(results)
    planted = copy.deepcopy(results)
    planted["vllm_start.json"]["spawn_over_fork"] = 9.87
    planted["new_bench.json"] = {"figure": 1}
    changed, _ = gen.benchmarks_page(planted)
    assert "| 9.87× |" in changed and "| 9.87× |" not in page
    assert "`bench/results/new_bench.json`" in changed  # a file no section summarises is still listed


def test_the_benchmarks_page_takes_what_a_bench_compares_from_its_docstring(gen, results):
    page, _ = gen.benchmarks_page(results, docstrings={"vllm_start": "A planted description."})
    assert "A planted description." in page
    first = gen.first_paragraph(ROOT / "bench" / "vllm_start.py")
    assert first and first in gen.benchmarks_page(results)[0]


def test_a_plot_beside_its_results_is_shown(gen, results):
    page, shown = gen.benchmarks_page(results, plots={"vllm_start.png"})
    assert "](bench/vllm_start.png)" in page and set(shown) == {"vllm_start.png"}


def test_check_names_the_stale_page(gen, monkeypatch, capsys):
    monkeypatch.setattr(gen, "recipe_reference", lambda: "# something else\n")
    assert gen.main(["--check"]) == 1
    assert capsys.readouterr().err.strip() == "docs/reference/recipe.md is stale: run make docs"
