"""A real SQLite-backed lake in a temp state dir for every test."""

from __future__ import annotations

import pytest

from factory.lake import open_catalog


@pytest.fixture
def catalog(tmp_path, monkeypatch):
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path))
    return open_catalog()
