"""The recipe's `algorithm` section: advantages, the policy loss, off-policy corrections, KL, distillation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from factory.core import registries
from factory.recipe.base import Section, registered


class OffPolicyCorrection(Section):
    """One entry of `algorithm.corrections`: a registered correction and the knobs it reads."""

    name: str = Field(description="a registered correction (factory/algo/corrections.py)",
                      **registered(registries.CORRECTIONS))
    level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="tis/icepop: the ratio per token, per sequence (product) or its geometric mean; "
        "version_reject: drop stale tokens or whole sequences")
    cap: float = Field(2.0, gt=0, description="tis: largest importance weight")
    low: float = Field(0.5, ge=0, description="icepop: smallest kept ratio")
    high: float = Field(2.0, gt=0, description="icepop: largest kept ratio")
    delta: float = Field(0.01, ge=0, description="opsm: largest per-token KL(behaviour || current) a "
                         "negative-advantage sample may have")
    max_staleness: int = Field(1, ge=0, description="version_reject: oldest kept token, in versions behind")

    @field_validator("name")
    @classmethod
    def _known_correction(cls, name: str) -> str:
        return registries.CORRECTIONS.check(name)

    @model_validator(mode="after")
    def _reads_what_is_set(self) -> OffPolicyCorrection:
        takes = registries.correction_params(self.name)
        unused = sorted(self.model_fields_set - {"name"} - set(takes))
        if unused:
            raise ValueError(f"{self.name} does not read {', '.join(unused)}; it takes "
                             f"{', '.join(takes) if takes else 'no parameters'}")
        if self.name == "icepop" and self.low >= self.high:
            raise ValueError(f"icepop: low ({self.low}) must be below high ({self.high})")
        if self.name == "version_reject" and self.level == "geometric":
            raise ValueError("version_reject: level must be 'token' or 'sequence'")
        return self


class DistillSection(Section):
    """On-policy distillation: a teacher scores the student's samples token by token (factory/training/scoring.py)."""

    teacher: str | None = Field(None, description="HF model dir of the teacher (same tokenizer); unset: off")
    coef: float = Field(1.0, ge=0, description="weight of the per-token teacher-minus-student logprob advantage")
    scorer: str = Field("teacher_logprobs", description="a registered scorer (factory/training/scoring.py)",
                        **registered(registries.SCORERS))

    @field_validator("scorer")
    @classmethod
    def _known_scorer(cls, name: str) -> str:
        return registries.SCORERS.check(name)


class AlgorithmSection(Section):
    advantage: str = Field("grpo", description="a registered advantage estimator (factory/algo/advantages.py)",
                           **registered(registries.ADVANTAGES))
    loss: str = Field("ppo_clip", description="a registered policy loss (factory/algo/losses.py)",
                      **registered(registries.POLICY_LOSSES))
    clip_low: float = Field(0.2, ge=0, description="lower ratio bound is 1 - clip_low")
    clip_high: float = Field(0.28, ge=0, description="clip-higher: upper ratio bound is 1 + clip_high")
    aggregation: str = Field("token_mean", description="how per-token losses become one number (factory/algo/losses.py)",
                             **registered(registries.AGGREGATIONS))
    kl_coef: float = Field(0.0, ge=0, description="KL to a frozen reference; 0 disables it")
    kl_estimator: str = Field("k3", description="a registered per-token KL estimator (factory/algo/kl.py)",
                              **registered(registries.KL_ESTIMATORS))
    filter_zero_variance: bool = Field(True, description="dynamic sampling: a group whose rewards are all equal "
                                       "(advantage 0, no gradient) is not trained and another starts in its "
                                       "place")
    distill: DistillSection = Field(default_factory=DistillSection, description="on-policy distillation from a "
                                    "teacher (off while distill.teacher is unset)")
    proximal: Literal["behaviour", "current", "loglinear"] = Field(
        "behaviour", validate_default=True,
        description="the policy the loss's ratio is centred on: behaviour = the sampler's logprobs (plain PPO); "
        "current = the policy before this step (exact; one optimizer step per batch); loglinear = AReaL's "
        "estimate of the policy one version behind, from per-token versions")
    behaviour_weight_cap: float = Field(5.0, gt=0, description="decoupled_ppo: tokens whose proximal/behaviour "
                                        "probability ratio exceeds it are dropped")
    corrections: list[OffPolicyCorrection] = Field(
        default_factory=list, description="off-policy corrections, applied in order to per-token weights before "
        "aggregation, e.g. [{name: tis, level: token, cap: 2.0}]")
    max_token_staleness: int | None = Field(
        None, ge=0, description="version-spread gate: a token more than this many versions behind the trainer is "
        "stale; unset: only the spread is reported")
    spread_action: Literal["none", "drop", "correct"] = Field(
        "none", description="what the gate does to stale tokens: none = report them; drop = leave them out of the "
        "loss; correct = centre their ratio on the current policy and weight them by min(current/behaviour, "
        "spread_is_cap)")
    spread_level: Literal["token", "sample"] = Field(
        "token", description="the gate acts on the stale tokens only, or on every token of a sample holding one")
    spread_is_cap: float = Field(2.0, gt=0, description="spread_action correct: largest importance weight")
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong penalty over the last N tokens before "
                                 "rollout.max_new_tokens; 0 disables it")
    overlong_penalty: float = Field(1.0, ge=0, description="reward subtracted at and beyond the length limit")
    routing_replay: Literal["off", "rollout"] | None = Field(
        None, description="mixture-of-experts policies: 'rollout' routes each sampled token through the experts "
        "the engine chose for it (R3), 'off' lets the trainer's router choose; unset: rollout for a "
        "mixture-of-experts policy, off for a dense one")
    router_aux_loss_coef: float = Field(0.0, ge=0, description="mixture-of-experts policies: weight of the "
                                        "router's load-balancing loss (0: off, as RL runs usually have it)")

    @field_validator("advantage", "loss", "aggregation", "kl_estimator")
    @classmethod
    def _known_entries(cls, value: str, info) -> str:
        registry = {"advantage": registries.ADVANTAGES, "loss": registries.POLICY_LOSSES,
                    "aggregation": registries.AGGREGATIONS, "kl_estimator": registries.KL_ESTIMATORS}[info.field_name]
        return registry.check(value)

    @field_validator("routing_replay", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        """YAML reads a bare `off` as false (and `on` as true): take them as the words they were."""
        return {False: "off", True: "rollout"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("proximal")
    @classmethod
    def _decoupled_needs_a_proximal(cls, proximal: str, info) -> str:
        if info.data.get("loss") == "decoupled_ppo" and proximal == "behaviour":
            raise ValueError("decoupled_ppo needs 'current' or 'loglinear' (with 'behaviour' it is ppo_clip)")
        return proximal

    @field_validator("corrections")
    @classmethod
    def _ratio_corrections_need_a_proximal(cls, corrections: list, info) -> list:
        if info.data.get("proximal") == "behaviour":
            for c in corrections:
                if registries.is_correction(c.name):
                    raise ValueError(f"{c.name} weighs the proximal/behaviour ratio, which is 1 with algorithm.proximal "
                                     "'behaviour'; set proximal to 'current' or 'loglinear'")
        return corrections

    @field_validator("spread_action")
    @classmethod
    def _gate_needs_a_limit(cls, action: str, info) -> str:
        if action != "none" and info.data.get("max_token_staleness") is None:
            raise ValueError(f"{action!r} needs algorithm.max_token_staleness")
        weighted = info.data.get("loss") == "decoupled_ppo" or any(
            c.name == "tis" for c in info.data.get("corrections") or [])
        if action == "correct" and weighted:
            raise ValueError("'correct' importance-weights the stale tokens, which decoupled_ppo or a tis correction "
                             "already does; use 'drop' or remove one")
        return action
