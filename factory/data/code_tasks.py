"""Programming tasks with unit tests, read from JSONL in the common HumanEval-style shape.

One JSON object per line:

    prompt              the function's signature and docstring (plus any imports or helpers it needs)
    entry_point         the name of the function the tests call
    test                Python source defining `check(candidate)`, a sequence of asserts
    canonical_solution  a reference body that continues `prompt` (the SFT target, and what the tests
                        of this repository check passes)
    task_id             optional; defaults to `<file stem>/<line number>`

Other fields are kept in the task's metadata. The repository ships its own set
(`factory/data/code_tasks.jsonl`); a recipe selects it as the data family `code_tasks`, optionally
with `config: {path: other.jsonl, heldout_fraction: 0.25}`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from factory.core.types import Task

CODE_FAMILY = "code_tasks"
DEFAULT_PATH = Path(__file__).with_name("code_tasks.jsonl")
BROKEN_PATH = Path(__file__).with_name("code_tasks_broken.jsonl")  # a wrong body per task, for tests
REQUIRED = ("prompt", "entry_point", "test", "canonical_solution")
INSTRUCTION = "Complete this Python function. Reply with the whole function.\n\n"


def code_question(prompt: str) -> str:
    """What the model is asked: an instruction and the function to complete."""
    return INSTRUCTION + prompt


def load_code_tasks(path: str | Path = DEFAULT_PATH, family: str = CODE_FAMILY) -> list[Task]:
    """Tasks from a JSONL file of programming problems; a malformed line is a one-line ValueError
    naming the file, the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such code task file")
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: invalid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        for key in REQUIRED:
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise ValueError(f"{path}:{number}: field {key!r} must be a non-empty string")
        if not row["entry_point"].isidentifier():
            raise ValueError(f"{path}:{number}: entry_point {row['entry_point']!r} is not a Python name")
        if "def check(" not in row["test"]:
            raise ValueError(f"{path}:{number}: test must define check(candidate)")
        task_id = str(row.get("task_id") or f"{path.stem}/{number}")
        if task_id in seen:
            raise ValueError(f"{path}:{number}: duplicate task_id {task_id!r}")
        seen.add(task_id)
        metadata: dict[str, Any] = {k: v for k, v in row.items() if k != "task_id"}
        tasks.append(Task(task_id=task_id, family=family, question=code_question(row["prompt"]),
                          answer=reference_program(row), metadata=metadata))
    if not tasks:
        raise ValueError(f"{path}: holds no tasks")
    return tasks


def reference_program(row: dict[str, Any]) -> str:
    """The prompt completed by the reference body: the whole function a model should reply with."""
    return row["prompt"] + row["canonical_solution"]


def is_heldout(task_id: str, fraction: float, seed: int) -> bool:
    """A stable split by hash of the task id: the same task is held out for every run with this seed."""
    digest = hashlib.sha256(f"{seed}/{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


def code_family_tasks(config: dict[str, Any], split: str, seed: int, family: str = CODE_FAMILY) -> list[Task]:
    """One split of a code task file. `config`: `path` (default: the repository's set) and
    `heldout_fraction` (default 0.25)."""
    unknown = set(config) - {"path", "heldout_fraction"}
    if unknown:
        raise ValueError(f"data.families: {family}: unknown option(s) {sorted(unknown)}; "
                         "known: path, heldout_fraction")
    fraction = float(config.get("heldout_fraction", 0.25))
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"data.families: {family}: heldout_fraction must lie in (0, 1), got {fraction}")
    tasks = load_code_tasks(config.get("path") or DEFAULT_PATH, family)
    held = split == "heldout"
    return [t for t in tasks if is_heldout(t.task_id, fraction, seed) == held]
