"""Task sources over reasoning-gym, the repository's own task files and a user's files
(`factory.data.sources`), with seeded disjoint train/held-out splits, and a sampler whose position is
saved in checkpoints."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from functools import cached_property
from typing import Any
from collections.abc import Callable, Sequence

from factory.data.code_tasks import CODE_FAMILY, code_family_tasks
from factory.data.sources import FileTaskSource
from factory.core.types import Task

# Families that are not reasoning-gym datasets: name -> (config, split, seed) -> that split's tasks
LOCAL_FAMILIES: dict[str, Callable[[dict[str, Any], str, int], list[Task]]] = {CODE_FAMILY: code_family_tasks}


def _family_seed(seed: int, family: str, split: str) -> int:
    digest = hashlib.sha256(f"{seed}/{family}/{split}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def dataset_fingerprint(data_section, files: Sequence[FileTaskSource] | None = None) -> str:
    """12 hex digits naming the task set a recipe's `data` section makes (families, sizes, seed, and
    each file source's content digest: its options and every row, wherever the file lies): task ids
    such as `basic_arithmetic/train/0` are unique only within one such set. `files`: the section's
    sources already read (else they are read here)."""
    data = data_section.model_dump(mode="json")
    if data_section.sources:
        files = files if files is not None else file_sources(data_section)
        data["sources"] = [f.content_digest for f in files]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def file_sources(data_section) -> list[FileTaskSource]:
    return [FileTaskSource(spec, i) for i, spec in enumerate(data_section.sources)]


def _question_key(task: Task) -> str:
    return f"{task.family}\x00{task.question}"


@dataclass
class TaskFamilySpec:
    name: str
    config: dict[str, Any]
    weight: float = 1.0


class ReasoningGymSource:
    """A recipe's tasks: procedural ones from reasoning-gym families (and fixed sets named in
    LOCAL_FAMILIES), mixed by weight, then those of its file sources (`files`, each split its own way).

    The families' held-out split is generated from its own seed; their training split skips any
    question that also appears held-out, so the two are disjoint by construction.
    """

    def __init__(self, families: list[TaskFamilySpec], train_size: int, heldout_size: int, seed: int = 0,
                 files: Sequence[FileTaskSource] = ()):
        if not families and not files:
            raise ValueError("data.families: give at least one task family (or data.sources)")
        self.families = families
        self.train_size = train_size
        self.heldout_size = heldout_size
        self.seed = seed
        self.files = list(files)

    @classmethod
    def from_recipe(cls, data_section) -> ReasoningGymSource:
        specs = [TaskFamilySpec(f.name, dict(f.config), f.weight) for f in data_section.families]
        return cls(specs, data_section.train_size, data_section.heldout_size, data_section.seed,
                   file_sources(data_section))

    def _dataset(self, spec: TaskFamilySpec, split: str, size: int):
        import reasoning_gym

        cfg = dict(spec.config)
        if "operators" in cfg and isinstance(cfg["operators"], list):
            cfg["operators"] = tuple(cfg["operators"])
        try:
            return reasoning_gym.create_dataset(
                spec.name, size=size, seed=_family_seed(self.seed, spec.name, split), **cfg
            )
        except Exception as err:  # reasoning-gym raises a mix of KeyError/TypeError/ValueError
            raise ValueError(f"data.families: cannot build {spec.name!r} with {cfg}: {err}") from None

    def family_sizes(self, total: int) -> list[int]:
        """How many of `total` questions each family is asked for (by weight)."""
        if not self.families:
            return []
        weights = [f.weight for f in self.families]
        sizes = [int(total * w / sum(weights)) for w in weights]
        sizes[0] += total - sum(sizes)
        return sizes

    def _candidates(self, spec: TaskFamilySpec, split: str, size: int):
        if spec.name in LOCAL_FAMILIES:
            yield from LOCAL_FAMILIES[spec.name](dict(spec.config), split, self.seed)
            return
        # over-generate: duplicates and held-out questions are skipped below
        for i, entry in enumerate(self._dataset(spec, split, size * 3 + 64)):
            yield Task(task_id=f"{spec.name}/{split}/{i}", family=spec.name, question=entry["question"],
                       answer=str(entry["answer"]), metadata={"rg_entry": entry})

    def _generate(self, split: str, total: int, exclude: set[str]) -> list[Task]:
        tasks: list[Task] = []
        for spec, size in zip(self.families, self.family_sizes(total)):
            # each split holds unique questions (a small family may hold fewer than asked for)
            n = 0
            for task in self._candidates(spec, split, size):
                if _question_key(task) in exclude:
                    continue
                exclude.add(_question_key(task))
                tasks.append(task)
                n += 1
                if n == size:
                    break
        return tasks

    @cached_property
    def heldout(self) -> list[Task]:
        return self._generate("heldout", self.heldout_size, exclude=set()) + [t for f in self.files for t in f.heldout]

    @cached_property
    def train(self) -> list[Task]:
        exclude = {_question_key(t) for t in self.heldout}
        return self._generate("train", self.train_size, exclude) + [t for f in self.files for t in f.train]


def seeded_subset(tasks: list[Task], n: int | None, seed: int) -> list[Task]:
    """`n` tasks drawn uniformly without replacement by a seeded shuffle (all of them when `n` is None
    or at least their number): the same tasks for the same seed, in every process and run.

    Never a prefix: a split is generated family by family, and within a family the small, easy
    questions run out first (each question is kept once), so the first n are a different mix.
    A smaller n's subset is contained in a larger one's (both are prefixes of one permutation)."""
    if n is None or n >= len(tasks):
        return list(tasks)
    order = list(range(len(tasks)))
    random.Random(f"eval-subset/{seed}").shuffle(order)
    return [tasks[i] for i in order[:n]]


class TaskSampler:
    """Cycles through tasks in a seeded shuffled order; `state_dict` is its exact position."""

    def __init__(self, tasks: list[Task], seed: int = 0):
        if not tasks:
            raise ValueError("task sampler needs at least one task")
        self.tasks = tasks
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> Task:
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._shuffle(self.epoch)
        task = self.tasks[self._order[self.position]]
        self.position += 1
        return task

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._shuffle(self.epoch)
