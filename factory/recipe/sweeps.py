"""A recipe's `sweep` section: its grid expanded to one validated recipe per point."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from factory.recipe.errors import RecipeError, _show
from factory.recipe.loading import recipe_from_dict, set_dotted
from factory.recipe.schema import Recipe


def expand_sweep(recipe: Recipe, source: str = "<recipe>") -> list[tuple[dict[str, Any], Recipe]]:
    """One (grid point, recipe) per element of the product of `sweep`'s value lists. A grid value that
    makes an invalid recipe is a RecipeError naming the point, one line per distinct problem."""
    if not recipe.sweep:
        return [({}, recipe)]
    base = recipe.dump()
    base["sweep"] = {}
    keys = list(recipe.sweep)
    out: list[tuple[dict[str, Any], Recipe]] = []
    problems: dict[str, str] = {}  # problem (without the point) -> its first line
    for values in itertools.product(*(recipe.sweep[k] for k in keys)):
        point = dict(zip(keys, values))
        where = f"{source}: sweep point {', '.join(f'{k}={_show(v)}' for k, v in point.items())}"
        data = copy.deepcopy(base)
        suffix = "-".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items())
        data["name"] = f"{recipe.name}-{suffix}"
        try:
            for k, v in point.items():
                set_dotted(data, k, v)
            out.append((point, recipe_from_dict(data, where)))
        except RecipeError as err:
            for line in err.problems:  # a bad value fails every point holding it: report it once
                problems.setdefault(line.removeprefix(where).removeprefix(": ").split(" (from", 1)[0],
                                    line if line.startswith(where) else f"{where}: {line}")
    if problems:
        raise RecipeError(list(problems.values()))
    return out
