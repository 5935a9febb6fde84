"""Recipes: typed, validated run configuration as code.

A recipe is a YAML file whose sections map onto the models below. Dotted overrides
(`train.lr=3e-4`) patch it from the command line; a `sweep` section holds a grid that expands
to one recipe per grid point. Every user error becomes a `RecipeError` whose lines each name the
file and the field path, never a traceback.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import importlib
import itertools
import json
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator, model_serializer,
                      model_validator)
from pydantic_core import ErrorDetails

from factory.support.threads import Threads


class RecipeError(ValueError):
    """A recipe problem a user can fix; `str()` is one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class ModelSection(Section):
    """The policy. With `path` unset, a tiny model of `architecture` is built and warm-started locally."""

    path: str | None = Field(None, description="an existing HF model dir; unset builds the tiny model")
    architecture: Literal["llama", "qwen2"] = Field(
        "llama", description="the tiny model built when path is unset: llama (its own role-tag chat template, "
        "untied embeddings) or qwen2 (q/k/v biases, grouped-query attention, tied embeddings, ChatML)")
    hidden_size: int = Field(256, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int | None = Field(None, gt=0, description="key/value heads (grouped-query attention when "
                                     "fewer than num_heads, which they must divide); unset: num_heads")
    intermediate_size: int = Field(704, gt=0)
    max_position: int = Field(256, gt=16)
    bpe_vocab_size: int = Field(300, ge=260, description="byte-level BPE vocab incl. 256 bytes")
    sft_steps: int = Field(2400, ge=0, description="supervised warm-start steps (at most, with sft_stop_loss)")
    sft_stop_loss: float | None = Field(
        None, gt=0, description="end the warm start once the mean loss of its last 50 updates is at or below "
        "this: a policy just off the loss plateau, with room left for RL, whatever the seed; unset: all sft_steps")
    sft_batch_size: int = Field(32, gt=0)
    sft_lr: float = Field(1e-3, gt=0)
    sft_examples: int = Field(20000, gt=0, description="training tasks used for the warm start")
    seed: int = 0

    @model_validator(mode="after")
    def _heads(self) -> ModelSection:
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide num_heads ({self.num_heads})")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} must be a multiple of num_heads ({self.num_heads})")
        return self


class TaskFamily(Section):
    name: str = Field(description="a reasoning-gym dataset name, e.g. basic_arithmetic, or code_tasks "
                      "(programming problems with unit tests, factory/data/code_tasks.py)")
    weight: float = Field(1.0, gt=0)
    config: dict[str, Any] = Field(default_factory=dict, description="the dataset's own options")


class PromptSpec(Section):
    """How a row becomes the prompt: exactly one of these."""

    field: str | None = Field(None, description="the column whose text is the user message")
    template: str | None = Field(None, description="the user message as str.format over the row's columns, "
                                 "e.g. 'Question: {question}'")
    messages_field: str | None = Field(None, description="the column holding chat messages "
                                       "([{role, content}, ...], ending with the user's)")

    @model_validator(mode="after")
    def _exactly_one(self) -> PromptSpec:
        given = [name for name in ("field", "template", "messages_field") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of field, template, messages_field (got {', '.join(given) or 'none'})")
        return self


class AnswerSpec(Section):
    field: str = Field("answer", description="the column holding the reference answer (also the warm start's target)")
    extract: str | None = Field(None, description="an answer extractor (boxed, gsm8k, final_line) giving the "
                                "reference verifiers compare with; unset: the whole field")

    @field_validator("extract")
    @classmethod
    def _known_extractor(cls, name: str | None) -> str | None:
        return None if name is None else _check_registered(name, "factory.rewards.extract", "EXTRACTORS")


class VerifierSpec(Section):
    """A verifier from factory/rewards/verifiers.py, with its options."""

    name: str = Field(description="exact, numeric, math_verify, regex, code or reasoning_gym")
    extract: str | None = Field(None, description="an answer extractor applied to the reply before it is "
                                "compared; unset: the whole reply")
    config: dict[str, Any] = Field(default_factory=dict, description="the verifier's options, e.g. {abs_tol: 0.01}")

    @model_validator(mode="after")
    def _usable(self) -> VerifierSpec:
        from factory.rewards.verifiers import spec_problems

        problems = spec_problems(self.name, self.extract, self.config)
        if problems:
            raise ValueError(problems[0])
        return self


class HeldoutSpec(Section):
    """Where the held-out split comes from: rows of their own (path, split or table/where: the rest as the
    source's), or a seeded share of the source's rows (size or fraction)."""

    path: str | None = Field(None, description="a file (or save_to_disk directory) of its own")
    split: str | None = Field(None, description="hf_disk: a split of a DatasetDict directory, e.g. test")
    table: str | None = Field(None, description="iceberg: a table of its own")
    where: str | None = Field(None, description="iceberg: a row filter of its own")
    size: int | None = Field(None, gt=0, description="rows held out by a seeded split")
    fraction: float | None = Field(None, gt=0, lt=1, description="share of rows held out by a seeded split")
    seed: int = 0

    @model_validator(mode="after")
    def _one_way(self) -> HeldoutSpec:
        own = [n for n in ("path", "split", "table", "where") if getattr(self, n) is not None]
        seeded = [n for n in ("size", "fraction") if getattr(self, n) is not None]
        if bool(own) == bool(seeded) or len(seeded) > 1:
            raise ValueError("give rows of its own (path, split, table or where) or one of size, fraction for a "
                             f"seeded split (got {', '.join(own + seeded) or 'none'})")
        return self


SOURCE_LOCATION = {"jsonl": ("path",), "parquet": ("path",), "hf_disk": ("path", "split"),
                   "iceberg": ("table", "where")}


class DataSource(Section):
    """Tasks from rows of a file or table (factory/data/sources.py)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="names its tasks (their family and id prefix)")
    kind: Literal["jsonl", "parquet", "hf_disk", "iceberg"]
    path: str | None = Field(None, description="jsonl, parquet: the file; hf_disk: the save_to_disk directory "
                             "(relative: to the current directory, else to the repository)")
    split: str | None = Field(None, description="hf_disk: the split of a DatasetDict directory")
    table: str | None = Field(None, description="iceberg: namespace.table in `catalog`")
    where: str | None = Field(None, description="iceberg: a row filter, e.g. \"split = 'train'\"")
    catalog: dict[str, Any] = Field(default_factory=dict, description="iceberg: catalog properties as "
                                    "lake.catalog (empty: this factory's lake)")
    prompt: PromptSpec
    answer: AnswerSpec = Field(default_factory=AnswerSpec)
    id: str | None = Field(None, description="the column holding each row's unique id; unset: its position")
    verifier: VerifierSpec | None = Field(None, description="how replies are scored (unset, and no verifier_field: exact)")
    verifier_field: str | None = Field(None, description="the column naming each row's verifier (a name or "
                                       "{name, extract, config})")
    heldout: HeldoutSpec

    @model_validator(mode="after")
    def _consistent(self) -> DataSource:
        locations = SOURCE_LOCATION[self.kind]
        stray = [n for n in ("path", "split", "table", "where") if getattr(self, n) is not None and n not in locations]
        if stray:
            raise ValueError(f"{stray[0]}: not an option of kind {self.kind} (its options: {', '.join(locations)})")
        if getattr(self, locations[0]) is None:
            raise ValueError(f"{locations[0]}: kind {self.kind} reads from a {locations[0]}; give one")
        own_stray = [n for n in ("path", "split", "table", "where")
                     if getattr(self.heldout, n) is not None and n not in locations]
        if own_stray:
            raise ValueError(f"heldout.{own_stray[0]}: not an option of kind {self.kind} "
                             f"(its options: {', '.join(locations)})")
        if self.kind == "iceberg" and self.id is None:
            raise ValueError("id: an iceberg source needs an id column (a table's scan order is not stable)")
        if self.verifier is not None and self.verifier_field is not None:
            raise ValueError("verifier_field: give verifier (one for every row) or verifier_field (per row), not both")
        return self


# no one training set is bigger than this: a split is generated in memory before a run
MAX_TRAIN_SIZE, MAX_HELDOUT_SIZE = 1_000_000, 100_000


class DataSection(Section):
    families: list[TaskFamily] = Field(
        default_factory=lambda: [
            TaskFamily(
                name="basic_arithmetic",
                config=dict(
                    min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["+"],
                    allow_parentheses=False, allow_negation=False,
                ),
            )
        ],
        description="reasoning-gym families (none by default once `sources` are given)",
    )
    sources: list[DataSource] = Field(default_factory=list, description="tasks from files or lake tables")
    train_size: int = Field(8000, gt=0, le=MAX_TRAIN_SIZE,
                            description="the families' unique training questions (fewer if a family is small)")
    heldout_size: int = Field(1000, gt=0, le=MAX_HELDOUT_SIZE, description="the families' held-out questions")
    seed: int = 0
    overlong: Literal["error", "drop", "truncate"] = Field(
        "error", description="prompts longer than rollout.max_model_len - rollout.max_new_tokens tokens: error "
        "(the recipe check and the run refuse them), drop (those tasks leave the run, recorded in the lake as "
        "`dropped`), truncate (the user message is cut from its start until the prompt fits)")

    @model_validator(mode="before")
    @classmethod
    def _sources_replace_the_default_families(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("sources") and "families" not in data:
            return {**data, "families": []}
        return data

    @model_validator(mode="after")
    def _some_tasks(self) -> DataSection:
        if not self.families and not self.sources:
            raise ValueError("families: needs at least 1 item(s), got 0 (or give data.sources)")
        names = [s.name for s in self.sources]
        for i, name in enumerate(names):
            if name in names[:i] or name in {f.name for f in self.families}:
                raise ValueError(f"sources[{i}].name: {name!r} names another source or family; pick another")
        return self

    @model_serializer(mode="wrap")
    def _without_empty_sources(self, handler) -> dict[str, Any]:
        # a data section without sources dumps as it did before they existed: the fingerprints of
        # existing recipes, their cached base policies and lake partitions stay the same
        data = handler(self)
        if not self.sources:
            data.pop("sources", None)
        if self.overlong == "error":  # the same for data.overlong, added later
            data.pop("overlong", None)
        return data


class LatencySection(Section):
    """Synthetic environment latency: most episodes fast, a fraction much slower (benchmarks)."""

    fast_s: float = Field(0.0, ge=0)
    slow_s: float = Field(0.0, ge=0)
    slow_fraction: float = Field(0.0, ge=0, le=1)
    per_task: bool = Field(False, description="slowness is a property of the task (a hash of its id), not a "
                           "coin flip per episode — as when some prompts need long tool use")


class SandboxSection(Section):
    """Where environments run untrusted code (tool calls, unit tests of code tasks): factory/sandbox."""

    backend: Literal["auto", "bubblewrap", "docker"] = Field(
        "auto", description="auto: Docker if an engine answers, else bubblewrap")
    image: str = Field("python", description="a sandboxes/<name>/spec.yaml image")
    concurrency: int = Field(8, gt=0, description="programs running at once per env worker")
    wall_s: float = Field(10.0, gt=0, description="wall-time limit per program")
    memory_mb: int = Field(256, gt=0)


class EnvironmentSection(Section):
    name: str = Field("single_turn", description="a registered environment (factory/envs/), or package.module:attr "
                      "of your own", examples=["single_turn", "tool_agent", "my_package.envs:MyEnvironment"])
    system_prompt: str | None = None
    workers: int = Field(1, gt=0, description="env worker actors, each hosting a gateway")
    latency: LatencySection = Field(default_factory=LatencySection)
    max_turns: int = Field(3, gt=0, description="tool_agent: model calls per episode; a tool call on the "
                           "last one ends the episode unanswered")
    sandbox: SandboxSection = Field(default_factory=SandboxSection)
    direct: bool = Field(True, description="play environments whose episode is one tool-less call (those with "
                         "score_reply, e.g. single_turn) in-process: no OpenAI client or HTTP hop, the prompt "
                         "rendered once per task, the same tokens recorded; false: every call goes through "
                         "the gateway's OpenAI endpoint")


def _registry(module: str, name: str):
    """The Registry `name` of `module`, imported on first use (this module stays import-light)."""
    return getattr(importlib.import_module(module), name)


def _registered(module: str, name: str) -> dict[str, Any]:
    """Field arguments for a name from a registry: the JSON schema lists its entries (editors
    autocomplete them); pair with `_check_registered` in a field validator."""
    def enum(schema: dict[str, Any]) -> None:
        schema["enum"] = _registry(module, name).names()

    return {"json_schema_extra": enum}


def _check_registered(value: str, module: str, name: str) -> str:
    return _registry(module, name).check(value)


def _engine_names() -> list[JsonValue]:
    from factory.rollout.engines import ENGINES

    return list(ENGINES.names())


class HealthSection(Section):
    """How a run watches the engines it started (attached ones, `rollout.urls`, are waited for, never
    restarted): a probe every `interval_s`; a server whose process exited is dead at once, one that
    misses `misses` probes in a row (hung, e.g. stopped) is killed; either is restarted."""

    interval_s: float = Field(10, gt=0, description="seconds between probes of each engine")
    timeout_s: float = Field(5, gt=0, description="a probe unanswered after this is a miss")
    misses: int = Field(2, ge=1, description="missed probes in a row that declare an engine hung")
    first_wait_s: float = Field(30, ge=0, description="no probe this long after an engine (re)starts")


class RolloutSection(Section):
    engine: str = Field("vllm", description="a registered rollout engine (factory/rollout/engines.py)",
                        json_schema_extra={"enum": _engine_names()})
    num_engines: int = Field(1, gt=0, description="engines to start (with `urls`: one per URL)")
    urls: list[str] = Field(
        default_factory=list, description="attach to these running engines (e.g. `factory serve`) instead of "
        "starting any; the run syncs its weights into them and leaves them running")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where started engines serve: auto = cuda when the engine's node has a GPU")
    sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="weight_sync=broadcast: the collective; auto = nccl when the trainer is on cuda, "
        "else gloo (nccl is untested here: no GPU)")
    group_size: int = Field(8, gt=1, description="G completions per prompt")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 disables top-k")
    max_new_tokens: int = Field(8, gt=0)
    min_new_tokens: int = Field(0, ge=0, description="end-of-turn is suppressed before this many tokens "
                                "(benchmarks and tests use it to force long generations)")
    max_model_len: int = Field(256, gt=16, description="prompt + completion tokens an engine accepts")
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    weight_sync: Literal["broadcast", "disk", "lora"] = Field(
        "broadcast", description="broadcast: gloo buckets into the vLLM worker; disk: reload a saved "
        "checkpoint; lora: load the trained adapter in place (needs train.lora.enabled)")
    bucket_mb: int = Field(16, gt=0)
    kv_cache_gb: int = Field(2, gt=0)
    cpus: Threads = Field("auto", description="CPU threads for each engine; auto: this node's share by the "
                          "measured rule in factory/support/threads.py")
    coalesce_ms: float = Field(5.0, ge=0, description="vLLM: prompts arriving this close share one HTTP request")
    keep_sampling_mask: bool = Field(
        False, description="record the sampler's candidate set per token (top-k/top-p survivors) and "
        "renormalise the trainer's policy over it, so both policies share a support")
    support_cap: int = Field(64, gt=0, description="with top-p only: candidates asked for per token; a set "
                             "that fills it is treated as unknown")
    overlap_sync: bool = Field(
        True, description="the weight update after a step runs while the driver records it and the trainer takes "
        "the next (new requests wait for the new weights either way); false: the loop waits for the engines to reopen")
    partial_rollout: Literal["wait", "abort_resume", "inflight"] = Field(
        "wait", description="at a weight update: wait = drain in-flight requests first; abort_resume = abort "
        "them and continue prompt + tokens so far under the new weights; inflight = pause with the KV cache "
        "kept, swap weights, resume (vllm only for the last two)")
    startup_timeout_s: float = Field(300, gt=0)
    health: HealthSection = Field(default_factory=HealthSection)
    max_engine_restarts: int = Field(
        3, ge=0, description="engines restarted within one run (dead or hung; each is given the current "
        "weights, its in-flight groups re-queued); one more failure stops the run")
    seed: int | None = Field(
        0, description="each request's sampling seed derives from it, the episode's session id and turn, so "
        "generation repeats: two runs at η = 0, or a run and its resume, sample the same tokens. null: the engine "
        "draws. vLLM sends seeded prompts through the batch route Factory's servers add (an attached server "
        "without it, e.g. a plain `vllm serve`, takes one call per seed; so does partial_rollout=abort_resume); "
        "SGLang honours seeds only with deterministic inference, and otherwise samples unseeded")

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"expected http(s)://HOST:PORT addresses of running engines, got {bad}")
        return [u.rstrip("/") for u in urls]


class OffPolicyCorrection(Section):
    """One entry of `algorithm.corrections`: a registered correction and the knobs it reads."""

    name: str = Field(description="a registered correction (factory/algo/corrections.py)",
                      **_registered("factory.algo", "CORRECTIONS"))
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
        return _check_registered(name, "factory.algo", "CORRECTIONS")

    @model_validator(mode="after")
    def _reads_what_is_set(self) -> OffPolicyCorrection:
        from factory.algo import CORRECTION_PARAMS

        takes = CORRECTION_PARAMS[self.name]
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
                        **_registered("factory.training.scoring", "SCORERS"))

    @field_validator("scorer")
    @classmethod
    def _known_scorer(cls, name: str) -> str:
        return _check_registered(name, "factory.training.scoring", "SCORERS")


class AlgorithmSection(Section):
    advantage: str = Field("grpo", description="a registered advantage estimator (factory/algo/advantages.py)",
                           **_registered("factory.algo", "ADVANTAGES"))
    loss: str = Field("ppo_clip", description="a registered policy loss (factory/algo/losses.py)",
                      **_registered("factory.algo", "POLICY_LOSSES"))
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0, description="clip-higher: upper ratio bound is 1 + clip_high")
    aggregation: str = Field("token_mean", description="how per-token losses become one number (factory/algo/losses.py)",
                             **_registered("factory.algo.losses", "AGGREGATIONS"))
    kl_coef: float = Field(0.0, ge=0, description="KL to a frozen reference; 0 disables it")
    kl_estimator: str = Field("k3", description="a registered per-token KL estimator (factory/algo/kl.py)",
                              **_registered("factory.algo", "KL_ESTIMATORS"))
    filter_zero_variance: bool = True
    distill: DistillSection = Field(default_factory=DistillSection)
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

    @field_validator("advantage", "loss", "aggregation", "kl_estimator")
    @classmethod
    def _known_entries(cls, value: str, info) -> str:
        module, registry = {"advantage": ("factory.algo", "ADVANTAGES"), "loss": ("factory.algo", "POLICY_LOSSES"),
                            "aggregation": ("factory.algo.losses", "AGGREGATIONS"),
                            "kl_estimator": ("factory.algo", "KL_ESTIMATORS")}[info.field_name]
        return _check_registered(value, module, registry)

    @field_validator("proximal")
    @classmethod
    def _decoupled_needs_a_proximal(cls, proximal: str, info) -> str:
        if info.data.get("loss") == "decoupled_ppo" and proximal == "behaviour":
            raise ValueError("decoupled_ppo needs 'current' or 'loglinear' (with 'behaviour' it is ppo_clip)")
        return proximal

    @field_validator("corrections")
    @classmethod
    def _ratio_corrections_need_a_proximal(cls, corrections: list, info) -> list:
        from factory.algo import IS_CORRECTIONS

        if info.data.get("proximal") == "behaviour":
            for c in corrections:
                if c.name in IS_CORRECTIONS:
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


class AsyncSection(Section):
    max_staleness: int = Field(1, ge=0, description="η: 0 synchronous, 1 one-step off-policy, k async")
    max_inflight_groups: int = Field(32, gt=0)
    overprovision: int = Field(0, ge=0, description="groups started beyond the staleness budget, so a step takes "
                               "the first B to finish instead of waiting for the slowest (late ones may go stale)")
    expect_filtering: bool = Field(False, description="admission counts a running group as the share of recent "
                                   "groups the zero-variance filter let through, so a step starts what fills its batch "
                                   "in one round instead of refilling filtered slots round by round (η ≥ 1; see "
                                   "factory/core/buffer.py)")
    schedule: Literal["fifo", "longest_first"] = Field(
        "fifo", description="which upcoming prompt starts next: in order, or the one predicted to run longest "
        "(from the run's own history of group wall times)")
    lookahead: int = Field(16, gt=0, description="longest_first: upcoming tasks it chooses among")


class LoraSection(Section):
    """Train a LoRA adapter instead of the full weights (PEFT); engines then receive only the adapter."""

    enabled: bool = False
    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


class TrainSection(Section):
    steps: int = Field(400, gt=0)
    groups_per_step: int = Field(8, gt=0, description="B prompts per optimizer step")
    lr: float = Field(5e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    checkpoint_every: int = Field(100, ge=0, description="0 saves only the final checkpoint")
    checkpoint_every_s: float = Field(
        1800, ge=0, description="also checkpoint when this many seconds have passed since the last one, so a "
        "lost trainer costs minutes; 0 = by steps only")
    keep_checkpoints: int = Field(
        0, ge=0, description="keep only the newest N checkpoints in the run dir, deleting older ones as new ones are "
        "written (a run of days at checkpoint_every_s=1800 writes ~50 a day, each the model and its optimizer "
        "state); the lake's checkpoints table keeps every one's row and lineage; 0 = keep all")
    max_trainer_restarts: int = Field(
        2, ge=0, description="a trainer that dies is rebuilt inside the same run, which resumes from its latest "
        "checkpoint (exact, as a resumed run); one more death stops the run")
    max_restarts: int = Field(3, ge=0, description="times a crashed run is relaunched from its last checkpoint "
                              "(Dagster's rl_run_recovery sensor)")
    lora: LoraSection = Field(default_factory=LoraSection)
    threads: Threads = Field("auto", description="the trainer's CPU threads; auto: this node's share by the "
                             "measured rule in factory/support/threads.py")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the trainer's weights, activations and optimizer live: auto = cuda when the "
        "trainer's node has a GPU (cuda is untested here: no GPU)")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16: bf16 compute with fp32 master weights and optimizer state; auto = bf16 on "
        "cuda, fp32 on cpu (keeps resume, replay and reproducibility bitwise, and this CPU has no fast bf16)")
    activation_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="recompute each decoder block in the backward pass instead of keeping its "
        "activations; auto = on for cuda")
    micro_batch_tokens: int = Field(
        16384, ge=0, description="padded tokens (rows x longest row) per forward/backward; samples of similar "
        "length share a micro-batch, gradients accumulate to the whole batch's update; 0 = the whole batch")
    logprob_chunk_tokens: int = Field(
        512, gt=0, description="completion tokens per chunk through the output layer (each chunk's logits "
        "are recomputed in the backward pass; a [B, T, vocab] tensor never exists)")
    warm_up: bool = Field(True, description="one forward and backward pass on a dummy batch of the step's size "
                          "while the engines start, so step 1 does not pay the first pass's one-time costs "
                          "and AdamW's state made (zero moments at step 0); the run trains bitwise as without it")
    ranks: int = Field(1, ge=1, description="trainer ranks sharding the model with FSDP2 (gloo on cpu, nccl "
                       "on cuda), each a Ray actor placed by placement.trainer")
    seed: int = 0


class EvalSection(Section):
    heldout: int = Field(1000, gt=0, description="held-out prompts per evaluation: a seeded random sample of "
                         "the held-out split (all of it when data.heldout_size is not larger)")
    seed: int = Field(0, description="seeds which held-out tasks a subset holds: the same before and after "
                      "training and in every run of the recipe")
    temperature: float = Field(1.0, gt=0)
    before: bool = True
    after: bool = True


class FailuresSection(Section):
    """When failed groups (an environment, reward or sandbox error in an episode) fail the run."""

    max_in_a_row: int = Field(20, gt=0, description="consecutive failed groups that fail the run")
    max_share: float = Field(0.5, ge=0, le=1, description="share of finished groups failed that fails the run, "
                             "once min_groups have finished")
    min_groups: int = Field(20, gt=0, description="finished groups before max_share applies")
    tracebacks: int = Field(3, ge=0, description="failures each env worker logs with their whole traceback; "
                            "after them, a count line at 2^k failures")
    max_worker_restarts: int = Field(
        3, ge=0, description="env workers and the scorer restarted within one run after their process died "
        "(a dead worker's groups are re-queued under their ids); one more death stops the run")


class DeadlinesSection(Section):
    """How long each wait of the run may take before the run fails with an error naming it."""

    batch_s: float = Field(600, gt=0, description="the trainer waiting for its next batch")
    weight_sync_s: float = Field(300, gt=0, description="one weight sync into the engines (drain, transfer, reopen)")
    engine_call_s: float = Field(300, gt=0, description="one generation request to an engine (its episode fails)")
    train_step_s: float = Field(600, gt=0, description="one trainer step (also a checkpoint save, a scoring pass)")
    evaluation_s: float = Field(1800, gt=0, description="one held-out evaluation")
    partition_s: float = Field(
        120, gt=0, description="one role unreachable from another (a network partition, a node's network "
        "restart; Ray says the actor is unavailable, not dead): calls are retried, running groups keep their "
        "leases; longer, the role counts as lost (restarted where it can be, its groups re-queued)")
    service_outage_s: float = Field(
        300, gt=0, description="one outage of the lake's catalog or object store or of MLflow: writes are retried "
        "and queued (then spilled to the run dir) while training goes on; longer stops the run")
    no_signal_warn_s: float = Field(
        60, gt=0, description="training with groups finishing but none with a reward spread (rewards not all "
        "equal, the only groups with a gradient) for this long logs a warning, repeated at most this often")
    no_signal_s: float | None = Field(
        480, ge=0, description="no reward spread for this long stops the run (below deadlines.batch_s, so with the "
        "filter on this line, not the batch's deadline, ends it), whether the zero-variance filter "
        "drops those groups (no batch comes) or trains them with advantage 0 (no policy gradient; with the filter "
        "off, not watched where equal rewards may still teach: a teacher, reinforce_pp, overlong_buffer); 0 or "
        "null: never")


class LakeSection(Section):
    enabled: bool = False
    catalog: dict[str, Any] = Field(default_factory=dict, description="PyIceberg catalog properties")
    namespace: str = "factory"
    commit_interval_s: float = Field(
        5.0, gt=0, description="seconds rows may wait before their table is committed (each Iceberg "
        "commit costs the run ~0.1-0.2 s of CPU; a checkpoint or the run's end commits at once)")


class TrackingSection(Section):
    enabled: bool = False
    uri: str | None = None
    experiment: str = "factory"


Resources = dict[str, float]


class PlacementSection(Section):
    """Where each role of a run goes on a Ray cluster (`RAY_ADDRESS`), as the Ray resources its actors ask
    for: custom resources a node was started with (`ray start --resources '{"rollout": 1}'`), `node:<ip>`,
    or CPU / GPU. Empty: anywhere (a local Ray has one node). The driver runs where it is launched."""

    trainer: Resources = Field(default_factory=dict, description="the trainer actor, e.g. {trainer: 1, GPU: 1}")
    buffer: Resources = Field(default_factory=dict, description="the staleness buffer and task sampler")
    engine: Resources = Field(default_factory=dict, description="each rollout engine, e.g. {rollout: 1}")
    env_worker: Resources = Field(default_factory=dict, description="each env worker (hosts a gateway)")
    scorer: Resources = Field(default_factory=dict, description="the scoring phase's model, if any")

    @field_validator("trainer", "buffer", "engine", "env_worker", "scorer")
    @classmethod
    def _positive(cls, resources: Resources) -> Resources:
        bad = {k: v for k, v in resources.items() if v <= 0}
        if bad:
            raise ValueError(f"resource amounts must be > 0, got {bad}")
        return resources


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
        from factory.envs.base import environment_factory

        try:  # (the algorithm's registries are checked by their fields' validators)
            environment_factory(self.environment.name)
        except ValueError as err:
            raise ValueError(f"environment.name: {err}") from None
        from factory.rollout.engines import ENGINES

        if self.rollout.engine not in ENGINES:
            raise ValueError(f"rollout.engine: unknown {self.rollout.engine!r}; choose one of {ENGINES.names()}")
        problems = ENGINES[self.rollout.engine].problems(self.rollout, self.train.lora.enabled)
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


# ---- loading -------------------------------------------------------------------------------


_FLOAT_WITHOUT_DOT = re.compile(r"^[-+]?\d+[eE][-+]?\d+$")  # YAML 1.1 reads 3e-4 as a string
_PATH_IN_MESSAGE = re.compile(r"^([A-Za-z_][\w.\[\]]*): (.*)$")  # "algorithm.loss: unknown ..." from a validator


def _show(value: Any) -> str:
    """A short, one-line rendering of the value a user wrote."""
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _field_path(loc: tuple[Any, ...]) -> str:
    """('data', 'families', 0, 'name') -> 'data.families[0].name'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + ("async" if part == "async_" else str(part))
    return path or "<root>"


def _fields_of_parent(loc: tuple[Any, ...]) -> list[str]:
    """The field names allowed beside loc[-1] (empty if the parent is not a recipe section)."""
    model: type[BaseModel] = Recipe
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # a list item: stay on the list's item model
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if field is None:
            return []
        annotation = field.annotation
        if typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]
        annotation = next((a for a in typing.get_args(annotation) if a is not type(None)), annotation)  # X | None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [f.alias or n for n, f in model.model_fields.items()]


def _plain_message(e: ErrorDetails) -> str:
    """Pydantic's error in plain words: what is expected and what was written."""
    kind, ctx, got = e["type"], e.get("ctx", {}), _show(e.get("input"))
    if kind == "extra_forbidden":
        known = _fields_of_parent(e["loc"])
        close = difflib.get_close_matches(str(e["loc"][-1]), known, n=1)
        if close:
            return f"unknown field; did you mean {close[0]!r}?"
        return f"unknown field; known fields: {', '.join(known)}" if known else "unknown field"
    if kind == "missing":
        is_list_item = isinstance(e["loc"][-1], int)
        return "item missing; the list is too short" if is_list_item else "required but missing"
    if kind in ("int_parsing", "int_type"):
        return f"expected an integer, got {got}"
    if kind == "int_from_float":
        return f"expected a whole number, got {got}"
    if kind in ("float_parsing", "float_type"):
        return f"expected a number, got {got}"
    if kind in ("bool_parsing", "bool_type"):
        return f"expected true or false, got {got}"
    if kind == "string_type":
        return f"expected text, got {got}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"expected a section of `field: value` lines, got {got}"
    if kind in ("list_type", "tuple_type"):
        return f"expected a list, got {got}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}, got {got}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit}, got {got}"
    if kind == "too_short":
        return f"needs at least {ctx['min_length']} item(s), got {ctx['actual_length']}"
    if kind == "too_long":
        return f"takes at most {ctx['max_length']} item(s), got {ctx['actual_length']}"
    return e["msg"].removeprefix("Value error, ").removeprefix("Input should be ").replace("\n", " ")


def _format_errors(
    source: str, err: ValidationError, overrides: dict[str, str] | None = None
) -> list[str]:
    """One line per problem: `source: field.path: what to fix`.

    `overrides` maps an overridden dotted path to the override text; a problem at or below
    (or above) that path is tagged with it, since the file itself is not where the value came from.
    """
    lines = []
    for e in err.errors():
        path, msg = _field_path(e["loc"]), _plain_message(e)
        in_message = _PATH_IN_MESSAGE.match(msg)
        if in_message and path == "<root>":  # a model validator names its own field path
            path, msg = in_message.groups()
        elif in_message and re.split(r"[.\[]", in_message[1])[0] in _fields_of_parent((*e["loc"], "")):
            path, msg = f"{path}.{in_message[1]}", in_message[2]  # ... or one below its section
        dotted = path.replace("[", ".").replace("]", "")
        for target, text in (overrides or {}).items():
            target = target.replace("[", ".").replace("]", "")
            if dotted == target or dotted.startswith(target + ".") or target.startswith(dotted + "."):
                msg += f" (from override {text!r})"
                break
        lines.append(f"{source}: {path}: {msg}")
    return lines


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", value parsed as YAML, so 3e-4, true, [1, 2] all work)."""
    if "=" not in text:
        raise RecipeError([f"override {text!r}: expected FIELD.PATH=VALUE, e.g. train.lr=3e-4"])
    path, raw = text.split("=", 1)
    if not path.strip():
        raise RecipeError([f"override {text!r}: empty field path before '='"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _FLOAT_WITHOUT_DOT.match(value.strip()):
        value = float(value)
    return path.strip(), value


_PATH_PART = re.compile(r"^([A-Za-z_]\w*)((?:\[\d+\])*)$")  # `families` or `families[0]` (or `m[0][1]`)


def _path_steps(path: str) -> list[str | int]:
    """'data.families[0].name' -> ['data', 'families', 0, 'name']."""
    steps: list[str | int] = []
    for part in path.split("."):
        match = _PATH_PART.match(part.strip())
        if not match:
            raise RecipeError([f"field path {path!r}: {part!r} is not a field name, optionally with [index], "
                               "e.g. data.families[0].name"])
        steps.append(match.group(1))
        steps.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    return steps


def _list_default(steps: list[str | int]) -> Any:
    """The default (as recipe data) of the list field at `steps`, None when that is not a recipe field."""
    model: Any = Recipe
    field = None
    for step in steps:
        if isinstance(step, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = next((f for n, f in model.model_fields.items() if step in (n, f.alias)), None)
        if field is None:
            return None
        annotation = field.annotation
        model = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else annotation
    default = field.get_default(call_default_factory=True) if field is not None else None
    if not isinstance(default, list):
        return None
    return [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in default]


def set_dotted(data: dict[str, Any], path: str, value: Any) -> None:
    """Set `path` (dotted fields, list items by index: `data.families[0].name`) in `data`, making the
    sections it passes through; an index must name an item the list already has."""
    steps = _path_steps(path)
    node: Any = data
    for i, (step, nxt) in enumerate(zip(steps, steps[1:])):
        where = _field_path(tuple(steps[: i + 1]))
        if isinstance(step, int):
            if not isinstance(node, list) or step >= len(node):
                size = f"has {len(node)} item(s)" if isinstance(node, list) else "is not a list"
                raise RecipeError([f"field path {path!r}: {_field_path(tuple(steps[:i]))} {size}; no item [{step}]"])
            child = node[step]
        else:
            child = node.get(step)
            if child is None:  # not in the file: a list starts from its default (data.families), a section empty
                child = node[step] = _list_default(steps[: i + 1]) if isinstance(nxt, int) else {}
        if isinstance(nxt, int) and not isinstance(child, list):
            raise RecipeError([f"field path {path!r}: {where} is not a list"])
        if isinstance(nxt, str) and not isinstance(child, dict):
            raise RecipeError([f"field path {path!r}: {where!r} holds a value, not a section of fields"])
        node = child
    last = steps[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or last >= len(node):
            raise RecipeError([f"field path {path!r}: {_field_path(tuple(steps[:-1]))} has no item [{last}]"])
    node[last] = value


def recipe_from_dict(data: Any, source: str = "<recipe>", overrides: Sequence[str] = ()) -> Recipe:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            [f"{source}: <root>: expected a mapping of sections (model:, train:, ...), got {_show(data)}"]
        )
    data = copy.deepcopy(data)
    overridden: dict[str, str] = {}
    for o in overrides:
        path, value = parse_override(o)
        try:
            set_dotted(data, path, value)
        except RecipeError as err:
            raise RecipeError([f"{source}: {line} (from override {o!r})" for line in err.problems]) from None
        overridden[path] = o
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_errors(source, err, overridden)) from None
    if recipe.sweep:  # every grid point is checked now, not when a sweep reaches it
        expand_sweep(recipe, source)
    return recipe


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read, patch and validate a recipe file. Raises RecipeError with one line per problem."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError([f"{p}: no such recipe file"])
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError([f"{p}: cannot read the file ({err})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "<root>"
        problem = str(getattr(err, "problem", None) or err).replace("\n", " ")
        raise RecipeError([f"{p}: {where}: invalid YAML ({problem})"]) from None
    if data is None:
        raise RecipeError([f"{p}: the file is empty{' (only comments)' if text.strip() else ''}; a recipe needs at "
                           "least one section, e.g. `name: my-run` (recipes/default.yaml shows them all)"])
    return recipe_from_dict(data, str(p), overrides)


def expand_sweep(recipe: Recipe, source: str = "<recipe>") -> list[tuple[dict[str, Any], Recipe]]:
    """One (grid point, recipe) per element of the product of `sweep`'s value lists. A grid value that
    makes an invalid recipe is a RecipeError naming the point, one line per distinct problem."""
    if not recipe.sweep:
        return [({}, recipe)]
    base = recipe.dump()
    base["sweep"] = {}
    keys = list(recipe.sweep)
    out: list[tuple[dict[str, Any], Recipe]] = []
    problems: dict[str, str] = {}  # problem (without the point) -> its first line
    for values in itertools.product(*(recipe.sweep[k] for k in keys)):
        point = dict(zip(keys, values))
        where = f"{source}: sweep point {', '.join(f'{k}={_show(v)}' for k, v in point.items())}"
        data = copy.deepcopy(base)
        suffix = "-".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items())
        data["name"] = f"{recipe.name}-{suffix}"
        try:
            for k, v in point.items():
                set_dotted(data, k, v)
            out.append((point, recipe_from_dict(data, where)))
        except RecipeError as err:
            for line in err.problems:  # a bad value fails every point holding it: report it once
                problems.setdefault(line.removeprefix(where).removeprefix(": ").split(" (from", 1)[0],
                                    line if line.startswith(where) else f"{where}: {line}")
    if problems:
        raise RecipeError(list(problems.values()))
    return out


def machine_problems(recipe: Recipe, source: str = "<recipe>") -> list[str]:
    """What this machine lacks to run `recipe`, one line each (`recipe check` and `factory run` ask before
    anything starts): a `model.path` that is not a model directory, a context shorter than
    `rollout.max_model_len`, an engine that is not installed here. Not part of validation: a recipe may be
    written on one machine for another."""
    out = []
    if recipe.model.path:
        path = Path(recipe.model.path)
        config = path / "config.json"
        if not path.exists():
            out.append(f"{source}: model.path: {path} does not exist")
        elif not config.is_file():
            out.append(f"{source}: model.path: {path} is not a model directory (no config.json)")
        else:
            try:
                context = json.loads(config.read_text()).get("max_position_embeddings")
            except (OSError, ValueError, AttributeError) as err:
                out.append(f"{source}: model.path: cannot read {config} ({err})")
                context = None
            if isinstance(context, int) and recipe.rollout.max_model_len > context:
                out.append(f"{source}: rollout.max_model_len: {recipe.rollout.max_model_len} is beyond the context of "
                           f"{path} (max_position_embeddings={context})")
            if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
                out.append(f"{source}: model.path: {path} holds no weights (*.safetensors or *.bin)")
    if not recipe.rollout.urls:  # attached engines run elsewhere
        from factory.rollout.engines import ENGINES

        missing = ENGINES[recipe.rollout.engine].missing()
        if missing:
            out.append(f"{source}: rollout.engine: {recipe.rollout.engine} cannot start on this machine: {missing}")
    return out


def json_schema() -> dict[str, Any]:
    return Recipe.model_json_schema(by_alias=True)
