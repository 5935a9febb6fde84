"""Suite-wide: every test under tests/integration/ and tests/infra/ carries the `integration` marker
(it starts servers: vLLM, Ray, Dagster, Postgres…), as do modules that declare it themselves, so
`pytest -m "not integration"` (`make unit`) is the fast part of the suite."""

from __future__ import annotations

from pathlib import Path

import pytest

SERVER_DIRS = ("integration", "infra")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).parts
        if any(d in parts[-3:-1] for d in SERVER_DIRS):
            item.add_marker(pytest.mark.integration)
