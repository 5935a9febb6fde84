"""The base of every recipe section, and recipe fields whose values come from a core registry."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from factory.core.registry import Registry


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


def registered(registry: Registry) -> dict[str, Any]:
    """Field arguments for a name from `registry`: the JSON schema lists its entries (editors autocomplete
    them), read when the schema is built; pair with `registry.check` in a field validator."""
    def enum(schema: dict[str, Any]) -> None:
        schema["enum"] = registry.names()

    return {"json_schema_extra": enum}
