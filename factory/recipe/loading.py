"""Reading a recipe: a YAML file or a dict, patched by dotted overrides (`train.lr=3e-4`), validated."""

from __future__ import annotations

import copy
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from factory.recipe.errors import RecipeError, _field_path, _format_errors, _show
from factory.recipe.schema import Recipe


_FLOAT_WITHOUT_DOT = re.compile(r"^[-+]?\d+[eE][-+]?\d+$")  # YAML 1.1 reads 3e-4 as a string


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", value parsed as YAML, so 3e-4, true, [1, 2] all work)."""
    if "=" not in text:
        raise RecipeError([f"override {text!r}: expected FIELD.PATH=VALUE, e.g. train.lr=3e-4"])
    path, raw = text.split("=", 1)
    if not path.strip():
        raise RecipeError([f"override {text!r}: empty field path before '='"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _FLOAT_WITHOUT_DOT.match(value.strip()):
        value = float(value)
    return path.strip(), value


_PATH_PART = re.compile(r"^([A-Za-z_]\w*)((?:\[\d+\])*)$")  # `families` or `families[0]` (or `m[0][1]`)


def _path_steps(path: str) -> list[str | int]:
    """'data.families[0].name' -> ['data', 'families', 0, 'name']."""
    steps: list[str | int] = []
    for part in path.split("."):
        match = _PATH_PART.match(part.strip())
        if not match:
            raise RecipeError([f"field path {path!r}: {part!r} is not a field name, optionally with [index], "
                               "e.g. data.families[0].name"])
        steps.append(match.group(1))
        steps.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    return steps


def _list_default(steps: list[str | int]) -> Any:
    """The default (as recipe data) of the list field at `steps`, None when that is not a recipe field."""
    model: Any = Recipe
    field = None
    for step in steps:
        if isinstance(step, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = next((f for n, f in model.model_fields.items() if step in (n, f.alias)), None)
        if field is None:
            return None
        annotation = field.annotation
        model = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else annotation
    default = field.get_default(call_default_factory=True) if field is not None else None
    if not isinstance(default, list):
        return None
    return [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in default]


def set_dotted(data: dict[str, Any], path: str, value: Any) -> None:
    """Set `path` (dotted fields, list items by index: `data.families[0].name`) in `data`, making the
    sections it passes through; an index must name an item the list already has."""
    steps = _path_steps(path)
    node: Any = data
    for i, (step, nxt) in enumerate(zip(steps, steps[1:])):
        where = _field_path(tuple(steps[: i + 1]))
        if isinstance(step, int):
            if not isinstance(node, list) or step >= len(node):
                size = f"has {len(node)} item(s)" if isinstance(node, list) else "is not a list"
                raise RecipeError([f"field path {path!r}: {_field_path(tuple(steps[:i]))} {size}; no item [{step}]"])
            child = node[step]
        else:
            child = node.get(step)
            if child is None:  # not in the file: a list starts from its default (data.families), a section empty
                child = node[step] = _list_default(steps[: i + 1]) if isinstance(nxt, int) else {}
        if isinstance(nxt, int) and not isinstance(child, list):
            raise RecipeError([f"field path {path!r}: {where} is not a list"])
        if isinstance(nxt, str) and not isinstance(child, dict):
            raise RecipeError([f"field path {path!r}: {where!r} holds a value, not a section of fields"])
        node = child
    last = steps[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or last >= len(node):
            raise RecipeError([f"field path {path!r}: {_field_path(tuple(steps[:-1]))} has no item [{last}]"])
    node[last] = value


def recipe_from_dict(data: Any, source: str = "<recipe>", overrides: Sequence[str] = ()) -> Recipe:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            [f"{source}: <root>: expected a mapping of sections (model:, train:, ...), got {_show(data)}"]
        )
    data = copy.deepcopy(data)
    overridden: dict[str, str] = {}
    for o in overrides:
        path, value = parse_override(o)
        try:
            set_dotted(data, path, value)
        except RecipeError as err:
            raise RecipeError([f"{source}: {line} (from override {o!r})" for line in err.problems]) from None
        overridden[path] = o
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_errors(source, err, overridden)) from None
    if recipe.sweep:  # every grid point is checked now, not when a sweep reaches it
        expand_sweep(recipe, source)
    return recipe


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read, patch and validate a recipe file. Raises RecipeError with one line per problem."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError([f"{p}: no such recipe file"])
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError([f"{p}: cannot read the file ({err})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "<root>"
        problem = str(getattr(err, "problem", None) or err).replace("\n", " ")
        raise RecipeError([f"{p}: {where}: invalid YAML ({problem})"]) from None
    if data is None:
        raise RecipeError([f"{p}: the file is empty{' (only comments)' if text.strip() else ''}; a recipe needs at "
                           "least one section, e.g. `name: my-run` (recipes/default.yaml shows them all)"])
    return recipe_from_dict(data, str(p), overrides)


from factory.recipe.sweeps import expand_sweep  # noqa: E402  (a sweep's points are recipes from recipe_from_dict)
