"""The data check before a run (`factory recipe check`, `factory run`): build a recipe's task dataset
as the run will, and say what is wrong with it in one line each, or what it holds.

What it catches that validating the recipe cannot (it needs reasoning-gym, or the files): a family
name reasoning-gym does not know, a family config it refuses, a family that cannot give its share of
`data.heldout_size` distinct questions or has none left to train on, and every file source problem
(`factory.data.sources`: a missing file or column, an empty split, a duplicate id, a bad row), and
prompts longer than the engines' context leaves them (`factory.data.lengths`). Beside it, the machine
check (`machine_problems`): what this machine lacks to run a recipe (its model directory, its engine).
"""

from __future__ import annotations

import difflib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from factory.core import registries
from factory.data.lengths import check_tokenizer, measure, prompt_function
from factory.data.tasks import LOCAL_FAMILIES, ReasoningGymSource, dataset_fingerprint
from factory.recipe import Recipe


@dataclass
class DataCheck:
    """`problems`: one line each (empty when the dataset builds); `lines`: what it holds, a sample
    rendered prompt per source; `fingerprint`: the dataset's (`dataset_fingerprint`)."""

    problems: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    fingerprint: str | None = None


def family_problems(data_section) -> list[str]:
    """Unknown family names (with the closest known one) and configs reasoning-gym refuses."""
    import reasoning_gym

    from factory.rewards.verifiers import reasoning_gym_families

    known = reasoning_gym_families()
    problems = []
    for i, family in enumerate(data_section.families):
        if family.name in LOCAL_FAMILIES:
            continue
        if family.name not in known:
            close = difflib.get_close_matches(family.name, [*known, *LOCAL_FAMILIES], n=1)
            hint = (f"did you mean {close[0]!r}?" if close
                    else f"see reasoning_gym's {len(known)} datasets or {sorted(LOCAL_FAMILIES)}")
            problems.append(f"data.families[{i}].name: unknown task family {family.name!r}; {hint}")
            continue
        config = dict(family.config)
        if isinstance(config.get("operators"), list):
            config["operators"] = tuple(config["operators"])
        try:
            reasoning_gym.create_dataset(family.name, size=1, seed=0, **config)
        except Exception as err:  # reasoning-gym raises a mix of AssertionError/TypeError/ValueError
            problems.append(f"data.families[{i}].config: {family.name} refuses {family.config} "
                            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'invalid'})")
    return problems


def size_problems(source: ReasoningGymSource) -> list[str]:
    """Families short of their share of held-out questions, or left with no training question."""
    held = Counter(t.family for t in source.heldout)
    train = Counter(t.family for t in source.train)
    problems = []
    for spec, asked in zip(source.families, source.family_sizes(source.heldout_size)):
        if spec.name in LOCAL_FAMILIES:  # a fixed set splits itself (its own heldout_fraction)
            continue
        if held[spec.name] < asked:
            problems.append(f"data.heldout_size: {spec.name} gives {held[spec.name]} distinct held-out questions of "
                            f"the {asked} asked (it holds no more: lower data.heldout_size or widen its config)")
    for spec in source.families:
        if not train[spec.name]:
            problems.append(f"data.train_size: {spec.name} has no training question left (all "
                            f"{held[spec.name]} it gives are held out)")
    return problems


def render_prompt(messages: list[dict[str, Any]], limit: int = 240) -> str:
    """Chat messages on one line: `[system] ... [user] "What is 2 + 3?"` (text JSON-quoted, long text cut)."""
    parts = []
    for m in messages:
        text = json.dumps(m.get("content") or "", ensure_ascii=False)
        parts.append(f"[{m['role']}] " + (text if len(text) <= limit else text[: limit - 4] + '..."'))
    return " ".join(parts)


def check_data(recipe) -> DataCheck:
    """Build `recipe`'s task dataset (families and file sources) without running anything else."""
    problems = family_problems(recipe.data)
    if problems:
        return DataCheck(problems)
    try:
        source = ReasoningGymSource.from_recipe(recipe.data)
        train, heldout = source.train, source.heldout
    except ValueError as err:
        return DataCheck([str(err).splitlines()[0]])
    problems = size_problems(source)
    if problems:
        return DataCheck(problems)
    fingerprint = dataset_fingerprint(recipe.data, source.files)
    out = DataCheck(fingerprint=fingerprint)
    out.lines.append(f"data {fingerprint}: {len(train)} train, {len(heldout)} heldout tasks")
    held, trained = Counter(t.family for t in heldout), Counter(t.family for t in train)
    families = dict(zip((f.name for f in source.families), source.family_sizes(source.train_size)))
    for name, asked in families.items():
        short = "" if trained[name] >= asked or name in LOCAL_FAMILIES else f" (of {asked} asked: it holds no more)"
        out.lines.append(f"  {name} (reasoning-gym)" if name not in LOCAL_FAMILIES else f"  {name}")
        out.lines[-1] += f": {trained[name]} train{short}, {held[name]} heldout"
    prompt, _ = prompt_function(recipe)
    if source.families:
        first = next(t for t in train if t.family == source.families[0].name)
        out.lines.append(f"    sample prompt ({first.task_id}): {render_prompt(prompt(first))}")
    for f in source.files:
        out.lines.append(f"  {f.describe()}")
        out.lines.append(f"    sample prompt ({f.train[0].task_id}): {render_prompt(prompt(f.train[0]))}")
    out.problems += prompt_length_lines(recipe, source, out.lines)
    return out


def prompt_length_lines(recipe, source, lines: list[str]) -> list[str]:
    """The prompts' token lengths against the engines' context (`factory.data.lengths`), added to `lines`;
    returns the problem line where some are longer and `data.overlong` is error."""
    try:
        tokenizer = check_tokenizer(recipe, source)
    except Exception as err:  # noqa: BLE001  (a model.path without a tokenizer: the machine check names it)
        lines.append(f"  prompt tokens: not measured (no tokenizer: {type(err).__name__})")
        return []
    lengths = measure(recipe, tokenizer, [*source.train, *source.heldout])
    lines.append(f"  {lengths.summary()}")
    over, mode = len(lengths.overlong), recipe.data.overlong
    if not over:
        return []
    if mode == "error":
        return [lengths.error()]
    fate = "dropped" if mode == "drop" else "cut to fit (the start of their user message)"
    lines.append(f"  {over} of {len(lengths.tasks)} prompts are longer than {lengths.limit} tokens: {fate} at the "
                 f"run's start (data.overlong={mode})")
    return []


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
        missing = registries.ENGINES[recipe.rollout.engine].missing()
        if missing:
            out.append(f"{source}: rollout.engine: {recipe.rollout.engine} cannot start on this machine: {missing}")
    return out
