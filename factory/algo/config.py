"""Configs from recipe sections without a field list kept by hand: each algorithm config (a dataclass)
takes the section's fields of the same names, so a setting has one source, the recipe section."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

C = TypeVar("C")


def from_section(config: type[C], section: Any, **given: Any) -> C:
    """`config(**{every field of config that section has, by name}, **given)`; `given` wins (fields the
    section does not hold, e.g. `max_tokens` from the rollout section, or nested configs)."""
    names = {f.name for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    taken = {n: getattr(section, n) for n in names if n not in given and hasattr(section, n)}
    return config(**taken, **given)
