"""SGLang as a rollout engine: its HTTP server process, started and stopped by us.

Tested here against a real SGLang 0.5.23 server on CPU, which is a TEST SET-UP: SGLang's CPU
kernels are on no package registry, so on CPU the server runs from a separate venv
(`infra/sglang-venv.sh`) with a stand-in `sgl_kernel` (factory/rollout/sglang_cpu/, whose
functions are never called for a dense model) and SGLang's torch-native attention. On GPUs the
same server and endpoints apply with SGLang's real kernels (CUDA SGLang is not runnable on these
machines, so that path is untested here).

Which python runs the server: `$FACTORY_SGLANG_PYTHON`, else the state dir's `sglang-venv`
(what infra/sglang-venv.sh builds), else this interpreter (GPU installs put sglang in the main env).

Endpoints used: `/generate` (prompt token ids in, sampled ids + per-token logprobs + per-token
weight-version spans out), `/abort_request`, `/pause_generation` + `/continue_generation` around a
weight swap, `/update_weights_from_disk`, `/update_weight_version`, `/flush_cache` (with `timeout`:
SGLang defers it until its scheduler is idle), and for
broadcast `/begin_weight_update` + `/update_weights_from_tensor` + `/end_weight_update` with our
custom weight loaders (factory/rollout/sglang_receiver.py).

What happens to requests in flight at a weight update is the recipe's `rollout.partial_rollout`
(`abort_resume` and `inflight` on SGLang's own `/pause_generation` modes):

- `wait`: stop admitting, let in-flight requests finish, swap, flush the prefix cache once SGLang's
  scheduler has retired the finished requests, reopen. One version per request. No
  `/pause_generation`: drained, the server holds no request of ours (see `begin_update`).
- `abort_resume`: stop admitting, pause with `abort` (running requests come back with the tokens
  sampled so far), swap, resume, and send prompt + those tokens back for the rest of the budget.
  The old tokens keep the old version and logprobs; the new ones carry the new version.
- `inflight`: pause with `retract` (running requests go back to the queue without their KV), swap,
  resume: they carry on, their KV recomputed under the new weights (vLLM's `inflight` keeps the old
  KV instead). Per-token versions are exact: the server labels tokens by the weight version that
  sampled them (`weight_versions` spans, labels set by `/update_weight_version`).

Logprobs are those of the temperature-scaled distribution the
token was sampled from; with top-k/top-p SGLang reports them before the top-k/top-p renormalisation
(vLLM's `processed_logprobs` report them after), and it returns no candidate sets
(`rollout.keep_sampling_mask` is not supported). A request's `seed` is passed as SGLang's
`sampling_seed`, which SGLang honours only with `--enable-deterministic-inference`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from factory.paths import REPO_ROOT, cache_dir, state_dir
from factory.rollout.engine import AdmissionGate, Batcher, Generation, SamplingParams, server_engine_metrics
from factory.rollout.server import EngineStartError, ServerClient, ServerProcess, free_port
from factory.rollout.vllm import spans_to_versions

CPU_STAND_IN = Path(__file__).parent / "sglang_cpu"  # the stand-in sgl_kernel (CPU test set-up only)
VENV_HINT = ("run `bash infra/sglang-venv.sh` (it builds $FACTORY_HOME/sglang-venv, default .state/sglang-venv), "
             "or set FACTORY_SGLANG_PYTHON to a python that has sglang")
RECEIVER = "factory.rollout.sglang_receiver"


def sglang_python() -> str:
    """The python that runs SGLang's server: $FACTORY_SGLANG_PYTHON, else the state dir's sglang-venv,
    else this interpreter."""
    if os.environ.get("FACTORY_SGLANG_PYTHON"):
        return os.environ["FACTORY_SGLANG_PYTHON"]
    venv = state_dir() / "sglang-venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def kv_tokens(model: str, dtype: str, kv_cache_gb: float) -> int | None:
    """How many tokens of KV cache fit in `kv_cache_gb` for this (decoder-only) model; None when its
    config does not say (SGLang then sizes the pool itself — on CPU from free memory: 14 GB and 30 s
    of start-up for a 2.7M-parameter model, seen here)."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_token = 2 * cfg["num_hidden_layers"] * heads * head_dim * (4 if dtype == "float32" else 2)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    return max(4096, int(kv_cache_gb * 2**30 / per_token))


class SGLangServer(ServerProcess):
    """One `python -m sglang.launch_server` process bound to `host` (loopback unless told otherwise),
    in its own process group, from `python` (default `sglang_python()`).

    `device="cpu"` adds SGLang's CPU flags (`--device cpu --attention-backend torch_native
    --disable-overlap-schedule`, SGLANG_USE_CPU_ENGINE=1) and the stand-in `sgl_kernel`;
    `"cuda"` leaves them all out (untested here: no GPU on any machine of this project)."""

    name = "SGLang"

    def __init__(self, model: str, *, dtype: str = "bfloat16", max_model_len: int = 256,
                 kv_cache_gb: float = 2, threads: int = 1, log_path: Path | None = None,
                 port: int | None = None, host: str = "127.0.0.1", device: str = "cpu",
                 python: str | None = None, extra_args: Sequence[str] = ()):
        if not (Path(model) / "config.json").is_file():
            raise EngineStartError(f"SGLang: no model at {model} on this node (no config.json)")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"SGLang: device must be cpu or cuda, not {device!r}")
        self.model = model
        self.device = device
        self.python = python or sglang_python()
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(log_path) if log_path else cache_dir() / f"sglang-{self.port}.log"
        # --sleep-on-idle: an idle scheduler waits on its sockets (woken by any request) instead of
        # polling them flat out, which held one of the cores the trainer shares for the server's life
        cpu_args = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
                    "--sleep-on-idle"]
        tokens = kv_tokens(model, dtype, kv_cache_gb)
        self.args = [
            self.python, "-m", "sglang.launch_server",
            "--model-path", model, "--host", host, "--port", str(self.port), "--dtype", dtype,
            "--context-length", str(max_model_len),
            *(["--max-total-tokens", str(tokens)] if tokens else []),
            "--weight-version", "0",  # per-token version labels are our integer versions
            "--custom-weight-loader", f"{RECEIVER}.join_group", f"{RECEIVER}.receive",
            "--log-level", "warning",
            *(cpu_args if device == "cpu" else []),
            *extra_args,
        ]
        self.env = dict(os.environ)
        path = [str(REPO_ROOT), os.environ.get("PYTHONPATH")]  # the custom weight loaders import factory.*
        if device == "cpu":
            path.insert(0, str(CPU_STAND_IN))
            self.env["SGLANG_USE_CPU_ENGINE"] = "1"
        self.env.update({
            "PYTHONPATH": os.pathsep.join(filter(None, path)),
            "OMP_NUM_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1",
            "PYTHONWARNINGS": "ignore",  # dozens of "only CUDA supports X" import warnings per process
            # idle connections outlive the client's keep-alive (30 s); vLLM's server closing a connection
            # as the client reused it (both at 5 s) was seen as httpx.ReadError
            "SGLANG_TIMEOUT_KEEP_ALIVE": "3600",
        })

    def launch(self) -> None:
        self._check_python()
        super().launch()

    def _check_python(self) -> None:
        """A one-line error when the python has no sglang (the usual cause: the venv was never built)."""
        if not Path(self.python).exists():
            raise EngineStartError(f"SGLang: no python at {self.python}; {VENV_HINT}")
        probe = subprocess.run([self.python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"],
                               capture_output=True, timeout=60)
        if probe.returncode != 0:
            raise EngineStartError(f"SGLang: {self.python} cannot import sglang; {VENV_HINT}")


def _call_payload(args: dict) -> str:
    """What `/update_weights_from_tensor` takes for one call of our custom weight loaders: a pickled
    `[(name, tensor)]` list (base64). Its unpickler admits torch types only, so the arguments travel
    as JSON in the name of an empty tensor, written as raw pickle opcodes (protocol 2): no torch
    pickling here, whatever torch this process has."""
    name = json.dumps(args).encode()
    data = b"\x80\x02](X" + struct.pack("<I", len(name)) + name + b"ctorch\nTensor\n)\x81\x86e."
    return base64.b64encode(data).decode()


FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
FLUSH_IDLE_S = 60.0  # how long a flush after an update waits for SGLang's scheduler to become idle


class SGLangEngine(ServerClient):
    """RolloutEngine over an SGLang server: prompts go in as token ids on `/generate`."""

    SUPPORTED_PARTIAL = ("wait", "abort_resume", "inflight")
    SUPPORTED_SYNC = ("broadcast", "disk")

    def __init__(self, model: str, *, dtype: str = "bfloat16", max_model_len: int = 256,
                 kv_cache_gb: float = 2, threads: int = 1, log_path: Path | None = None,
                 startup_timeout_s: float = 300.0, server: SGLangServer | None = None,
                 partial_rollout: str = "wait", host: str = "127.0.0.1", device: str = "auto",
                 python: str | None = None, coalesce_ms: float = 5.0, max_batch: int = 256):
        if partial_rollout not in self.SUPPORTED_PARTIAL:
            raise ValueError(f"rollout.partial_rollout: {partial_rollout!r} is not supported by the SGLang engine "
                             f"(it supports {', '.join(self.SUPPORTED_PARTIAL)})")
        self.partial = partial_rollout
        self._owns_server = server is None
        if server is None:
            from factory.support.devices import resolve_device

            server = SGLangServer(model, dtype=dtype, max_model_len=max_model_len, kv_cache_gb=kv_cache_gb,
                                  threads=threads, log_path=log_path, host=host, device=resolve_device(device),
                                  python=python)
        self.server = server
        self.startup_timeout_s = startup_timeout_s
        self.version = 0
        self.gate = AdmissionGate()
        self._client: httpx.AsyncClient | None = None
        self._user_aborted: set[str] = set()
        self._inflight_ids: set[str] = set()
        self._batcher = Batcher(self._flush, coalesce_ms / 1000.0, max_batch)
        self._flushing: set[asyncio.Task] = set()  # continuations of requests an update cut off
        self._paused = False  # SGLang paused by begin_update (abort_resume, inflight): end_update resumes it
        self._batches = 0
        self.stats = {"requests": 0, "tokens": 0, "updates": 0, "update_s": 0.0, "aborted": 0, "resumed": 0,
                      "mixed_version": 0, "prefix_reset_skipped": 0}

    @classmethod
    def from_build(cls, b) -> SGLangEngine:
        """From the registry's `EngineBuild` (factory/rollout/engines.py): model dir, rollout section, log."""
        r = b.rollout
        if b.url:
            raise ValueError("rollout.urls: the SGLang engine starts its own servers; unset urls or use vllm")
        if b.lora_rank:
            raise ValueError("train.lora: the SGLang engine does not serve LoRA adapters; use vllm")
        return cls(b.model_path, dtype=r.dtype, max_model_len=r.max_model_len, kv_cache_gb=r.kv_cache_gb,
                   threads=b.threads, log_path=b.log_path, startup_timeout_s=r.startup_timeout_s,
                   partial_rollout=r.partial_rollout, host=b.host, device=r.device,
                   coalesce_ms=r.coalesce_ms)

    async def start(self) -> None:
        if self._owns_server and self.server.proc is None:
            await asyncio.to_thread(self.server.launch)
            await asyncio.to_thread(self.server.wait_ready, self.startup_timeout_s)

    async def stop(self) -> None:
        await self.close_client()
        if self._owns_server:
            await asyncio.to_thread(self.server.stop)

    # --- generation ------------------------------------------------------------------------------

    @staticmethod
    def _params(sp: SamplingParams) -> dict:
        params: dict[str, Any] = {"max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                  "skip_special_tokens": False}
        if sp.top_k > 0:
            params["top_k"] = sp.top_k
        if sp.stop_token_ids:
            params["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.min_new_tokens:
            params["min_new_tokens"] = sp.min_new_tokens
        if sp.seed is not None:
            params["sampling_seed"] = sp.seed
        return params

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> Generation:
        """Queue one prompt; prompts that arrive within `coalesce_ms` travel to the server as one
        batched `/generate` request (each keeps its own sampling parameters and request id).

        Why: measured here, 64 prompts x 8 tokens took 1.5-2.6 s as 64 requests, 0.6-0.7 s as one."""
        future = asyncio.get_running_loop().create_future()
        self._batcher.add((list(prompt_ids), sampling, request_id, future))
        return await future

    async def _flush(self, batch) -> None:
        rids = [rid for _, _, rid, _ in batch]
        body = {"input_ids": [p for p, *_ in batch], "sampling_params": [self._params(sp) for _, sp, _, _ in batch],
                "rid": rids, "return_logprob": True, "stream": False}
        self._batches += 1
        try:
            async with self.gate:
                version = self.version  # fixed for these requests: updates wait for the drain
                self._inflight_ids.update(rids)
                try:
                    resp = await self.client.post("/generate", json=body)
                finally:
                    self._inflight_ids.difference_update(rids)
            if resp.status_code != 200:
                raise RuntimeError(f"SGLang /generate answered {resp.status_code}: {resp.text[:300]}")
            outs = resp.json()
            if len(outs) != len(batch):
                raise RuntimeError(f"SGLang /generate returned {len(outs)} outputs for {len(batch)} prompts")
        except Exception as err:  # every waiter learns of the failure
            for *_, future in batch:
                if not future.done():
                    future.set_exception(err)
            return
        for (prompt_ids, sampling, rid, future), out in zip(batch, outs):
            if future.done():
                continue
            user_aborted = rid in self._user_aborted
            gen = self._generation(out, len(prompt_ids), rid, version)
            if (self.partial == "abort_resume" and gen.finish_reason == "abort" and not user_aborted
                    and len(gen.token_ids) < sampling.max_new_tokens):
                # cut off by a weight update: continue under the new weights
                task = asyncio.create_task(self._continue(prompt_ids, gen, sampling, rid, future))
                self._flushing.add(task)
                task.add_done_callback(self._flushing.discard)
                continue
            future.set_result(gen)

    async def _continue(self, prompt_ids, head: Generation, sampling: SamplingParams, request_id: str,
                        future) -> None:
        """Finish a request a weight update aborted: prompt + tokens so far go back for the rest of the
        budget (queued until the engine reopens at the new version); the pieces are joined."""
        self.stats["resumed"] += 1
        n = len(head.token_ids)
        rest = replace(sampling, max_new_tokens=sampling.max_new_tokens - n,
                       min_new_tokens=max(0, sampling.min_new_tokens - n))
        try:
            tail = await self.generate(list(prompt_ids) + head.token_ids, rest, request_id)
        except Exception as err:
            if not future.done():
                future.set_exception(err)
            return
        versions = head.versions + tail.versions
        if len(set(versions)) > 1:
            self.stats["mixed_version"] += 1
        if not future.done():
            future.set_result(Generation(head.token_ids + tail.token_ids, head.logprobs + tail.logprobs, versions,
                                         tail.finish_reason, len(prompt_ids), None))

    def _generation(self, out: dict, prompt_len: int, request_id: str, version: int) -> Generation:
        meta = out.get("meta_info") or {}
        ids = [int(t) for t in out.get("output_ids") or []]
        lps = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        versions = spans_to_versions(meta.get("weight_versions"), len(ids), version)
        if len(set(versions)) > 1:
            self.stats["mixed_version"] += 1  # inflight: one request sampled by two versions
        finish = FINISH.get(((meta.get("finish_reason") or {}).get("type")) or "stop", "stop")
        if request_id in self._user_aborted:
            self._user_aborted.discard(request_id)
            finish = "abort"
        self.stats["requests"] += 1
        self.stats["tokens"] += len(ids)
        return Generation(ids, lps, versions, finish, prompt_len, None)

    async def abort(self, request_id: str) -> None:
        if request_id not in self._inflight_ids:
            return
        self._user_aborted.add(request_id)
        resp = await self.client.post("/abort_request", json={"rid": request_id})
        resp.raise_for_status()
        self.stats["aborted"] += 1

    async def pause(self) -> None:
        await self.gate.close_and_drain()

    async def resume(self) -> None:
        self.gate.open()

    # --- weight updates --------------------------------------------------------------------------

    async def _post(self, path: str, body: dict | None = None, timeout: float = 600.0) -> dict:
        resp = await self.client.post(path, json=body or {}, timeout=timeout)
        try:
            data = resp.json()
        except ValueError:
            data = {"message": resp.text}
        if resp.status_code != 200 or data.get("success") is False:
            raise RuntimeError(f"SGLang {path} failed ({resp.status_code}): {data.get('message', resp.text)[:500]}")
        return data

    async def begin_update(self) -> None:
        """Make way for a weight swap; what happens to requests in flight is `partial_rollout` (module
        docstring): `wait` drains them at our gate, the others pause SGLang (requests sent meanwhile
        wait in the server)."""
        self._update_t0 = time.perf_counter()
        self._paused = self.partial != "wait"
        if self.partial == "inflight":
            # running requests go back to the waiting queue without their KV: after the swap they are
            # recomputed under the new weights and carry on; the prefix cache can be flushed
            await self._post("/pause_generation", {"mode": "retract"})
        elif self.partial == "abort_resume":
            self.gate.close()
            # SGLang aborts every running request (each comes back with the tokens sampled so far,
            # finish "abort") and returns once none is left in its scheduler; _flush continues them
            await self._post("/pause_generation", {"mode": "abort"})
        else:
            # drained at our gate, SGLang holds no request of ours: a pause here could freeze answered but
            # unretired requests, and /flush_cache would be refused (test_sglang_answers_requests_before_it_retires_them)
            await self.gate.close_and_drain()

    async def load_from_disk(self, path: str) -> None:
        """Load the weights saved at `path` (a model directory on this engine's node)."""
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"SGLang: no model at {path} on this node (no config.json)")
        await self._post("/update_weights_from_disk", {"model_path": path, "flush_cache": False})

    async def init_broadcast(self, host: str, port: int, rank: int, world_size: int, plan_json: str,
                             local_host: str = "127.0.0.1", backend: str = "gloo") -> None:
        """Join the trainer's weight group (factory.model.weightsync) from inside the server's scheduler."""
        args = {"host": host, "port": int(port), "rank": int(rank), "world_size": int(world_size),
                "plan_json": plan_json, "local_host": local_host, "backend": backend}
        await self._loader_call("join_group", args, flush_cache=False)

    async def receive_broadcast(self) -> None:
        await self._loader_call("receive", {}, flush_cache=False)

    async def _loader_call(self, fn: str, args: dict, flush_cache: bool) -> None:
        await self._post("/begin_weight_update", {})
        try:
            await self._post("/update_weights_from_tensor", {
                "serialized_named_tensors": [_call_payload(args)], "load_format": f"{RECEIVER}.{fn}",
                "flush_cache": flush_cache})
        finally:
            await self._post("/end_weight_update", {})

    async def end_update(self, version: int) -> None:
        """Label the new weights, drop the prefix cache the old ones computed, resume, reopen."""
        await self._post("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        if self.partial == "inflight":
            # paused after retract: the running batch is empty, the retracted requests wait without KV
            if (await self.client.post("/flush_cache")).status_code != 200:
                self.stats["prefix_reset_skipped"] += 1  # refused while requests hold KV (not seen with retract)
        else:
            await self._flush_when_idle()
        if self._paused:
            await self._post("/continue_generation", {})
        self.version = version
        self.stats["updates"] += 1
        self.stats["update_s"] += time.perf_counter() - getattr(self, "_update_t0", time.perf_counter())
        self.gate.open()

    async def _flush_when_idle(self) -> None:
        """Flush the prefix cache once SGLang's scheduler is idle (`wait`, `abort_resume`: our gate is closed
        and drained or aborted). Idle means it has also retired the requests it already answered, one
        scheduler iteration after their last token; an immediate flush in between is refused. Not idle
        within FLUSH_IDLE_S means a request is really running there: an error (its prefix cache would
        keep the old weights' KV)."""
        resp = await self.client.post("/flush_cache", params={"timeout": FLUSH_IDLE_S}, timeout=FLUSH_IDLE_S + 30)
        if resp.status_code != 200:
            raise RuntimeError(f"SGLang refused to flush its prefix cache after a weight update: {resp.text[:300]}")

    def metrics(self) -> dict[str, float]:
        return server_engine_metrics(self)
