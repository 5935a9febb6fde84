"""Backend choice, one-line errors for missing backends, and Docker container lifecycle."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from factory.paths import REPO_ROOT
from factory.sandbox import Program, SandboxUnavailable, make_sandbox
from factory.sandbox.images import load_spec

from .conftest import unavailable

pytestmark = pytest.mark.timeout(60)


def test_unknown_backend_is_a_one_line_error():
    with pytest.raises(SandboxUnavailable, match="choose one of auto, bubblewrap, docker"):
        make_sandbox("firecracker")


def test_missing_bubblewrap_says_what_to_install(monkeypatch):
    import factory.sandbox.bubblewrap as bubblewrap

    monkeypatch.setattr(bubblewrap.shutil, "which", lambda *a, **k: None)
    with pytest.raises(SandboxUnavailable) as err:
        make_sandbox("bubblewrap")
    assert str(err.value) == "bwrap not found: apt-get install -y bubblewrap"


def test_missing_docker_engine_says_what_to_do(monkeypatch):
    import docker

    def no_engine(**kwargs):
        raise docker.errors.DockerException("connection refused")

    monkeypatch.setattr(docker, "from_env", no_engine)
    with pytest.raises(SandboxUnavailable, match="apt-get install -y docker.io") as err:
        make_sandbox("docker")
    assert "\n" not in str(err.value)
    # auto falls back to the daemon-less backend
    sandbox = make_sandbox("auto")
    try:
        assert sandbox.name == "bubblewrap"
    finally:
        sandbox.close()


def test_missing_image_is_a_one_line_error():
    with pytest.raises(SandboxUnavailable, match="no sandbox image named 'cobol'"):
        make_sandbox("bubblewrap", image="cobol")


def test_spec_limits_are_the_defaults():
    spec = load_spec("python")
    assert spec.language == "python" and "python3" in spec.packages
    assert spec.limits.memory_mb == 256 and spec.limits.network is False


def test_bubblewrap_reports_enforcement():
    sandbox = make_sandbox("bubblewrap")
    try:
        report = sandbox.enforcement()
    finally:
        sandbox.close()
    if os.geteuid() == 0 and sandbox.cgroup_version:
        assert report["memory"].startswith("cgroup") and report["user"] == "host uid 65534"
    else:
        assert "RLIMIT" in report["memory"]


def _docker_or_skip():
    try:
        return make_sandbox("docker")
    except SandboxUnavailable as err:
        unavailable("docker", str(err))


def test_docker_close_removes_every_container():
    sandbox = _docker_or_skip()
    import asyncio

    asyncio.run(sandbox.warm(2))
    result = sandbox.run_sync(Program.python("import time; time.sleep(30)"), sandbox.default_limits.merged(wall_s=0.5))
    assert result.reason == "timeout"
    assert len(sandbox.containers()) >= 1
    sandbox.close()
    assert sandbox.containers() == []


def test_docker_containers_of_a_killed_client_are_reaped():
    """Killing the client leaves its containers running; the next DockerSandbox removes them."""
    sandbox = _docker_or_skip()  # also proves the engine and image are there
    sandbox.close()
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import asyncio, os, signal
        from factory.sandbox import make_sandbox
        sandbox = make_sandbox("docker")
        asyncio.run(sandbox.warm(1))
        print(sandbox.owner, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    owner = child.stdout.readline().strip()
    child.wait(timeout=60)
    import docker

    client = docker.from_env()
    label = {"label": [f"factory.sandbox.owner={owner}"]}
    assert owner and len(client.containers.list(all=True, filters=label)) == 1  # orphaned, still there
    reaper = make_sandbox("docker")
    try:
        assert client.containers.list(all=True, filters=label) == []
    finally:
        reaper.close()



@pytest.mark.parametrize("cgroup_visible", [True, False])
def test_docker_replaces_warm_containers_that_died(cgroup_visible):
    """A warm container whose keeper died (killed outside, engine hiccup) is never handed a program."""
    sandbox = _docker_or_skip()
    import asyncio

    try:
        asyncio.run(sandbox.warm(2))
        for worker in sandbox.idle_workers():
            worker.container.kill()
            if not cgroup_visible:
                worker.cgroup = None  # as with a remote engine: the exec itself finds the container gone
        result = sandbox.run_sync(Program.python("print('fine')"))
        assert (result.reason, result.stdout) == ("ok", "fine\n"), result
    finally:
        sandbox.close()
    assert sandbox.containers() == []
