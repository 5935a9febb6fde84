"""Recipe errors a user can fix, and pydantic's validation errors as one plain line per problem:
`source: field.path: what to fix`."""

from __future__ import annotations

import difflib
import json
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from factory.recipe.schema import Recipe


class RecipeError(ValueError):
    """A recipe problem a user can fix; `str()` is one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


_PATH_IN_MESSAGE = re.compile(r"^([A-Za-z_][\w.\[\]]*): (.*)$")  # "algorithm.loss: unknown ..." from a validator


def _show(value: Any) -> str:
    """A short, one-line rendering of the value a user wrote."""
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _field_path(loc: tuple[Any, ...]) -> str:
    """('data', 'families', 0, 'name') -> 'data.families[0].name'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + ("async" if part == "async_" else str(part))
    return path or "<root>"


def _fields_of_parent(loc: tuple[Any, ...]) -> list[str]:
    """The field names allowed beside loc[-1] (empty if the parent is not a recipe section)."""
    model: type[BaseModel] = Recipe
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # a list item: stay on the list's item model
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if field is None:
            return []
        annotation = field.annotation
        if typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]
        annotation = next((a for a in typing.get_args(annotation) if a is not type(None)), annotation)  # X | None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [f.alias or n for n, f in model.model_fields.items()]


def _plain_message(e: ErrorDetails) -> str:
    """Pydantic's error in plain words: what is expected and what was written."""
    kind, ctx, got = e["type"], e.get("ctx", {}), _show(e.get("input"))
    if kind == "extra_forbidden":
        known = _fields_of_parent(e["loc"])
        close = difflib.get_close_matches(str(e["loc"][-1]), known, n=1)
        if close:
            return f"unknown field; did you mean {close[0]!r}?"
        return f"unknown field; known fields: {', '.join(known)}" if known else "unknown field"
    if kind == "missing":
        is_list_item = isinstance(e["loc"][-1], int)
        return "item missing; the list is too short" if is_list_item else "required but missing"
    if kind in ("int_parsing", "int_type"):
        return f"expected an integer, got {got}"
    if kind == "int_from_float":
        return f"expected a whole number, got {got}"
    if kind in ("float_parsing", "float_type"):
        return f"expected a number, got {got}"
    if kind in ("bool_parsing", "bool_type"):
        return f"expected true or false, got {got}"
    if kind == "string_type":
        return f"expected text, got {got}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"expected a section of `field: value` lines, got {got}"
    if kind in ("list_type", "tuple_type"):
        return f"expected a list, got {got}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}, got {got}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit}, got {got}"
    if kind == "too_short":
        return f"needs at least {ctx['min_length']} item(s), got {ctx['actual_length']}"
    if kind == "too_long":
        return f"takes at most {ctx['max_length']} item(s), got {ctx['actual_length']}"
    return e["msg"].removeprefix("Value error, ").removeprefix("Input should be ").replace("\n", " ")


def _format_errors(
    source: str, err: ValidationError, overrides: dict[str, str] | None = None
) -> list[str]:
    """One line per problem: `source: field.path: what to fix`.

    `overrides` maps an overridden dotted path to the override text; a problem at or below
    (or above) that path is tagged with it, since the file itself is not where the value came from.
    """
    lines = []
    for e in err.errors():
        path, msg = _field_path(e["loc"]), _plain_message(e)
        in_message = _PATH_IN_MESSAGE.match(msg)
        if in_message and path == "<root>":  # a model validator names its own field path
            path, msg = in_message.groups()
        elif in_message and re.split(r"[.\[]", in_message[1])[0] in _fields_of_parent((*e["loc"], "")):
            path, msg = f"{path}.{in_message[1]}", in_message[2]  # ... or one below its section
        dotted = path.replace("[", ".").replace("]", "")
        for target, text in (overrides or {}).items():
            target = target.replace("[", ".").replace("]", "")
            if dotted == target or dotted.startswith(target + ".") or target.startswith(dotted + "."):
                msg += f" (from override {text!r})"
                break
        lines.append(f"{source}: {path}: {msg}")
    return lines
