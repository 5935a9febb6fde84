"""A vLLM server forked by the zygote (factory/rollout/zygote.py) is the server a spawn gives: the same
seeded samples and logprobs, bit for bit, its own process group, found by its owner's reaper, and gone
with its group when stopped."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import psutil

from factory.rollout.server import owned_servers
from factory.rollout.vllm import SERVER_MODULE, VLLMServer
from factory.rollout.zygote import ForkedProcess


def sample(server: VLLMServer) -> list[tuple[list[int], list[float]]]:
    prompts = [[1, *range(10 + i, 20 + 2 * i)] for i in range(6)]
    resp = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": server.model, "prompt": prompts, "max_tokens": 12, "temperature": 1.0, "logprobs": 0,
        "seed": 1234, "return_token_ids": True})
    resp.raise_for_status()
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]


def test_a_forked_server_samples_what_a_spawned_one_does_and_stops_like_one(policy, tmp_path):
    forked = VLLMServer(str(policy), kv_cache_gb=1, log_path=tmp_path / "forked.log")
    spawned = VLLMServer(str(policy), kv_cache_gb=1, log_path=tmp_path / "spawned.log")
    spawned.zygote = False
    assert forked.zygote  # on CPU, unless FACTORY_VLLM_ZYGOTE=0
    try:
        spawned.launch()
        forked.launch()
        forked.wait_ready(300)
        spawned.wait_ready(300)
        assert isinstance(forked.proc, ForkedProcess) and isinstance(spawned.proc, subprocess.Popen)
        pid = forked.proc.pid
        assert os.getpgid(pid) == pid and psutil.Process(pid).ppid() != os.getpid()  # the zygote's child
        # as `ps` shows a spawn: argv entries, or one string where the title is longer than the zygote's own
        # command line (setproctitle; a longer clone or model path), so compared as the joined line
        title = " ".join(psutil.Process(pid).cmdline())
        assert title.startswith(f"{sys.executable} -m {SERVER_MODULE} "), title
        assert set(owned_servers(os.getpid())) >= {pid, spawned.proc.pid}
        assert sample(forked) == sample(spawned)
    finally:
        spawned.stop()
        forked.stop()
    assert forked.proc.returncode is not None
    left = [p for p in psutil.process_iter() if _in_group(p, pid)]
    assert left == []  # the API server and its engine core


def _in_group(proc: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.Error):
        return False
