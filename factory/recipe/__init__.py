"""Recipes: typed, validated run configuration as code.

A recipe is a YAML file whose sections map onto the models here. Dotted overrides
(`train.lr=3e-4`) patch it from the command line; a `sweep` section holds a grid that expands
to one recipe per grid point. Every user error becomes a `RecipeError` whose lines each name the
file and the field path, never a traceback. Names of extension points (engines, losses, environments,
verifiers, ...) are checked against factory.core.registries; the recipe imports no component.

Modules: base (the Section base), data, rollout, algorithm, train, operations (the sections), schema
(the whole Recipe and its JSON schema), errors (RecipeError and its one-line messages), loading (YAML,
dotted overrides), sweeps (grid expansion).
"""

from factory.recipe.algorithm import AlgorithmSection, DistillSection, OffPolicyCorrection
from factory.recipe.base import Section
from factory.recipe.data import (MAX_HELDOUT_SIZE, MAX_TRAIN_SIZE, SOURCE_LOCATION, AnswerSpec, DataSection, DataSource,
                                 HeldoutSpec, PromptSpec, TaskFamily, VerifierSpec)
from factory.recipe.errors import RecipeError, _format_errors
from factory.recipe.loading import load_recipe, parse_override, recipe_from_dict, set_dotted
from factory.recipe.operations import (DeadlinesSection, EvalSection, FailuresSection, LakeSection, PlacementSection,
                                       Resources, TrackingSection)
from factory.recipe.rollout import EnvironmentSection, HealthSection, LatencySection, RolloutSection, SandboxSection
from factory.recipe.schema import Recipe, json_schema
from factory.recipe.sweeps import expand_sweep
from factory.recipe.train import AsyncSection, LoraSection, ModelSection, TrainSection

__all__ = [
    "MAX_HELDOUT_SIZE", "MAX_TRAIN_SIZE", "SOURCE_LOCATION", "AlgorithmSection", "AnswerSpec", "AsyncSection",
    "DataSection", "DataSource", "DeadlinesSection", "DistillSection", "EnvironmentSection", "EvalSection",
    "FailuresSection", "HealthSection", "HeldoutSpec", "LakeSection", "LatencySection", "LoraSection", "ModelSection",
    "OffPolicyCorrection", "PlacementSection", "PromptSpec", "Recipe", "RecipeError", "Resources", "RolloutSection",
    "SandboxSection", "Section", "TaskFamily", "TrackingSection", "TrainSection", "VerifierSpec", "_format_errors",
    "expand_sweep", "json_schema", "load_recipe", "parse_override", "recipe_from_dict", "set_dotted",
]
