"""The layering rules of docs/ARCHITECTURE.md, read from the table itself and checked against every
import statement (function-level ones and `importlib.import_module("…")` strings included) of every
module in factory/ and assets/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from factory.paths import REPO_ROOT

ARCHITECTURE = REPO_ROOT / "docs" / "ARCHITECTURE.md"
CODE = [REPO_ROOT / "factory", REPO_ROOT / "assets"]
VENDORED = ("factory/rollout/sglang_cpu/",)  # a copy of SGLang's CPU kernels' wrapper, not ours


def layer_table(text: str) -> dict[str, tuple[list[str], set[str]]]:
    """layer -> (the paths its row names, the layers it may import), from the "Layers and rooms" table."""
    section = text.split("## Layers and rooms", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # after the header
    table = {}
    for row in rows:
        layer, rooms, allowed = (cell.strip() for cell in row.strip("|").split("|"))
        paths = re.findall(r"`((?:factory|assets)/[\w/.]*)`", rooms)
        table[layer] = (paths, {a.strip() for a in allowed.split(",")})
    return table


TABLE = layer_table(ARCHITECTURE.read_text())


def layer_of(rel: str) -> str | None:
    """The layer of a repository path like factory/training/trainer.py (the longest matching room)."""
    best = None
    for layer, (paths, _) in TABLE.items():
        for p in paths:
            if (rel == p or (p.endswith("/") and rel.startswith(p))) and (best is None or len(p) > len(best[1])):
                best = (layer, p)
    return best[0] if best else None


def module_path(module: str) -> str | None:
    """factory.training.trainer -> factory/training/trainer.py (or the package's __init__.py)."""
    base = REPO_ROOT / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(REPO_ROOT).as_posix()
    return None


def imports(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names if node.module.split(".")[0] == "factory"}
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def violations(rel: str, source: str) -> list[str]:
    """What the module at `rel` imports against its row of the table, one line each."""
    layer = layer_of(rel)
    if layer is None:
        return [f"{rel}: in no room of the table"]
    allowed = TABLE[layer][1]
    out = []
    for name in sorted(imports(source)):
        top = name.split(".")[0]
        if top == "ray" and not ({"ray", "everything"} & allowed):
            out.append(f"{rel} ({layer}) imports {name}")
        if top != "factory" or "everything" in allowed:
            continue
        target = module_path(name)
        if target is None:  # `from factory.x import name` where name is not a module
            continue
        theirs = layer_of(target)
        if theirs not in allowed:
            out.append(f"{rel} ({layer}) imports {name} ({theirs})")
    return out


def our_modules() -> list[Path]:
    return [p for root in CODE for p in sorted(root.rglob("*.py"))
            if not p.relative_to(REPO_ROOT).as_posix().startswith(VENDORED)]


def test_every_module_sits_in_a_room_of_the_table():
    unplaced = [p.relative_to(REPO_ROOT).as_posix() for p in our_modules()
                if layer_of(p.relative_to(REPO_ROOT).as_posix()) is None]
    assert unplaced == []


def test_every_import_follows_the_table():
    found = [v for p in our_modules() for v in violations(p.relative_to(REPO_ROOT).as_posix(), p.read_text())]
    assert found == []


def test_the_table_names_every_layer_it_allows():
    layers = set(TABLE) | {"ray", "everything"}
    assert {a for _, allowed in TABLE.values() for a in allowed} <= layers
    assert {"support", "core", "model", "components", "runtime", "orchestration"} <= set(TABLE)


def test_the_trainer_and_the_scoring_phase_do_not_import_each_other():
    trainer = (REPO_ROOT / "factory/training/trainer.py").read_text()
    scoring = (REPO_ROOT / "factory/training/scoring.py").read_text()
    assert not any(m.startswith("factory.training.scoring") for m in imports(trainer))
    assert not any(m.startswith("factory.training.trainer") for m in imports(scoring))


@pytest.mark.parametrize("planted, layer", [
    ("def f():\n    import ray\n", "core"),
    ("def f():\n    from factory.rollout.engines import ENGINES\n", "core"),
    ("import importlib\nR = importlib.import_module('factory.envs.base')\n", "core"),
    ("from factory.data import tasks\n", "model"),
    ("from factory.runtime import actors\n", "components"),
    ("import ray\n", "components"),
])
def test_the_rules_see_a_planted_violation(planted, layer):
    rel = {"core": "factory/core/planted.py", "model": "factory/model/planted.py",
           "components": "factory/rollout/planted.py"}[layer]
    assert layer_of(rel) == layer
    assert violations(rel, planted) != []
    assert violations(rel, "from factory.core.types import Sample\nfrom factory.support import threads\n") == []


def test_a_module_outside_every_room_is_seen():
    assert layer_of("factory/newroom/thing.py") is None
    assert layer_of("factory/loose.py") is None
