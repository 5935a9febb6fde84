"""The thread budget: how many CPU threads the trainer and each rollout engine use.

`train.threads` and `rollout.cpus` take a number or `auto`. `auto` resolves on the node the process
runs on (its cores: the CPUs this process may run on, `os.sched_getaffinity`), from the run's
shape, by a rule fitted to what bench/thread_budget.py measured (bench/results/thread_budget.json):

- one core stays with the processes around generation (the engine's API server, the env workers,
  the driver: ~40% of all CPU per step on the tiny model, bench/step_anatomy.py). On 2 cores a
  second vLLM thread made steps slower at every η (they took that core);
- synchronous (η = 0): generation and training take turns, so the trainer takes every core (its
  step runs alone) and the engines share all but one;
- asynchronous (η ≥ 1): both sides run at once, so all but one core are split between the trainer
  and the engines, at least one thread each.

Only 2-core machines were measured (all this project has); past that the rule extrapolates.

Whether the trainer and the engines share a node follows the recipe's placement: with neither
`placement.trainer` nor `placement.engine` set every role may land together (a local Ray has one
node), so they split; with either set, each role is taken to own its node. On GPU nodes the
threads only drive the host side (the CUDA path is untested here: no GPU).
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import BeforeValidator


def _thread_setting(value):
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    if isinstance(value, str) and value.isdigit() and int(value) > 0:
        return int(value)
    raise ValueError(f"a thread count must be a whole number > 0 or 'auto', got {value!r}")


Threads = Annotated[int | Literal["auto"], BeforeValidator(_thread_setting)]


def available_cores() -> int:
    """The CPUs this process may run on (its affinity, which containers and `taskset` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_split(cores: int, engines: int, max_staleness: int, shared: bool = True) -> tuple[int, int]:
    """(trainer threads, threads per engine) for `engines` engines on a node of `cores` cores.

    `shared`: the trainer and the engines share this node; otherwise each gets its node's cores.
    One core is left to the processes around the engine (its API server, the env workers, the
    driver: ~40% of the machine's CPU on the tiny model, bench/step_anatomy.py) while it generates,
    and the trainer takes every core while it trains alone (η = 0)."""
    cores, engines = max(1, cores), max(1, engines)
    if not shared:
        return cores, max(1, cores - 1)
    if max_staleness == 0:  # generation and training take turns
        return cores, max(1, (cores - 1) // engines)
    trainer = max(1, (cores - 1) // (engines + 1))
    return trainer, max(1, (cores - 1 - trainer) // engines)


# an actor built outside a run (a test, a benchmark) assumes the default recipe's shape
DEFAULT_SHAPE = {"engines": 1, "max_staleness": 1, "shared": True}


def resolve(setting: Threads, role: Literal["trainer", "engine"], shape: dict | None = None) -> int:
    """`setting` itself, or for `auto` this node's share for `role` (see the module docstring).

    `shape`: the run's `engines` (rollout.num_engines), `max_staleness` and `shared` (see shape_of);
    None: DEFAULT_SHAPE."""
    if setting != "auto":
        return int(setting)
    trainer, engine = thread_split(available_cores(), **(shape or DEFAULT_SHAPE))
    return trainer if role == "trainer" else engine


def shape_of(recipe, generating_only: bool = False) -> dict:
    """What the rule needs from a recipe, as plain values (actors get it without the whole recipe).
    `generating_only`: engines with no trainer beside them (an evaluation): they take the cores."""
    return {"engines": recipe.rollout.num_engines, "max_staleness": 0 if generating_only else recipe.async_.max_staleness,
            "shared": not (recipe.placement.trainer or recipe.placement.engine)}
