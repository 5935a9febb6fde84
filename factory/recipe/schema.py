"""The whole recipe: its sections, the checks across them, its dump and fingerprint, its JSON schema."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml
from pydantic import Field, model_validator

from factory.core import registries
from factory.recipe.algorithm import AlgorithmSection
from factory.recipe.base import Section
from factory.recipe.data import DataSection
from factory.recipe.operations import (DeadlinesSection, EvalSection, FailuresSection, LakeSection, PlacementSection,
                                       TrackingSection)
from factory.recipe.rollout import EnvironmentSection, RolloutSection
from factory.recipe.train import AsyncSection, ModelSection, TrainSection


class Recipe(Section):
    name: str = "default"
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    async_: AsyncSection = Field(default_factory=AsyncSection, alias="async")
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    failures: FailuresSection = Field(default_factory=FailuresSection)
    deadlines: DeadlinesSection = Field(default_factory=DeadlinesSection)
    lake: LakeSection = Field(default_factory=LakeSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    placement: PlacementSection = Field(default_factory=PlacementSection)
    sweep: dict[str, list[Any]] = Field(
        default_factory=dict, description="dotted field path -> values; the grid is their product"
    )

    @model_validator(mode="after")
    def _check_registries(self) -> Recipe:
        try:  # (the algorithm's registries are checked by their fields' validators)
            registries.VALIDATORS["environment"](self.environment.name)
        except ValueError as err:
            raise ValueError(f"environment.name: {err}") from None
        engines = registries.ENGINES
        if self.rollout.engine not in engines:
            raise ValueError(f"rollout.engine: unknown {self.rollout.engine!r}; choose one of {engines.names()}")
        problems = engines[self.rollout.engine].problems(self.rollout, self.train.lora.enabled)
        if problems:
            raise ValueError(problems[0])
        urls = self.rollout.urls
        if urls and "num_engines" in self.rollout.model_fields_set and self.rollout.num_engines != len(urls):
            raise ValueError(f"rollout.num_engines: {self.rollout.num_engines} engines but {len(urls)} urls; "
                             "leave num_engines unset with urls (one engine per URL)")
        if (self.rollout.weight_sync == "lora") != self.train.lora.enabled:
            raise ValueError("rollout.weight_sync: use 'lora' exactly when train.lora.enabled is true "
                             f"(got weight_sync={self.rollout.weight_sync!r}, lora.enabled={self.train.lora.enabled})")
        return self

    @model_validator(mode="after")
    def _fits_the_context(self) -> Recipe:
        r = self.rollout
        if r.max_new_tokens >= r.max_model_len:
            raise ValueError(f"rollout.max_new_tokens: {r.max_new_tokens} leaves no room for a prompt within "
                             f"rollout.max_model_len={r.max_model_len}")
        if not self.model.path and r.max_model_len > self.model.max_position:
            raise ValueError(f"rollout.max_model_len: {r.max_model_len} is beyond the built model's context "
                             f"(model.max_position={self.model.max_position})")
        return self

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.dump(), sort_keys=False)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.dump(), sort_keys=True).encode()).hexdigest()[:12]


def json_schema() -> dict[str, Any]:
    return Recipe.model_json_schema(by_alias=True)
