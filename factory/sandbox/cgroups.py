"""Per-sandbox cgroups (v1 or v2): memory, process-count and CPU limits, usage, and kill-everything.

v1 (this project's hosts): one directory per controller under `/sys/fs/cgroup/<controller>/factory-sandbox/`.
v2: one directory under `/sys/fs/cgroup/factory-sandbox/` with the memory, pids and cpu controllers
enabled for it. `Cgroup.of_pid` gives a read/kill view of a group someone else made (a Docker
container's), found through `/proc/<pid>/cgroup`.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PARENT = "factory-sandbox"
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")
V2_CONTROLLERS = ("memory", "pids", "cpu")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError, OSError):
        return ""


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


def _keyed(text: str, key: str) -> int:
    """The value of `key` in a 'key value' file (memory.events, cpu.stat, memory.oom_control)."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


@functools.lru_cache(maxsize=1)
def _v1_hierarchies() -> tuple[tuple[tuple[str, ...], Path], ...]:
    """The v1 hierarchies holding our controllers, each once (cpu and cpuacct are often co-mounted)."""
    by_real: dict[Path, list[str]] = {}
    for ctrl in V1_CONTROLLERS:
        if (ROOT / ctrl).is_dir():
            by_real.setdefault((ROOT / ctrl).resolve(), []).append(ctrl)
    return tuple((tuple(ctrls), ROOT / ctrls[0]) for ctrls in by_real.values())


def detect() -> tuple[str | None, str]:
    """Which cgroup version can hold sandboxes here ("v1", "v2" or None) and, if None, why not."""
    if os.geteuid() != 0:
        return None, "not root: cannot create cgroups"
    if (ROOT / "memory" / "memory.limit_in_bytes").exists() and (ROOT / "pids").is_dir():
        try:
            for _, base in _v1_hierarchies():
                (base / PARENT).mkdir(exist_ok=True)
            return "v1", ""
        except OSError as err:
            return None, f"cgroup v1 not writable: {err}"
    if (ROOT / "cgroup.controllers").exists():
        available = _read(ROOT / "cgroup.controllers").split()
        missing = [c for c in V2_CONTROLLERS if c not in available]
        if missing:
            return None, f"cgroup v2 lacks controllers {missing}"
        try:
            _write(ROOT / "cgroup.subtree_control", " ".join(f"+{c}" for c in V2_CONTROLLERS))
            (ROOT / PARENT).mkdir(exist_ok=True)
            if not _write(ROOT / PARENT / "cgroup.subtree_control", " ".join(f"+{c}" for c in V2_CONTROLLERS)):
                return None, "cgroup v2: cannot enable memory/pids/cpu for /sys/fs/cgroup/factory-sandbox"
            return "v2", ""
        except OSError as err:
            return None, f"cgroup v2 not writable: {err}"
    return None, "no cgroup filesystem at /sys/fs/cgroup"


@dataclass
class Cgroup:
    """One sandbox's cgroup: a directory per v1 controller (`dirs`), or the single v2 directory."""

    version: str
    dirs: dict[str, Path]
    owned: bool = True

    # -- making and removing -------------------------------------------------------------------
    @classmethod
    def create(cls, version: str, name: str, memory_mb: int, pids: int, cpus: float) -> Cgroup:
        """A fresh group with its limits set (memory without swap, pids.max, a CFS quota of `cpus`)."""
        period = 100_000
        quota = max(1000, int(cpus * period))
        limit = str(memory_mb * 1024 * 1024)
        if version == "v1":
            dirs: dict[str, Path] = {}
            for ctrls, base in _v1_hierarchies():
                path = base / PARENT / name
                path.mkdir()
                dirs.update((ctrl, path) for ctrl in ctrls)
            group = cls("v1", dirs)
            _write(dirs["memory"] / "memory.limit_in_bytes", limit)
            _write(dirs["memory"] / "memory.memsw.limit_in_bytes", limit)  # absent without swap accounting
            _write(dirs["pids"] / "pids.max", str(pids))
            if "cpu" in dirs:
                _write(dirs["cpu"] / "cpu.cfs_period_us", str(period))
                _write(dirs["cpu"] / "cpu.cfs_quota_us", str(quota))
            return group
        path = ROOT / PARENT / name
        path.mkdir()
        _write(path / "memory.max", limit)
        _write(path / "memory.swap.max", "0")
        _write(path / "pids.max", str(pids))
        _write(path / "cpu.max", f"{quota} {period}")
        return cls("v2", {"": path})

    @classmethod
    def of_pid(cls, pid: int) -> Cgroup | None:
        """A read/kill view of the groups process `pid` is in (None when not visible from here)."""
        text = _read(Path(f"/proc/{pid}/cgroup"))
        if not text:
            return None
        dirs: dict[str, Path] = {}
        for line in text.splitlines():
            _, ctrls, rel = line.split(":", 2)
            for ctrl in ctrls.split(","):
                if ctrl in V1_CONTROLLERS and (ROOT / ctrl / rel.lstrip("/")).is_dir():
                    dirs[ctrl] = ROOT / ctrl / rel.lstrip("/")
            if ctrls == "" and "memory" not in dirs and (ROOT / "cgroup.controllers").exists():
                return cls("v2", {"": ROOT / rel.lstrip("/")}, owned=False)
        return cls("v1", dirs, owned=False) if "pids" in dirs else None

    def _unique_dirs(self) -> list[Path]:
        return list(dict.fromkeys(self.dirs.values()))  # co-mounted controllers share one directory

    def procs_files(self) -> list[Path]:
        """The `cgroup.procs` files a process writes its pid into to join this group."""
        return [path / "cgroup.procs" for path in self._unique_dirs()]

    def remove(self, timeout_s: float = 2.0) -> bool:
        """Kill whatever is left, then delete the directories; False if something would not die."""
        deadline = time.monotonic() + timeout_s
        while self.procs():
            self.kill_all()
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        ok = True
        for path in self._unique_dirs():
            for _ in range(200):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.002)  # a dying task can still be listed for a moment
            else:
                ok = False
        return ok

    # -- reading -------------------------------------------------------------------------------
    def _dir(self, ctrl: str) -> Path | None:
        return self.dirs.get("") or self.dirs.get(ctrl)

    def procs(self) -> list[int]:
        path = self._dir("pids")
        return [int(p) for p in _read(path / "cgroup.procs").split()] if path else []

    def cpu_seconds(self) -> float | None:
        if self.version == "v2":
            text = _read(self.dirs[""] / "cpu.stat")
            return _keyed(text, "usage_usec") / 1e6 if text else None
        path = self._dir("cpuacct")
        text = _read(path / "cpuacct.usage").strip() if path else ""
        return int(text) / 1e9 if text else None

    def oom_kills(self) -> int:
        path = self._dir("memory")
        if path is None:
            return 0
        if self.version == "v2":
            return _keyed(_read(path / "memory.events"), "oom_kill")
        return _keyed(_read(path / "memory.oom_control"), "oom_kill")

    def pids_hits(self) -> int:
        """How often a fork was refused because the group was at pids.max."""
        path = self._dir("pids")
        return _keyed(_read(path / "pids.events"), "max") if path else 0

    # -- killing -------------------------------------------------------------------------------
    def kill_all(self, spare: frozenset[int] | set[int] = frozenset()) -> None:
        """SIGKILL every process in the group but `spare`, with the group frozen so none can fork
        in between (v2 `cgroup.kill` when nothing is spared)."""
        if self.version == "v2" and not spare and _write(self.dirs[""] / "cgroup.kill", "1"):
            return
        freezer = self.dirs[""] / "cgroup.freeze" if self.version == "v2" else (
            self.dirs["freezer"] / "freezer.state" if "freezer" in self.dirs else None)
        frozen = freezer is not None and _write(freezer, "1" if self.version == "v2" else "FROZEN")
        try:
            for pid in self.procs():
                if pid not in spare:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        finally:
            if frozen and freezer is not None:
                _write(freezer, "0" if self.version == "v2" else "THAWED")
