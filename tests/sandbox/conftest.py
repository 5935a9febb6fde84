"""Sandbox fixtures: one sandbox per backend for the session, and a check that a test left nothing behind.

Docker tests never skip in CI: with CI set, an unavailable backend fails the test instead.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import pytest

from factory.sandbox import SandboxUnavailable, make_sandbox
from factory.sandbox.base import SANDBOX_UID
from factory.sandbox.bubblewrap import BubblewrapSandbox
from factory.sandbox.images import load_spec

# bubblewrap-hostfs: bubblewrap without a built image rootfs (read-only binds of the host's /usr, /lib, /etc subset)
BACKENDS = ["bubblewrap", "bubblewrap-hostfs", "docker"]
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")


def unavailable(backend: str, reason: str):
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{backend} sandbox unavailable in CI (run .ci/sandbox-setup.sh): {reason}")
    pytest.skip(f"{backend} sandbox unavailable here: {reason} (as root: bash .ci/sandbox-setup.sh)")


@pytest.fixture(scope="session")
def sandboxes():
    """Lazily made sandboxes by backend, closed at the end of the session."""
    made: dict = {}
    yield made
    for sandbox in made.values():
        if not isinstance(sandbox, str):
            sandbox.close()


@pytest.fixture(params=BACKENDS)
def sandbox(request, sandboxes):
    backend = request.param
    if backend not in sandboxes:
        try:
            if backend == "bubblewrap-hostfs":
                sandboxes[backend] = BubblewrapSandbox(rootfs=None, default_limits=load_spec("python").limits)
            else:
                sandboxes[backend] = make_sandbox(backend)
            if backend == "docker":
                asyncio.run(sandboxes[backend].warm(2))
        except SandboxUnavailable as err:
            sandboxes[backend] = str(err)
    if isinstance(sandboxes[backend], str):
        unavailable(backend, sandboxes[backend])
    return sandboxes[backend]


def nobody_processes() -> set[int]:
    """Live host pids whose real uid is the sandbox user's (sandboxed code of both backends runs as it).
    Zombies do not count: an exited bwrap helper is reparented to the host's init, which reaps it later."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
            except OSError:
                continue
            if int(status["Uid"].split()[0]) == SANDBOX_UID and not status["State"].strip().startswith("Z"):
                pids.add(int(entry.name))
    return pids


def container_of(pid: int) -> str | None:
    try:
        found = _CONTAINER_ID.search(Path(f"/proc/{pid}/cgroup").read_text())
    except OSError:
        return None
    return found.group(0) if found else None


def sandbox_cgroups() -> set[str]:
    return {str(p) for p in Path("/sys/fs/cgroup").glob("*/factory-sandbox/*") if p.is_dir()} | {
        str(p) for p in Path("/sys/fs/cgroup/factory-sandbox").glob("*") if p.is_dir()}


def leftovers(sandbox, baseline: set[int], cgroups_before: set[str]) -> list[str]:
    """What a finished run left behind: stray processes, busy warm containers, foreign containers, cgroups."""
    problems = []
    idle: dict[str, object] = {}
    if sandbox.name == "docker":
        sandbox.settle()
        idle = {w.id: w for w in sandbox.idle_workers()}
        for worker in idle.values():
            procs = set(worker.cgroup.procs()) if worker.cgroup else set()
            if procs != worker.base:
                problems.append(f"warm container {worker.id[:12]} runs {sorted(procs)}, want its init and keeper "
                                f"{sorted(worker.base)}")
        listed = {c.id for c in sandbox.containers()}
        if listed != set(idle):
            problems.append(f"containers {sorted(i[:12] for i in listed - set(idle))} exist but are not in the warm pool")
    for pid in nobody_processes() - baseline:
        container = container_of(pid)
        if container in idle or (container is not None and sandbox.name != "docker"):  # another backend's warm pool
            continue
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()[:80]
        except OSError:
            continue  # gone meanwhile
        problems.append(f"stray sandbox-user process {pid}: {command!r}")
    new_cgroups = sandbox_cgroups() - cgroups_before
    if new_cgroups:
        problems.append(f"cgroups left: {sorted(new_cgroups)}")
    return problems


@pytest.fixture
def clean_after(sandbox):
    """Assert the test left no process, container or cgroup behind (polls briefly: kills are async)."""
    baseline = {pid for pid in nobody_processes() if container_of(pid) is None}
    cgroups_before = sandbox_cgroups()
    yield
    deadline = time.monotonic() + 5
    while (problems := leftovers(sandbox, baseline, cgroups_before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not problems, problems
