"""Recipes: the shipped YAML files, dotted overrides, sweeps, the schema and exact error lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from factory.algo import POLICY_LOSSES
from factory.recipe import (
    Recipe,
    RecipeError,
    expand_sweep,
    json_schema,
    load_recipe,
    parse_override,
    recipe_from_dict,
)

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
RECIPE_FILES = sorted(RECIPES.glob("*.yaml"))


def test_recipes_directory_is_not_empty():
    names = {p.name for p in RECIPE_FILES}
    assert {"default.yaml", "sweep_loss_staleness.yaml", "two_families.yaml"} <= names


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads_and_expands(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    for _, point in expand_sweep(recipe):
        assert isinstance(point, Recipe)


def test_default_recipe_values():
    recipe = load_recipe(RECIPES / "default.yaml")
    assert recipe.model.path is None and recipe.model.sft_steps > 0
    assert [f.name for f in recipe.data.families] == ["basic_arithmetic"]
    assert recipe.algorithm.advantage == "grpo"
    assert recipe.algorithm.loss == "ppo_clip"
    assert recipe.async_.max_staleness == 1
    assert recipe.train.steps == 400
    assert recipe.sweep == {}


def test_requests_are_seeded_unless_the_recipe_says_null():
    # η = 0 runs repeat out of the box; `null` lets the engine draw
    assert load_recipe(RECIPES / "default.yaml").rollout.seed == 0
    assert load_recipe(RECIPES / "default.yaml", ["rollout.seed=null"]).rollout.seed is None


def test_two_families_recipe():
    recipe = load_recipe(RECIPES / "two_families.yaml")
    basic, chain = recipe.data.families
    assert (basic.name, chain.name) == ("basic_arithmetic", "chain_sum")
    assert chain.config == dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2)


# ---- overrides -----------------------------------------------------------------------------


def test_overrides_parse_and_apply_with_types():
    recipe = load_recipe(
        RECIPES / "default.yaml",
        ["train.lr=3e-4", "async.max_staleness=2", "rollout.engine=hf", "eval.before=false"],
    )
    assert recipe.train.lr == 3e-4 and isinstance(recipe.train.lr, float)
    assert recipe.async_.max_staleness == 2 and isinstance(recipe.async_.max_staleness, int)
    assert recipe.rollout.engine == "hf"
    assert recipe.eval.before is False


def test_overrides_create_missing_nested_sections():
    # two_families.yaml has no rollout or environment section at all.
    recipe = load_recipe(
        RECIPES / "two_families.yaml", ["rollout.engine=hf", "environment.latency.slow_s=0.5"]
    )
    assert recipe.rollout.engine == "hf"
    assert recipe.environment.latency.slow_s == 0.5


def test_overrides_do_not_modify_the_input_dict():
    data = {"train": {"lr": 0.1}}
    recipe = recipe_from_dict(data, overrides=["train.lr=0.2"])
    assert recipe.train.lr == 0.2 and data == {"train": {"lr": 0.1}}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("train.lr=3e-4", ("train.lr", 3e-4)),  # YAML 1.1 alone would give the string '3e-4'
        ("train.lr=1.5e-3", ("train.lr", 1.5e-3)),
        ("async.max_staleness=2", ("async.max_staleness", 2)),
        ("eval.before=true", ("eval.before", True)),
        ("train.betas=[0.9, 0.95]", ("train.betas", [0.9, 0.95])),
        ("model.path=", ("model.path", "")),
        ("name=a=b", ("name", "a=b")),
        (" rollout.engine = hf", ("rollout.engine", "hf")),
    ],
)
def test_parse_override(text, expected):
    assert parse_override(text) == expected


# ---- sweeps and schema ---------------------------------------------------------------------


def test_sweep_expands_to_the_grid():
    recipe = load_recipe(RECIPES / "sweep_loss_staleness.yaml")
    points = expand_sweep(recipe)
    assert len(points) == 4
    grid = {(p["algorithm.loss"], p["async.max_staleness"]) for p, _ in points}
    assert grid == {("ppo_clip", 0), ("ppo_clip", 2), ("reinforce", 0), ("reinforce", 2)}
    for point, expanded in points:
        assert expanded.algorithm.loss == point["algorithm.loss"]
        assert expanded.async_.max_staleness == point["async.max_staleness"]
        assert expanded.sweep == {}
        assert expanded.train.steps == recipe.train.steps == 50
    names = [expanded.name for _, expanded in points]
    assert len(set(names)) == 4
    assert "sweep_loss_staleness-loss=reinforce-max_staleness=2" in names
    assert len({expanded.fingerprint() for _, expanded in points}) == 4


def test_recipe_without_sweep_expands_to_itself():
    recipe = load_recipe(RECIPES / "default.yaml")
    assert expand_sweep(recipe) == [({}, recipe)]


def test_indexed_overrides_set_list_items():
    recipe = recipe_from_dict({"name": "x"}, overrides=["data.families[0].name=chain_sum",
                                                         "data.families[0].config.max_digits=3"])
    assert recipe.data.families[0].name == "chain_sum"  # the default list, with its item changed
    assert recipe.data.families[0].config["max_digits"] == 3 and recipe.data.families[0].config["min_terms"] == 2


def test_json_schema_lists_the_sections():
    schema = json_schema()
    assert isinstance(schema, dict)
    assert {"async", "train", "rollout", "algorithm"} <= set(schema["properties"])


# ---- malformed recipes: exact messages -----------------------------------------------------

LOSSES = sorted(POLICY_LOSSES)

# (id, file text or None for "no file", overrides, expected lines with {file} for the path)
MALFORMED = [
    ("unknown_top_level_field", "trainer:\n  lr: 0.1\n", [],
     ["{file}: trainer: unknown field; did you mean 'train'?"]),
    ("unknown_nested_field", "train:\n  lrr: 0.1\n", [],
     ["{file}: train.lrr: unknown field; did you mean 'lr'?"]),
    ("unknown_field_without_close_match", "eval:\n  zzz: 1\n", [],
     ["{file}: eval.zzz: unknown field; known fields: heldout, seed, temperature, before, after"]),
    ("wrong_type", "train:\n  steps: many\n", [],
     ["{file}: train.steps: expected an integer, got 'many'"]),
    ("fraction_for_integer", "train:\n  steps: 2.5\n", [],
     ["{file}: train.steps: expected a whole number, got 2.5"]),
    ("not_a_boolean", "eval:\n  before: maybe\n", [],
     ["{file}: eval.before: expected true or false, got 'maybe'"]),
    ("out_of_range", "async:\n  max_staleness: -1\n", [],
     ["{file}: async.max_staleness: must be >= 0, got -1"]),
    ("above_maximum", "rollout:\n  top_p: 1.5\n", [],
     ["{file}: rollout.top_p: must be <= 1.0, got 1.5"]),
    ("two_problems_two_lines", "train:\n  steps: 0\n  lr: -1\n", [],
     ["{file}: train.steps: must be > 0, got 0", "{file}: train.lr: must be > 0.0, got -1"]),
    ("unknown_loss_name", "algorithm:\n  loss: ppo\n", [],
     [f"{{file}}: algorithm.loss: unknown policy loss 'ppo'; choose one of {LOSSES}"]),
    ("bad_engine_literal", "rollout:\n  engine: trt\n", [],
     ["{file}: rollout.engine: unknown 'trt'; choose one of ['hf', 'sglang', 'vllm']"]),
    ("section_is_not_a_mapping", "train: 5\n", [],
     ["{file}: train: expected a section of `field: value` lines, got 5"]),
    ("family_without_name", "data:\n  families:\n    - weight: 2\n", [],
     ["{file}: data.families[0].name: required but missing"]),
    ("no_families", "data:\n  families: []\n", [],
     ["{file}: data.families: needs at least 1 item(s), got 0 (or give data.sources)"]),
    ("betas_too_short", "train:\n  betas: [0.9]\n", [],
     ["{file}: train.betas[1]: item missing; the list is too short"]),
    ("sweep_values_not_a_list", "sweep:\n  train.lr: 0.1\n", [],
     ["{file}: sweep.train.lr: expected a list, got 0.1"]),
    ("invalid_yaml", "train:\n  steps: [1, 2\n", [],
     ["{file}: line 3, column 1: invalid YAML (expected ',' or ']', but got '<stream end>')"]),
    ("bad_indentation", "train:\n steps: 1\n  lr: 2\n", [],
     ["{file}: line 3, column 5: invalid YAML (mapping values are not allowed here)"]),
    ("list_root", "- model\n- train\n", [],
     ['{file}: <root>: expected a mapping of sections (model:, train:, ...), got ["model", "train"]']),
    ("scalar_root", "hello\n", [],
     ["{file}: <root>: expected a mapping of sections (model:, train:, ...), got 'hello'"]),
    ("missing_file", None, [],
     ["{file}: no such recipe file"]),
    ("override_without_equals", "name: x\n", ["train.lr"],
     ["override 'train.lr': expected FIELD.PATH=VALUE, e.g. train.lr=3e-4"]),
    ("override_with_empty_path", "name: x\n", ["=3"],
     ["override '=3': empty field path before '='"]),
    ("override_out_of_range", "name: x\n", ["async.max_staleness=-2"],
     ["{file}: async.max_staleness: must be >= 0, got -2 (from override 'async.max_staleness=-2')"]),
    ("override_unknown_field", "name: x\n", ["train.lrr=1"],
     ["{file}: train.lrr: unknown field; did you mean 'lr'? (from override 'train.lrr=1')"]),
    ("override_below_a_value", "train:\n  lr: 0.1\n", ["train.lr.x=1"],
     ["{file}: field path 'train.lr.x': 'train.lr' holds a value, not a section of fields "
      "(from override 'train.lr.x=1')"]),
    ("override_index_past_the_list", "name: x\n", ["data.families[1].name=chain_sum"],
     ["{file}: field path 'data.families[1].name': data.families has 1 item(s); no item [1] "
      "(from override 'data.families[1].name=chain_sum')"]),
    ("override_index_on_a_value", "name: x\n", ["train.lr[0]=1"],
     ["{file}: field path 'train.lr[0]': train.lr is not a list (from override 'train.lr[0]=1')"]),
    ("override_bad_index_syntax", "name: x\n", ["data.families.0.name=x"],
     ["{file}: field path 'data.families.0.name': '0' is not a field name, optionally with [index], e.g. "
      "data.families[0].name (from override 'data.families.0.name=x')"]),
    ("override_index_then_unknown_field", "name: x\n", ["data.families[0].nme=x"],
     ["{file}: data.families[0].nme: unknown field; did you mean 'name'? (from override 'data.families[0].nme=x')"]),
    ("empty_file", "", [], ["{file}: the file is empty; a recipe needs at least one section, e.g. `name: my-run` "
                            "(recipes/default.yaml shows them all)"]),
    ("only_comments", "# to do\n", [], ["{file}: the file is empty (only comments); a recipe needs at least one "
                                         "section, e.g. `name: my-run` (recipes/default.yaml shows them all)"]),
    ("new_tokens_fill_the_context", "name: x\n", ["rollout.max_new_tokens=256"],
     ["{file}: rollout.max_new_tokens: 256 leaves no room for a prompt within rollout.max_model_len=256 "
      "(from override 'rollout.max_new_tokens=256')"]),
    ("engine_context_beyond_the_built_model", "name: x\n", ["rollout.max_model_len=512"],
     ["{file}: rollout.max_model_len: 512 is beyond the built model's context (model.max_position=256) "
      "(from override 'rollout.max_model_len=512')"]),
    ("bad_sweep_value", "sweep:\n  async.max_staleness: [0, -1]\n  train.lr: [0.1, 0.2]\n", [],
     ["{file}: sweep point async.max_staleness=-1, train.lr=0.1: async.max_staleness: must be >= 0, got -1"]),
    ("sweep_of_an_unknown_field", "sweep:\n  train.lrr: [1]\n", [],
     ["{file}: sweep point train.lrr=1: train.lrr: unknown field; did you mean 'lr'?"]),
]


@pytest.mark.parametrize(
    "text, overrides, expected", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED]
)
def test_malformed_recipe_gives_exact_lines(tmp_path, text, overrides, expected):
    path = tmp_path / "recipe.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(RecipeError) as caught:
        load_recipe(path, overrides)
    lines = [line.format(file=path) for line in expected]
    message = str(caught.value)
    assert message == "\n".join(lines)
    assert len(message.splitlines()) == len(expected)
    assert caught.value.problems == lines


def test_recipe_error_is_a_value_error():
    assert issubclass(RecipeError, ValueError)




def test_routing_replay_defaults_on_for_a_built_mixture_of_experts_and_reads_yaml_off():
    moe = load_recipe(RECIPES / "moe_tiny.yaml")
    assert moe.algorithm.routing_replay is None and moe.replays_routing
    assert not load_recipe(RECIPES / "default.yaml").replays_routing
    # YAML reads a bare `off` as false: it means the word
    assert load_recipe(RECIPES / "moe_tiny.yaml", ["algorithm.routing_replay=off"]).algorithm.routing_replay == "off"
    assert not load_recipe(RECIPES / "moe_tiny.yaml", ["algorithm.routing_replay=off"]).replays_routing


@pytest.mark.parametrize("overrides", [["rollout.engine=sglang"], ["rollout.engine=hf"],
                                       ["rollout.engine=sglang", "model.architecture=llama", "algorithm.routing_replay=rollout"]])
def test_an_engine_that_cannot_report_experts_refuses_routing_replay_in_one_line(overrides):
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPES / "moe_tiny.yaml", overrides)
    message = str(err.value)
    assert "algorithm.routing_replay" in message and "use vllm" in message and "\n" not in message.strip()
    # turned off, the same engine takes the mixture of experts
    assert load_recipe(RECIPES / "moe_tiny.yaml", [*overrides[:1], "algorithm.routing_replay=off"])
