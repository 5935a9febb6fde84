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


class Locked(RuntimeError):
    """`exclusive(..., wait=False)` found the lock held; `holder`: the pid it wrote, or "?"."""

    def __init__(self, lock_path: Path, holder: str):
        super().__init__(f"{lock_path} is held by pid {holder}")
        self.holder = holder


@contextmanager
def exclusive(lock_path: Path, wait: bool = True, on_wait=None):
    """Hold an exclusive lock on `lock_path` (created if missing, the holder's pid written in it) while
    the block runs. `wait`: take turns (processes that would build the same thing under the state dir,
    a sweep's runs or two test sessions, wait and then find it built); else raise `Locked` at once (two
    processes must never train into one run). `on_wait(holder_pid)` is called once if the lock is held
    when asked for (say who is being waited for). An advisory `flock`: released if the holder dies."""
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            if not wait:
                raise Locked(lock_path, holder) from None
            if on_wait is not None:
                on_wait(holder)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
