"""A name -> thing table for the recipe's extension points: rollout engines, policy losses,
aggregations, advantage estimators, KL estimators, off-policy corrections, scorers, environments.

A registry refuses a second entry under a taken name (a plug-in silently replacing another is a
bug no test would see), and its unknown-name error lists what is there, so the recipe's one-line
errors and the JSON schema's allowed values (`names()`) both come from the entries themselves. It
reads like a dict (`name in R`, `R[name]`, `sorted(R)`); only `register` adds to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T]):
    def __init__(self, kind: str):
        self.kind = kind  # what an entry is, for messages: "rollout engine"
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice; pick another name")
        self._entries[name] = entry
        return entry

    def decorator(self, name: str) -> Callable[[T], T]:
        return lambda entry: self.register(name, entry)

    def __getitem__(self, name: str) -> T:
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of {self.names()}")
        return self._entries[name]

    def check(self, name: str) -> str:
        """`name` if registered, else ValueError listing the choices (for a recipe field validator)."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()}")
        return name

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
