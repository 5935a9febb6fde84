"""The recipe's algorithm section: off-policy knobs, their defaults and their one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from factory.algo import CORRECTIONS
from factory.recipe import Recipe, RecipeError, json_schema, load_recipe, recipe_from_dict


def test_defaults_keep_the_on_policy_behaviour():
    a = Recipe().algorithm
    assert (a.proximal, a.corrections, a.max_token_staleness, a.spread_action) == ("behaviour", [], None, "none")
    assert a.overlong_buffer == 0


def test_corrections_parse_in_order_with_their_knobs():
    recipe = recipe_from_dict({"algorithm": {
        "proximal": "current",
        "corrections": [{"name": "tis", "level": "sequence", "cap": 3.0}, {"name": "opsm", "delta": 0.05},
                        {"name": "version_reject", "max_staleness": 2}, {"name": "length_mask"}],
        "max_token_staleness": 2, "spread_action": "drop", "spread_level": "sample",
    }})
    names = [(c.name, c.level, c.cap) for c in recipe.algorithm.corrections]
    assert names == [("tis", "sequence", 3.0), ("opsm", "token", 2.0), ("version_reject", "token", 2.0),
                     ("length_mask", "token", 2.0)]
    assert recipe.algorithm.corrections[1].delta == 0.05


def test_overrides_reach_the_new_fields():
    recipe = recipe_from_dict({}, overrides=["algorithm.loss=decoupled_ppo", "algorithm.proximal=loglinear",
                                             "algorithm.corrections=[{name: icepop, low: 0.5, high: 5}]"])
    assert recipe.algorithm.loss == "decoupled_ppo"
    assert recipe.algorithm.corrections[0].high == 5.0


def test_schema_describes_the_corrections():
    schema = json_schema()
    algorithm = schema["$defs"]["AlgorithmSection"]["properties"]
    assert {"proximal", "corrections", "max_token_staleness", "spread_action", "spread_level",
            "spread_is_cap", "overlong_buffer", "overlong_penalty", "behaviour_weight_cap"} <= set(algorithm)
    assert "OffPolicyCorrection" in schema["$defs"]


CORRECTION_NAMES = sorted(CORRECTIONS)

BAD = [
    ("unknown_correction", {"corrections": [{"name": "tiss"}]},
     [f"algorithm.corrections[0].name: unknown correction 'tiss'; choose one of {CORRECTION_NAMES}"]),
    ("knob_the_correction_ignores", {"proximal": "current", "corrections": [{"name": "tis", "delta": 0.1}]},
     ["algorithm.corrections[0]: tis does not read delta; it takes level, cap"]),
    ("icepop_bounds", {"proximal": "current", "corrections": [{"name": "icepop", "low": 2, "high": 1}]},
     ["algorithm.corrections[0]: icepop: low (2.0) must be below high (1.0)"]),
    ("typo_in_a_correction", {"corrections": [{"name": "opsm", "detla": 0.1}]},
     ["algorithm.corrections[0].detla: unknown field; did you mean 'delta'?"]),
    ("tis_without_proximal", {"corrections": [{"name": "tis"}]},
     ["algorithm.corrections: tis weighs the proximal/behaviour ratio, which is 1 with algorithm.proximal "
      "'behaviour'; set proximal to 'current' or 'loglinear'"]),
    ("decoupled_without_proximal", {"loss": "decoupled_ppo"},
     ["algorithm.proximal: decoupled_ppo needs 'current' or 'loglinear' (with 'behaviour' it is ppo_clip)"]),
    ("gate_without_limit", {"spread_action": "drop"},
     ["algorithm.spread_action: 'drop' needs algorithm.max_token_staleness"]),
    ("gate_correct_twice", {"max_token_staleness": 1, "spread_action": "correct", "proximal": "current",
                            "corrections": [{"name": "tis"}]},
     ["algorithm.spread_action: 'correct' importance-weights the stale tokens, which decoupled_ppo or a tis "
      "correction already does; use 'drop' or remove one"]),
    ("bad_action", {"spread_action": "fix"},
     ["algorithm.spread_action: must be one of 'none', 'drop' or 'correct', got 'fix'"]),
    ("negative_staleness", {"max_token_staleness": -1},
     ["algorithm.max_token_staleness: must be >= 0, got -1"]),
]


@pytest.mark.parametrize("algorithm, expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_algorithm_sections_give_one_line_each(algorithm, expected):
    with pytest.raises(RecipeError) as caught:
        recipe_from_dict({"algorithm": algorithm}, "r.yaml")
    assert caught.value.problems == [f"r.yaml: {line}" for line in expected]


def test_offpolicy_recipe_loads():
    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "offpolicy.yaml")
    assert recipe.algorithm.corrections and recipe.algorithm.spread_action != "none"
