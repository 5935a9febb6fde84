"""Prompt lengths against the engines' context: vLLM refuses a prompt longer than
`rollout.max_model_len - rollout.max_new_tokens` tokens, so `factory recipe check` and the start of
every run render and tokenize every train and held-out prompt as the gateway does (the environment's
`prompt_messages` in the policy's chat template) and refuse such prompts in one line, or drop or cut
them (`data.overlong`), before any engine starts.
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from factory.model.tokens import encode_chats, load_tokenizer
from factory.recipe import RecipeError
from factory.core.types import Task

log = logging.getLogger("factory.data")

LIMIT_FIELDS = "rollout.max_model_len - rollout.max_new_tokens"


def prompt_function(recipe) -> tuple[Callable[[Task], list[dict]], list | None]:
    """The environment's `prompt_messages` (what the gateway sends, system prompt included) and the
    tools it offers, or the task's own messages where the environment cannot be made here."""
    from factory.envs.base import make_environment, task_messages

    try:
        env = make_environment(recipe.environment)
    except Exception:  # an environment of the user's own may need its run's processes
        return task_messages, None
    return env.prompt_messages, getattr(env, "tools", None)


def prompt_lengths(tokenizer, prompt: Callable[[Task], list[dict]], tasks: list[Task],
                   tools: list | None = None) -> list[int]:
    return [len(ids) for ids in encode_chats(tokenizer, [prompt(t) for t in tasks], tools)]


@dataclass
class PromptLengths:
    """The prompt length of each task in tokens, against `limit` = max_model_len - max_new_tokens."""

    tasks: list[Task]
    lengths: list[int]
    max_model_len: int
    max_new_tokens: int

    @property
    def limit(self) -> int:
        return self.max_model_len - self.max_new_tokens

    @property
    def overlong(self) -> list[int]:
        """Indices of the tasks whose prompt is longer than the limit."""
        return [i for i, n in enumerate(self.lengths) if n > self.limit]

    def percentile(self, q: float) -> int:
        """Nearest-rank percentile: the smallest length at least a share q of the prompts do not exceed."""
        ordered = sorted(self.lengths)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    def summary(self) -> str:
        return (f"prompt tokens: median {self.percentile(0.5)}, p95 {self.percentile(0.95)}, "
                f"max {max(self.lengths)} (limit {self.max_model_len} - {self.max_new_tokens} = {self.limit}: "
                f"{LIMIT_FIELDS})")

    def error(self) -> str:
        """The one line refusing the overlong prompts (data.overlong: error)."""
        longest = max(self.overlong, key=lambda i: self.lengths[i])
        return (f"data: {len(self.overlong)} of {len(self.tasks)} prompts are longer than {LIMIT_FIELDS} = "
                f"{self.limit} tokens (longest {self.lengths[longest]}: task {self.tasks[longest].task_id}); raise "
                "rollout.max_model_len, lower rollout.max_new_tokens, or set data.overlong: drop | truncate")


def measure(recipe, tokenizer, tasks: list[Task]) -> PromptLengths:
    prompt, tools = prompt_function(recipe)
    return PromptLengths(tasks, prompt_lengths(tokenizer, prompt, tasks, tools), recipe.rollout.max_model_len,
                         recipe.rollout.max_new_tokens)


def check_tokenizer(recipe, source):
    """The tokenizer a run of `recipe` will use: model.path's, the cached warm start's, or (not built
    yet) the one its warm start will build, on the same texts (`factory.training.base_policy._build_base_policy`)."""
    from factory.model.policy_cache import base_policy_path
    from factory.model.sft import tokenizer_texts
    from factory.model.tiny import build_tokenizer

    policy = base_policy_path(recipe)
    if policy is not None:
        return load_tokenizer(policy)
    prompt, _ = prompt_function(recipe)
    texts = tokenizer_texts(prompt, source.train[: recipe.model.sft_examples])
    with tempfile.TemporaryDirectory() as tmp:
        return build_tokenizer(texts, recipe.model.bpe_vocab_size, Path(tmp), recipe.model.architecture)


def fit_prompts(recipe, policy: Path, source) -> list[tuple[str, str]]:
    """At a run's start, with its policy's tokenizer: prompts longer than the limit raise a RecipeError
    (data.overlong: error), or leave `source.train` and `source.heldout` (drop: returned as (task id,
    why) for the lake), or have their user message cut from its start until they fit (truncate)."""
    tokenizer = load_tokenizer(policy)
    lengths = measure(recipe, tokenizer, [*source.train, *source.heldout])
    over = lengths.overlong
    if not over:
        return []
    mode = recipe.data.overlong
    if mode == "error":
        raise RecipeError([lengths.error()])
    n_train, limit = len(source.train), lengths.limit
    if mode == "drop":
        gone = set(over)
        source.train = [t for i, t in enumerate(source.train) if i not in gone]
        source.heldout = [t for i, t in enumerate(source.heldout, n_train) if i not in gone]
        log.warning("dropped %d of %d tasks whose prompts are longer than %s = %d tokens (data.overlong=drop)",
                    len(over), len(lengths.tasks), LIMIT_FIELDS, limit)
        return [(lengths.tasks[i].task_id, f"prompt of {lengths.lengths[i]} tokens is longer than {LIMIT_FIELDS} = "
                 f"{limit}") for i in over]
    prompt, tools = prompt_function(recipe)
    tasks = list(lengths.tasks)
    for i in over:
        tasks[i] = _truncated(tokenizer, prompt, tools, tasks[i], lengths.lengths[i], limit)
    source.train, source.heldout = tasks[:n_train], tasks[n_train:]
    log.warning("cut the user message of %d of %d tasks whose prompts were longer than %s = %d tokens, keeping "
                "its end (data.overlong=truncate)", len(over), len(tasks), LIMIT_FIELDS, limit)
    return []


def _truncated(tokenizer, prompt, tools, task: Task, length: int, limit: int) -> Task:
    """`task` with the text of its (last) user message cut from the start until its prompt fits `limit`: the
    end holds the question. Each try cuts the characters the excess tokens take at the text's mean rate."""
    messages = task.metadata.get("messages") or []
    users = [k for k, m in enumerate(messages) if m["role"] == "user" and isinstance(m.get("content"), str)]
    text = messages[users[-1]]["content"] if users else "" if messages else task.question

    def with_text(kept: str) -> Task:
        if not messages:
            return replace(task, question=kept)
        shortened = [dict(m) for m in messages]
        shortened[users[-1]]["content"] = kept
        return replace(task, metadata={**task.metadata, "messages": shortened})

    per_token = len(text) / max(1, len(tokenizer(text, add_special_tokens=False).input_ids))
    cut, shorter = 0, task
    while length > limit:
        if cut >= len(text):
            raise RecipeError([f"data.overlong: truncate cannot fit task {task.task_id}: its prompt is {length} "
                               f"tokens with no user text left, over {LIMIT_FIELDS} = {limit}"])
        cut = min(len(text), cut + max(1, math.ceil((length - limit) * per_token)))
        shorter = with_text(text[cut:])
        length = prompt_lengths(tokenizer, prompt, [shorter], tools)[0]
    return shorter
