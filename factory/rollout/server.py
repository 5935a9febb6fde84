"""What every inference server we start shares (vLLM, SGLang): a child process in its own process
group, a reaper that ends that group when its owner dies, a readiness wait on an HTTP health route,
the tail of its log for error messages, and a stop that ends the whole group.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from factory.rollout.zygote import ForkedProcess, ZygoteUnavailable, fork_server

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_response(resp: httpx.Response, what: str) -> None:
    """Raise a plain RuntimeError naming `what`, the status and the server's answer, for an HTTP error.
    (httpx's own error carries the request and response objects, which Ray cannot always carry back
    to the driver: it arrived there as "Failed to deserialize exception".)"""
    if not resp.is_success:
        raise RuntimeError(f"{what}: HTTP {resp.status_code} from {resp.request.url.path}: {resp.text.strip()[:400]}")


class EngineStartError(RuntimeError):
    pass


class EngineDead(RuntimeError):
    """A request failed because the engine behind a live API server died (vLLM's engine core: its
    server stays up and answers every request with EngineDeadError). The engine is lost like a killed
    one: its groups are re-queued and the run's supervisor restarts it."""


# an exception line of a Python traceback: "RuntimeError: ...", "torch.OutOfMemoryError: ..."
_EXCEPTION_LINE = re.compile(r"(?:^|\s)((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)(?::\s.*)?)$")
_NOT_THE_CAUSE = ("EngineDeadError", "EngineCore encountered an issue", "EngineGenerateError")


def root_cause_line(log_text: str) -> str | None:
    """The last exception line of a server log's tracebacks that is not the engine's death notice
    itself (what the API server answers says "see stack trace above"; the trace is in the log), e.g.
    "RuntimeError: CPU Generator does not use offset"; None when the log holds none."""
    found = None
    for line in log_text.splitlines():
        match = _EXCEPTION_LINE.search(line.rstrip())
        if match and not any(word in line for word in _NOT_THE_CAUSE):
            found = match.group(1).strip()
    return found


# Kills the server's process group once the process that started it is gone. Why: Ray SIGKILLs
# actor processes on shutdown or crash and also kills their direct children; vLLM's engine core
# and worker (and SGLang's scheduler and detokenizer) outlive their API server (seen here), holding
# GBs. So the reaper detaches (forks away from the actor, so Ray does not count it as a child) and
# polls the actor's pid; it also ends once the server group is gone (a normal stop).
_GROUP_REAPER = (
    "import os, signal, sys, time\n"
    "pgid, owner = int(sys.argv[1]), int(sys.argv[2])\n"
    "if os.fork():\n"
    "    os._exit(0)\n"
    "def alive(pid):\n"
    "    try:\n"
    "        with open(f'/proc/{pid}/stat') as f:\n"
    "            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'\n"
    "    except OSError:\n"
    "        return False\n"
    "def group_alive():\n"
    "    try:\n"
    "        os.killpg(pgid, 0)\n"
    "        return True\n"
    "    except ProcessLookupError:\n"
    "        return False\n"
    "while alive(owner) and group_alive():\n"
    "    time.sleep(1)\n"
    "if group_alive():\n"
    "    os.killpg(pgid, signal.SIGKILL)\n"
)


def owned_servers(owner_pid: int) -> list[int]:
    """The pids of the live servers a process started (`ServerProcess.launch`), found through their reapers'
    arguments (server pid, owner pid): a server forked by the zygote is not its owner's child."""
    return _servers_by_owner().get(owner_pid, [])


def _servers_by_owner() -> dict[int, list[int]]:
    import psutil

    found: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if len(cmd) >= 6 and cmd[1:4] == ["-S", "-c", _GROUP_REAPER]:
            try:
                if psutil.Process(int(cmd[4])).status() != psutil.STATUS_ZOMBIE:
                    found.setdefault(int(cmd[5]), []).append(int(cmd[4]))
            except psutil.NoSuchProcess:
                continue
    return found


def process_tree(root_pid: int) -> list:
    """`root_pid`'s process, its descendants, and the servers any of them started with their own
    descendants (psutil.Process objects): the processes a job's CPU and memory live in, now that a
    forked server is the zygote's child, not its owner's."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        tree = {p.pid: p for p in [root, *root.children(recursive=True)]}
    except psutil.NoSuchProcess:
        return []
    by_owner = _servers_by_owner()
    for owner in list(tree):
        for server in by_owner.get(owner, []):
            if server in tree:
                continue
            try:
                top = psutil.Process(server)
                tree.update({p.pid: p for p in [top, *top.children(recursive=True)]})
            except psutil.NoSuchProcess:
                continue
    return list(tree.values())


class ServerProcess:
    """One server process (`args`, `env`) answering at `url`, in its own process group.

    Subclasses fill in `args`, `env`, `url` and `log_path` and may change `name` (used in errors)
    and `health_path` (answers 200 once the server takes requests)."""

    name = "inference"
    health_path = "/health"
    # the health route's status that means the engine behind the live server died (vLLM: 503)
    dead_status: int | None = None
    # fork it from a zygote that holds the server's imports (factory/rollout/zygote.py), not spawn it
    # (VLLMServer on CPU); spawned as before if the zygote cannot be had
    zygote = False

    args: list[str]
    env: dict[str, str]
    url: str
    log_path: Path
    proc: subprocess.Popen | ForkedProcess | None = None

    def start(self, timeout_s: float = 300.0) -> None:
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the server and a reaper that kills the server's process group if we die."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = None
        if self.zygote:
            try:
                self.proc = fork_server(self.args, self.env, self.log_path)
            except ZygoteUnavailable as err:
                log.warning("%s server: started without the zygote (%s)", self.name, err)
        if self.proc is None:
            with open(self.log_path, "ab") as out:
                self.proc = subprocess.Popen(
                    self.args, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own process group, so stop() reaps its helper processes too
                )
        reaper = subprocess.Popen([sys.executable, "-S", "-c", _GROUP_REAPER, str(self.proc.pid), str(os.getpid())],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        reaper.wait(timeout=30)  # it forks its watcher and exits at once

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        if self.proc is None:
            raise RuntimeError(f"{self.name} server: wait_ready() before launch()")
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2) as http:  # one for the polls: each client builds a TLS context (~40 ms CPU)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise EngineStartError(
                        f"{self.name} server exited with code {self.proc.returncode} during start-up; see "
                        f"{self.log_path}:\n" + self.log_tail()
                    )
                try:
                    if http.get(f"{self.url}{self.health_path}").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)  # a forked vLLM server is up in ~3-4 s: half-second polls cost ~6% of it
        self.stop(grace_s=0)  # it never served: nothing to drain (a server mid-start ignored SIGTERM for 20 s)
        raise EngineStartError(f"{self.name} server not ready after {timeout_s:.0f}s; see {self.log_path}")

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def root_cause(self) -> str | None:
        """The root-cause line of the server's log (`root_cause_line`), if it holds one."""
        try:
            return root_cause_line(self.log_path.read_text(errors="replace")[-200_000:])
        except OSError:
            return None

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s` (0: at once), then the whole process group."""
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None and grace_s > 0:
                os.killpg(self.proc.pid, signal.SIGTERM)
                os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped (hung: SIGSTOP) server handles it too
                self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        try:  # helper processes can outlive the API server: end the whole group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:  # reaped (the zygote reaps a forked server; a spawned one is ours)
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def engine_client(url: str) -> httpx.AsyncClient:
    """The HTTP client an engine talks to its server with: many concurrent requests, connections kept
    30 s (servers we start keep idle ones longer, so the client never reuses one the server closed)."""
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=128, keepalive_expiry=30)
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10), limits=limits)


class ServerClient:
    """The HTTP side of a server-backed engine (vLLM, SGLang): its server's `url`, one pooled client made
    on first use (`engine_client`), and closing it."""

    server: Any
    _client: httpx.AsyncClient | None = None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = engine_client(self.url)
        return self._client

    async def health(self, timeout_s: float) -> tuple[bool, str] | None:
        """None when the server answers its health route within `timeout_s`; else (dead, why): dead =
        its process exited (a server we started), not dead = no answer in time (hung or overloaded)."""
        proc = getattr(self.server, "proc", None)
        if proc is not None and proc.poll() is not None:
            return True, f"server process exited with code {proc.returncode}"
        path = getattr(self.server, "health_path", "/health")
        try:
            resp = await self.client.get(path, timeout=timeout_s)
        except httpx.TimeoutException:
            return False, f"no answer on {path} within {timeout_s:g} s"
        except httpx.HTTPError as err:
            return proc is not None, f"{path}: {type(err).__name__}: {err}"
        if resp.status_code != 200:
            if resp.status_code == getattr(self.server, "dead_status", None):
                return True, self.death()
            return False, f"{path} answered {resp.status_code}"
        return None

    def death(self) -> str:
        """Why the engine behind the live server is dead: its log's root-cause line where we have the log."""
        cause = self.server.root_cause() if hasattr(self.server, "root_cause") else None
        where = f" (see {self.server.log_path})" if getattr(self.server, "log_path", None) else ""
        return f"its engine died while its server stayed up: {cause or 'no cause in its log'}{where}"

    async def dead(self, timeout_s: float = 10.0) -> EngineDead | None:
        """After a failed request: EngineDead if the engine behind the server is dead (its health route
        says so), else None (the request failed on its own, or the server is unreachable: a loss that
        the caller already sees as a transport error)."""
        if getattr(self.server, "dead_status", None) is None:
            return None
        try:
            health = await self.health(timeout_s)
        except Exception:  # noqa: BLE001  (a probe's own failure decides nothing)
            return None
        return EngineDead(health[1]) if health is not None and health[0] else None

    async def close_client(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
