"""The environment protocol: an agent program that plays one episode against an OpenAI endpoint.

An environment never sees token ids. It talks to the gateway with the `openai` client, and the
gateway records what was sampled; the environment only returns the reward of its episode.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Callable

from factory.core import registries
from factory.core.registry import Registry
from factory.core.types import Task


@dataclass
class EpisodeResult:
    reward: float
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    name: str

    def prompt_messages(self, task: Task) -> list[dict]:
        """The opening messages of an episode (also what the SFT warm start trains on)."""

    async def run_episode(self, client, model: str, task: Task, sampling: dict[str, Any]) -> EpisodeResult:
        """Play one episode through `client` (an `openai.AsyncOpenAI`) and score it."""

    # Optional `async score_reply(task, reply_text)`: a one-call, tool-less episode played in-process.
    # Optional `demonstration(task) -> list[dict] | None`: a synthetic episode the SFT warm start trains on.


ENVIRONMENTS: Registry[Callable[..., Environment]] = registries.ENVIRONMENTS


def register_environment(name: str):
    def wrap(factory: Callable[..., Environment]):
        return ENVIRONMENTS.register(name, factory)

    return wrap


def environment_factory(name: str) -> Callable[..., Environment]:
    """A registered environment, or `package.module:attr` (an environment of your own, imported by name in
    every process that plays episodes: it must be importable there, e.g. on PYTHONPATH)."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if ":" not in name:
        raise ValueError(f"unknown {name!r}; choose one of {sorted(ENVIRONMENTS)} or give module.path:attr")
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import {name!r} ({type(err).__name__}: {err})") from None


registries.VALIDATORS.register("environment", environment_factory)  # the recipe checks environment.name with it


def task_messages(task: Task) -> list[dict]:
    """A task's own messages: its chat messages when its source gave some (`metadata["messages"]`), else
    its question as the user's message. An environment puts its system prompt before them."""
    messages = task.metadata.get("messages")
    return [dict(m) for m in messages] if messages else [{"role": "user", "content": task.question}]


def make_environment(section) -> Environment:
    """Build the environment a recipe's `environment` section names."""
    return environment_factory(section.name)(section)
