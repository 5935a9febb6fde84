"""`factory serve`: a vLLM server that runs attach to, started from the command line as a user would,
answers any first prompt, and stops on SIGTERM with its process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import psutil
import pytest

from factory.rollout.server import free_port, owned_servers

from .conftest import REPO

pytestmark = pytest.mark.integration


def test_factory_serve_answers_a_short_first_prompt_and_stops_on_sigterm(policy, tmp_path):
    """A first prompt of three tokens (on this machine such a first request once killed a CPU server's
    engine core: the warm-up in `VLLMServer.wait_ready` comes before it), then a chat-sized one."""
    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "factory.cli", "serve", str(policy), "--port", str(port),
                             "--device", "cpu", "--log", str(log)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen = []  # what it printed before the line that says where it serves (warnings, if any)
        while not (line := proc.stdout.readline()).startswith("serving ") and line:
            seen.append(line)
        assert line.startswith(f"serving {policy} at http://127.0.0.1:{port}"), "".join(seen)[-3000:]
        server = [psutil.Process(pid) for pid in owned_servers(proc.pid)]
        assert len(server) == 1
        for prompt in ([5, 6, 7], list(range(5, 45))):
            resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                              json={"model": str(policy), "prompt": prompt, "max_tokens": 4})
            assert resp.status_code == 200, (resp.text, log.read_text()[-3000:])
            assert resp.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not server[0].is_running() or server[0].status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
