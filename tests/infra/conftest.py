"""The production profile's stack (infra/stack.py), once per module: Postgres, s3rver, an MLflow
server, a Ray head, a Dagster code server, webserver and daemon, on free loopback ports, in a
temporary directory (never the user's infra/.env or state dir). Torn down at the end, checked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from infra.stack import free_port_settings, read_state, settings, write_env_file
from tests.integration.conftest import policy, recipe  # noqa: F401  (the session's cached tiny policy)

REPO = Path(__file__).resolve().parents[2]


class Stack:
    def __init__(self, root: Path):
        self.root = root
        self.env_file = root / ".env"
        self.dir = root / "stack"
        self.home = root / "home"  # FACTORY_HOME of the services and runs
        write_env_file(self.env_file, free_port_settings())
        self.values = settings(self.env_file)
        self.graphql = f"http://127.0.0.1:{self.values['FACTORY_DAGSTER_PORT']}/graphql"

    def env(self) -> dict[str, str]:
        """The environment of a client process of this stack: the profile switch and nothing else."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "DAGSTER_HOME")}
        return {**env, "FACTORY_PROFILE": "production", "FACTORY_ENV_FILE": str(self.env_file),
                "FACTORY_HOME": str(self.home), "HF_HUB_OFFLINE": "1"}

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "infra.stack", *args, "--env-file", str(self.env_file), "--dir", str(self.dir)]

    def command(self, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), cwd=REPO, env=self.env(), capture_output=True, text=True,
                              timeout=timeout)

    def state(self) -> dict:
        return read_state(self.dir) or {}

    def ports(self) -> list[int]:
        v = self.values
        return [int(v["FACTORY_PG_PORT"]), int(v["FACTORY_DAGSTER_PORT"]), int(v["FACTORY_DAGSTER_GRPC_PORT"]),
                *(int(v[k].rsplit(":", 1)[1]) for k in ("FACTORY_S3_ENDPOINT", "MLFLOW_TRACKING_URI", "RAY_ADDRESS"))]


def new_stack() -> Stack:
    # Postgres runs as the `postgres` account, which must enter the data dir's parents: pytest's
    # tmp dirs are 0700, so this one is made in /tmp and opened (only the stack's files are inside)
    root = Path(tempfile.mkdtemp(prefix="factory-stack-"))
    root.chmod(0o755)
    return Stack(root)


# The stack comes up in the background from the end of collection when the session holds this module's
# tests (tests/conftest.py calls `start_early`): `up` took 18-26 s of the test's set-up, and the suite's
# tests before this module (~30 s, one process: algo, assets, data, envs) leave a core idle meanwhile.
# FACTORY_TEST_EARLY_STACK=0 brings it up in the fixture instead.
_early: list[tuple[Stack, subprocess.Popen]] = []


def start_early() -> None:
    stack = new_stack()
    _early.append((stack, subprocess.Popen(stack.argv("up"), cwd=REPO, env=stack.env(), stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)))


def _up(early: tuple[Stack, subprocess.Popen] | None) -> tuple[Stack, subprocess.CompletedProcess]:
    if early is None:
        stack = new_stack()
        return stack, stack.command("up")
    stack, proc = early
    try:
        out, err = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return stack, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _down(stack: Stack) -> None:
    stack.command("down", timeout=200)
    shutil.rmtree(stack.root, ignore_errors=True)


def stop_early() -> None:
    """At the session's end: a stack started early that no test took (the session stopped before them)."""
    while _early:
        stack, _ = _up(_early.pop())
        _down(stack)


@pytest.fixture(scope="module")
def stack():
    stack, up = _up(_early.pop() if _early else None)
    try:
        assert up.returncode == 0, f"stack up failed:\n{up.stdout}\n{up.stderr}\n" + "".join(
            f"--- {log.name}\n{log.read_text()[-2000:]}" for log in sorted((stack.dir / "logs").glob("*.log")))
        yield stack
    finally:
        _down(stack)
