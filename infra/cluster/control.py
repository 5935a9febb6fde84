"""The two-node cluster of netns.sh from Python, with its faults: what the two-node tests and
bench/partitions.py drive. Needs root (network namespaces).

    nodes = TwoNodes(home)            # node 1's state dir; node 2 sees none of it
    nodes.up()
    run = nodes.start_run(["factory", "run", ...], log)   # the driver on node 1, in the background
    run.wait_for_step(2)
    nodes.partition(30)               # the link between the nodes down for 30 s, then up
    nodes.kill_node2(); nodes.start_node2()
    nodes.down()
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "netns.sh"


class ClusterError(RuntimeError):
    """A netns.sh command failed (its output in the message)."""


class TwoNodes:
    """Two Ray nodes in two network namespaces on this machine: node 1 (`head`) and node 2 (`node2`).
    Names and addresses are derived from this process's pid unless given, so two sessions never share."""

    def __init__(self, home: Path, name: str | None = None, subnet: str | None = None):
        self.home = home
        self.name = name or f"fx{os.getpid() % 100000}"  # veth names: at most 15 characters
        self.subnet = subnet or f"10.250.{os.getpid() % 250}"
        self.head, self.node2 = f"{self.subnet}.1", f"{self.subnet}.2"
        self.ray_dir = tempfile.mkdtemp(prefix=f"{self.name}-")  # short: Ray's socket paths must fit in 107 bytes
        self.env = dict(os.environ, FACTORY_HOME=str(home), CLUSTER_NAME=self.name, CLUSTER_SUBNET=self.subnet,
                        CLUSTER_DIR=self.ray_dir, PYTHON=sys.executable)

    def script(self, *args: str, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(["bash", str(SCRIPT), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise ClusterError(f"netns.sh {' '.join(args)}: exit {done.returncode}\n{done.stdout}{done.stderr}")
        return done

    def up(self) -> str:
        return self.script("up").stdout

    def down(self) -> str:
        import shutil

        try:
            return self.script("down").stdout
        finally:
            shutil.rmtree(self.ray_dir, ignore_errors=True)

    def pids(self, node: str) -> list[int]:
        """The processes in `node`'s namespace ("head" or "node2")."""
        out = subprocess.run(["ip", "netns", "pids", f"{self.name}-{node}"], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def partition(self, seconds: float) -> None:
        self.script("partition", f"{seconds:g}", timeout=seconds + 60)

    def kill_node2(self) -> None:
        self.script("kill-node2")

    def start_node2(self) -> None:
        self.script("start-node2", timeout=120)

    def run(self, cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
        """`cmd` as the driver on node 1 (RAY_ADDRESS set), to its end."""
        return self.script("run", *cmd, timeout=timeout, check=False)

    def start_run(self, cmd: list[str], run_dir: Path, log: Path) -> BackgroundRun:
        """`cmd` as the driver on node 1, in the background (its output in `log`)."""
        with log.open("w") as out:
            proc = subprocess.Popen(["bash", str(SCRIPT), "run", *cmd], env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT)
        return BackgroundRun(proc, run_dir, log)


class BackgroundRun:
    """A `factory run` under way: its steps (the run dir's metrics.jsonl), its end, its results."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path, log: Path):
        self.proc, self.run_dir, self.log = proc, run_dir, log

    def steps(self) -> int:
        metrics = self.run_dir / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    def wait_for_step(self, step: int, timeout: float = 300) -> float:
        """Wait until the run has made `step` steps; returns when (monotonic). Raises if it ended first."""
        deadline = time.monotonic() + timeout
        while self.steps() < step:
            if self.proc.poll() is not None:
                raise ClusterError(f"the run ended (exit {self.proc.returncode}) before step {step}\n{self.tail()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"no step {step} within {timeout:g} s\n{self.tail()}")
            time.sleep(0.2)
        return time.monotonic()

    def finish(self, timeout: float = 420) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise ClusterError(f"the run did not end within {timeout:g} s\n{self.tail()}") from None

    def tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.is_file() else ""

    def results(self) -> dict:
        return json.loads((self.run_dir / "results.json").read_text())
