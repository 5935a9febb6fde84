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
    name: str = Field("default", description="names the run: its run dir is <name>-<time> under the runs dir; a "
                      "sweep names each point <name>-<field>=<value>-…")
    model: ModelSection = Field(default_factory=ModelSection, description="the policy: a Hugging Face model dir, "
                                "or a tiny model built and warm-started on the run's tasks")
    data: DataSection = Field(default_factory=DataSection, description="the tasks: reasoning-gym families, files "
                              "or lake tables, and their held-out splits")
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection, description="how an episode is "
                                            "played: its prompt, its turns, the sandbox for its code")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="the engines that generate: "
                                    "sampling, context, weight sync, health and restarts")
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection, description="advantages, the policy "
                                        "loss, off-policy corrections, KL, distillation")
    async_: AsyncSection = Field(default_factory=AsyncSection, alias="async", description="the staleness budget "
                                 "η and which groups start when")
    train: TrainSection = Field(default_factory=TrainSection, description="the trainer: optimizer, "
                                "checkpoints, device, precision, ranks")
    eval: EvalSection = Field(default_factory=EvalSection, description="held-out evaluations before and after "
                              "training")
    failures: FailuresSection = Field(default_factory=FailuresSection, description="when failed groups fail the "
                                      "run, and how often dead workers are restarted")
    deadlines: DeadlinesSection = Field(default_factory=DeadlinesSection, description="how long each wait of the "
                                        "run may take before it fails the run")
    lake: LakeSection = Field(default_factory=LakeSection, description="recording the run in the Iceberg lake")
    tracking: TrackingSection = Field(default_factory=TrackingSection, description="logging the run to MLflow")
    placement: PlacementSection = Field(default_factory=PlacementSection, description="the Ray resources each "
                                        "role's actors ask for on a cluster")
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
        problems = engines[self.rollout.engine].problems(self.rollout, self.train.lora.enabled, self.replays_routing)
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

    @property
    def replays_routing(self) -> bool:
        """Whether the engine records each sampled token's experts for the trainer to replay: asked for,
        or unset with a built mixture-of-experts policy (a policy loaded from model.path is decided when
        the run reads its config: `factory.model.routing.wants_replay`)."""
        wanted = self.algorithm.routing_replay
        return wanted == "rollout" or (wanted is None and not self.model.path and self.model.architecture == "qwen3_moe")

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.dump(), sort_keys=False)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.dump(), sort_keys=True).encode()).hexdigest()[:12]


def json_schema() -> dict[str, Any]:
    return Recipe.model_json_schema(by_alias=True)
