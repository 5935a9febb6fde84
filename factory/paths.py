"""Where runtime state lives: one git-ignored directory (default `<repo>/.state`, or $FACTORY_HOME)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def state_dir() -> Path:
    path = Path(os.environ.get("FACTORY_HOME", REPO_ROOT / ".state"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    return _sub("models")


def runs_dir() -> Path:
    return _sub("runs")


def cache_dir() -> Path:
    return _sub("cache")


def _sub(name: str) -> Path:
    path = state_dir() / name
    path.mkdir(parents=True, exist_ok=True)
    return path
