"""Where runtime state lives: one git-ignored directory (default `<repo>/.state`, or $FACTORY_HOME)."""

from __future__ import annotations

import os
from contextlib import contextmanager
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


@contextmanager
def exclusive(lock_path: Path):
    """Hold an exclusive lock on `lock_path` (created if missing) while the block runs: processes that
    would build the same thing under the state dir (a sweep's runs, parallel test workers) take turns,
    and the later ones find it built. An advisory `flock`: it is released if the holder dies."""
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
