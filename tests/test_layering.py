"""The layering rules, read from the source (every import statement, function-level ones included):
Ray only in runtime/ and run.py; pure logic (algo/, buffer.py) imports no component; the recipe
(recipe/) imports none, not even in a function (it reads the core's registries); the
trainer and the scoring phase do not import each other."""

from __future__ import annotations

import ast
from pathlib import Path

from factory.paths import REPO_ROOT

FACTORY = REPO_ROOT / "factory"
# the parts that do work on their own: what pure logic must not reach into
COMPONENTS = ("factory.training.trainer", "factory.rollout", "factory.envs", "factory.sandbox", "factory.lake",
              "factory.recording.tracking", "factory.recording.recorder", "factory.runtime", "factory.run", "factory.training.scoring",
              "factory.model", "factory.data.heldout", "factory.cli", "factory.recording.replay")


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)


def reaches(found: set[str], prefixes: tuple[str, ...]) -> set[str]:
    return {m for m in found if any(m == p or m.startswith(p + ".") for p in prefixes)}


def test_only_the_runtime_and_the_loop_import_ray():
    allowed = ("factory.runtime", "factory.run")
    offenders = {module_name(p): reaches(imports(p), ("ray",)) for p in FACTORY.rglob("*.py")
                 if not reaches({module_name(p)}, allowed)}
    assert {m: found for m, found in offenders.items() if found} == {}


def test_pure_logic_imports_no_component():
    pure = [*(FACTORY / "algo").rglob("*.py"), FACTORY / "core" / "buffer.py"]
    offenders = {module_name(p): reaches(imports(p), COMPONENTS) for p in pure}
    assert {m: found for m, found in offenders.items() if found} == {}
    # the recipe reads factory.core.registries (the composition root fills them): no component, anywhere in it
    recipe = {module_name(p): reaches(imports(p), (*COMPONENTS, "factory.rewards", "factory.data", "factory.training",
                                                     "factory.recording", "importlib"))
              for p in [*(FACTORY / "recipe").rglob("*.py"), FACTORY / "core" / "registries.py"]}
    assert {m: found for m, found in recipe.items() if found} == {}


def test_the_trainer_and_the_scoring_phase_do_not_import_each_other():
    assert not reaches(imports(FACTORY / "training" / "trainer.py"), ("factory.training.scoring",))
    assert not reaches(imports(FACTORY / "training" / "scoring.py"), ("factory.training.trainer",))


def test_the_rules_see_a_violation(tmp_path):
    """The checker finds a function-level import (the way most of these would sneak in)."""
    planted = tmp_path / "m.py"
    planted.write_text("def f():\n    import ray\n    from factory.training.trainer import Trainer\n")
    assert reaches(imports(planted), ("ray",)) == {"ray"}
    assert reaches(imports(planted), COMPONENTS) == {"factory.training.trainer"}
    assert imports(planted, top_level_only=True) == set()
