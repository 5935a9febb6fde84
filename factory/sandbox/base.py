"""The sandbox protocol: a Program run under Limits gives a Result; backends implement `Sandbox`.

Everything here is standard library only, so the image builder can import it before the project's
venv exists (`.ci/sandbox-setup.sh` runs on a bare machine).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import threading
import time
import uuid
from abc import ABC, abstractmethod
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Literal, TypeVar, get_args
from collections.abc import Callable, Coroutine

Reason = Literal["ok", "exit_nonzero", "timeout", "cpu", "memory", "pids", "output_limit", "killed"]
REASONS: tuple[str, ...] = get_args(Reason)

POLL_S = 0.05  # how often the CPU budget is checked while a program runs
SANDBOX_UID = 65534  # nobody: never the host's root, in either backend
WORKDIR = "/work"  # the program's files and its working directory, in every backend
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKDIR,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",  # no __pycache__ litter in the work dir
}


class SandboxUnavailable(RuntimeError):
    """A backend cannot run here (tool missing, engine down, image not built); the message says what to do."""


@dataclass(frozen=True)
class Program:
    """What to run: files written into the work dir (relative paths), the command, and its stdin."""

    files: dict[str, str | bytes] = field(default_factory=dict)
    command: list[str] = field(default_factory=lambda: ["python3", "main.py"])
    stdin: bytes | None = None
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def python(cls, source: str, stdin: bytes | str | None = None, **files: str | bytes) -> Program:
        """A Python script as `main.py`, run with `python3 main.py`."""
        data = stdin.encode() if isinstance(stdin, str) else stdin
        return cls(files={"main.py": source, **files}, command=["python3", "main.py"], stdin=data)


@dataclass(frozen=True)
class Limits:
    """Bounds on one run. `memory_mb` covers the program's processes and its tmpfs /tmp and /dev/shm
    (no swap); `pids` counts its processes; `cpu_s` is total CPU time over all of them (None: no
    budget beyond what `wall_s` × `cpus` allows); `cpus` caps the CPU rate; `output_bytes` caps stdout
    and stderr each (and any single file the program writes). `network=True` gives the program the
    host's network (bubblewrap) or Docker's bridge: only for trusted code."""

    wall_s: float = 10.0
    cpu_s: float | None = None
    memory_mb: int = 256
    pids: int = 64
    output_bytes: int = 64 * 1024
    network: bool = False
    cpus: float = 1.0

    def __post_init__(self) -> None:
        for name in ("wall_s", "memory_mb", "pids", "output_bytes", "cpus"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.cpu_s is not None and not self.cpu_s > 0:
            raise ValueError(f"Limits.cpu_s must be > 0 or None, got {self.cpu_s!r}")

    def merged(self, **overrides) -> Limits:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class Result:
    """How a run ended. `exit_code` follows the shell convention (128 + n when killed by signal n);
    `reason` says why it stopped, most specific first: memory, pids, timeout, cpu, output_limit,
    killed, exit_nonzero, ok."""

    exit_code: int | None
    stdout: str
    stderr: str
    reason: Reason
    wall_s: float
    cpu_s: float | None = None
    truncated: bool = False
    backend: str = ""

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def decide_reason(*, exit_code: int | None, oom_kills: int = 0, pids_hits: int = 0, timed_out: bool = False,
                  cpu_exceeded: bool = False, truncated: bool = False) -> Reason:
    """One precedence for every backend: a limit that was hit explains the end better than the status."""
    if oom_kills:
        return "memory"
    if pids_hits and exit_code != 0:
        return "pids"
    if timed_out:
        return "timeout"
    if cpu_exceeded:
        return "cpu"
    if truncated:
        return "output_limit"
    if exit_code is None or exit_code > 128:
        return "killed"
    return "ok" if exit_code == 0 else "exit_nonzero"


async def watch_limits(done: asyncio.Future, deadline: float, cpu_s: float | None,
                       cpu_used: Callable[[], float | None] | None) -> tuple[bool, bool]:
    """Wait for `done` until `deadline` (time.monotonic), polling `cpu_used` against the budget `cpu_s`
    when both are given. Returns (timed out, CPU budget exceeded); on either, `done` is still pending."""
    while not done.done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return True, False
        if cpu_s is None or cpu_used is None:
            await asyncio.wait([done], timeout=remaining)
            continue
        await asyncio.wait([done], timeout=min(remaining, POLL_S))
        if not done.done() and (cpu_used() or 0) >= cpu_s:
            return False, True
    return False, False


def safe_relpath(name: str) -> PurePosixPath:
    """A Program file name as a path inside the work dir; refuses absolute paths and `..`."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or path == PurePosixPath("."):
        raise ValueError(f"Program.files: {name!r} must be a relative path inside the work dir")
    return path


def write_files(workdir: Path, files: dict[str, str | bytes], uid: int = SANDBOX_UID) -> None:
    """Write a Program's files under an empty `workdir` (root-owned, readable by the sandbox user).
    Never follows a link and never overwrites: the work dir may have been the sandbox's before."""
    for name, content in files.items():
        rel = safe_relpath(name)
        parent = workdir
        for part in rel.parts[:-1]:
            parent = parent / part
            if not parent.is_dir() or parent.is_symlink():
                parent.mkdir()
                os.chown(parent, uid, uid)  # the program may add files beside its own
        fd = os.open(parent / rel.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(content.encode() if isinstance(content, str) else content)


def fresh_workdir(path: Path, uid: int = SANDBOX_UID) -> Path:
    """Make `path` an empty directory the sandbox user can write, keeping the directory itself (it may
    be a bind mount's source, whose inode a running container holds)."""
    path.mkdir(parents=True, exist_ok=True)
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    os.chown(path, uid, uid)
    path.chmod(0o755)
    return path


def read_capped(path: Path, cap: int) -> tuple[str, bool]:
    """At most `cap` bytes of a captured stream, decoded (invalid UTF-8 replaced), and whether it was cut.
    Refuses links: a sandbox must not make the host read a file for it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, OSError):
        return "", False
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "", False
        data = handle.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def scratch_root() -> Path:
    """A new host directory for one sandbox's work dirs: memory-backed /dev/shm when there (fast, and
    charged to the writing sandbox's memory cgroup), else the temp dir."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    for stale in base.glob("factory-sandbox-*-*"):  # left by a process that was killed
        pid = stale.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)
    root = base / f"factory-sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o711)
    return root


T = TypeVar("T")
_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def run_blocking(coro: Coroutine[object, object, T]) -> T:
    """Run a coroutine to completion from synchronous code, on one shared background event loop (so
    loop-bound state such as a pool's semaphore is shared by all synchronous callers)."""
    global _loop
    if _loop is not None and threading.current_thread().name == "factory-sandbox-loop":
        raise RuntimeError("run_sync called from inside the sandbox event loop: use `await sandbox.run(...)`")
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="factory-sandbox-loop", daemon=True).start()
    future: Future[T] = asyncio.run_coroutine_threadsafe(coro, _loop)
    try:
        while not future.done():
            wait([future], timeout=0.1)  # wake up now and then: signals (Ctrl-C, test timeouts) get handled
    except BaseException:
        future.cancel()
        raise
    return future.result()


class Sandbox(ABC):
    """Runs untrusted programs in isolation. Subclasses: `BubblewrapSandbox`, `DockerSandbox`."""

    name: str = "sandbox"

    def __init__(self, default_limits: Limits | None = None) -> None:
        self.default_limits = default_limits or Limits()

    @abstractmethod
    async def run(self, program: Program, limits: Limits | None = None) -> Result:
        """Run `program` under `limits` (default: this sandbox's `default_limits`)."""

    def run_sync(self, program: Program, limits: Limits | None = None) -> Result:
        """`run` for synchronous callers."""
        return run_blocking(self.run(program, limits))

    async def warm(self, count: int, limits: Limits | None = None) -> None:
        """Start up to `count` reusable workers ahead of time, where the backend has any."""
        return None  # a backend without reusable workers has nothing to start

    async def aclose(self) -> None:
        self.close()

    @abstractmethod
    def close(self) -> None:
        """Stop everything this sandbox started (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
