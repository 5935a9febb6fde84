"""The recipe's `data` section: reasoning-gym families and file or table sources of tasks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_serializer, model_validator

from factory.core import registries
from factory.recipe.base import Section


class TaskFamily(Section):
    name: str = Field(description="a reasoning-gym dataset name, e.g. basic_arithmetic, or code_tasks "
                      "(programming problems with unit tests, factory/data/code_tasks.py)")
    weight: float = Field(1.0, gt=0, description="the family's share of train_size and heldout_size, relative "
                          "to the other families' weights")
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
        return None if name is None else registries.EXTRACTORS.check(name)


class VerifierSpec(Section):
    """A verifier from factory/rewards/verifiers.py, with its options."""

    name: str = Field(description="exact, numeric, math_verify, regex, code or reasoning_gym")
    extract: str | None = Field(None, description="an answer extractor applied to the reply before it is "
                                "compared; unset: the whole reply")
    config: dict[str, Any] = Field(default_factory=dict, description="the verifier's options, e.g. {abs_tol: 0.01}")

    @model_validator(mode="after")
    def _usable(self) -> VerifierSpec:
        problems = registries.VALIDATORS["verifier_spec"](self.name, self.extract, self.config)
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
    seed: int = Field(0, description="seeded split: which rows are held out (those whose hash of seed and id "
                      "is smallest)")

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
    kind: Literal["jsonl", "parquet", "hf_disk", "iceberg"] = Field(
        description="the reader: jsonl (a JSON object per line), parquet, hf_disk (a datasets save_to_disk "
        "directory) or iceberg (a lake table)")
    path: str | None = Field(None, description="jsonl, parquet: the file; hf_disk: the save_to_disk directory "
                             "(relative: to the current directory, else to the repository)")
    split: str | None = Field(None, description="hf_disk: the split of a DatasetDict directory")
    table: str | None = Field(None, description="iceberg: namespace.table in `catalog`")
    where: str | None = Field(None, description="iceberg: a row filter, e.g. \"split = 'train'\"")
    catalog: dict[str, Any] = Field(default_factory=dict, description="iceberg: catalog properties as "
                                    "lake.catalog (empty: this factory's lake)")
    prompt: PromptSpec = Field(description="how each row becomes the prompt")
    answer: AnswerSpec = Field(default_factory=AnswerSpec, description="where each row's reference answer is")
    id: str | None = Field(None, description="the column holding each row's unique id; unset: its position")
    verifier: VerifierSpec | None = Field(None, description="how replies are scored (unset, and no verifier_field: exact)")
    verifier_field: str | None = Field(None, description="the column naming each row's verifier (a name or "
                                       "{name, extract, config})")
    heldout: HeldoutSpec = Field(description="where the source's held-out split comes from")

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
    seed: int = Field(0, description="seeds the families' question generation (each family and split derives "
                      "its own seed from it)")
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
