"""The rollout engine protocol: token ids in, token ids + per-token logprobs + versions out.

Every engine (vLLM server, in-process transformers, SGLang) implements this, and nothing above it
(gateway, runtime, run loop) knows which one it has; `engines.py` lists them and what each can do.

Weight updates follow one protocol, driven by the run loop:
    await engine.begin_update()        # stop admitting requests, drain the in-flight ones
    await engine.receive_broadcast()   # or: await engine.load_from_disk(path)
    await engine.end_update(version)   # clear the prefix cache, publish the version, reopen
With the default (`rollout.partial_rollout=wait`) in-flight requests are drained first, so every
token of a request comes from one version; the vLLM engine can also abort and continue them or
keep them running across the swap (see factory/rollout/vllm.py). In every mode each sampled token
carries the version that sampled it and the behaviour logprob the sampler used.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    min_new_tokens: int = 0  # stop tokens are not sampled before this many new tokens
    support_k: int = 0  # > 0: record the sampler's candidate set per token (asks for this many top logprobs)
    return_routing: bool = False  # MoE policies: record the experts each sampled token was routed through


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    # per token, the ids the sampler could have chosen (after top-k/top-p); [] = not known
    support: list[list[int]] | None = None
    # routing replay (`return_routing`, MoE policies): per sampled token, per MoE layer (in model order), the
    # top-k expert ids that the position whose logits produced it was routed to (the prompt's last position
    # for the first token, then the previous token's); None where not asked or the model has no router
    routed_experts: list[list[list[int]]] | None = None


MASKED_LOGPROB = -1000.0  # vLLM reports candidates the sampler excluded at -9999


def routing_from(encoded: str | None, n_tokens: int) -> list[list[list[int]]] | None:
    """A server's `routed_experts` (base64 `.npy`, `[n_sampled, layers, top_k]`, as vLLM's endpoints send
    it) as lists, one entry per sampled token; None when the server sent none (a dense model, or a server
    without our capture), [] for a request that sampled nothing. A row count that is not the token count
    is refused: misaligned routing would silently train the wrong experts."""
    if encoded is None:
        return [] if n_tokens == 0 else None
    import base64
    import io

    import numpy as np

    rows = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    if rows.ndim != 3 or rows.shape[0] != n_tokens:
        raise ValueError(f"routed_experts: {tuple(rows.shape)} for {n_tokens} sampled tokens "
                         "(expected [tokens, layers, top_k])")
    return rows.tolist()


def support_from(candidates: list[tuple[int, float]], k: int) -> list[int]:
    """The sampler's candidate set from one token's top-`k` (id, processed logprob) pairs: the ids
    it did not mask. If all `k` are unmasked the set may be cut off, so it is unknown: []."""
    kept = [tid for tid, lp in candidates if lp > MASKED_LOGPROB]
    return [] if len(kept) >= k else kept


class RolloutEngine(Protocol):
    version: int
    partial: str  # what an update does to in-flight requests: one of its EngineKind's partial_rollouts
    gate: AdmissionGate  # admission: closed by a weight update (requests wait), open otherwise

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> Generation: ...
    async def abort(self, request_id: str) -> None: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def begin_update(self) -> None: ...
    async def init_broadcast(self, host: str, port: int, rank: int, world_size: int, plan_json: str,
                             local_host: str = "127.0.0.1", backend: str = "gloo") -> None: ...
    async def receive_broadcast(self) -> None: ...
    async def load_from_disk(self, path: str) -> None: ...  # a directory on the engine's own node
    async def end_update(self, version: int) -> None: ...
    def metrics(self) -> dict[str, float]: ...


def server_engine_metrics(engine) -> dict[str, float]:
    """The counters every server-backed engine (vLLM, SGLang) reports: requests, HTTP batches, tokens,
    its weight version, admission state and busy time, and its updates (from its `stats`, `_batches`,
    `version` and `gate`)."""
    stats = engine.stats
    return {
        "rollout/engine_requests": stats["requests"],
        "rollout/engine_http_batches": engine._batches,
        "rollout/engine_tokens": stats["tokens"],
        "rollout/engine_version": engine.version,
        "rollout/engine_inflight": engine.gate.inflight,
        "rollout/engine_busy_s": engine.gate.busy_s,
        "weightsync/updates": stats["updates"],
        "rollout/engine_resumed_requests": stats["resumed"],
        "rollout/engine_mixed_version_requests": stats["mixed_version"],
        "weightsync/prefix_reset_skipped": stats["prefix_reset_skipped"],
        "weightsync/seconds_total": stats["update_s"],
    }


class Batcher:
    """Gathers what arrives within `window_s` of the first item (or `max_batch` items, if set) and
    hands each batch to the coroutine `flush(batch)`, in a task of its own. Items carry their own
    futures: the flush answers them. Engines batch prompts into HTTP requests with it, the env
    worker batches them into Ray calls (per-call costs, not the model, bound small-model speed)."""

    def __init__(self, flush, window_s: float, max_batch: int = 0):
        self.flush, self.window_s, self.max_batch = flush, window_s, max_batch
        self._pending: list = []
        self._tasks: set[asyncio.Task] = set()

    def add(self, item) -> None:
        self._pending.append(item)
        if self.max_batch and len(self._pending) >= self.max_batch:
            self.flush_now()
        elif len(self._pending) == 1:
            asyncio.get_running_loop().call_later(self.window_s, self.flush_now)

    def flush_now(self) -> None:
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.create_task(self.flush(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def cancel(self) -> list[asyncio.Task]:
        """Drop what waits for a batch and cancel the flushes under way; the cancelled tasks (to await)."""
        self._pending = []
        left = [t for t in self._tasks if not t.done()]
        for task in left:
            task.cancel()
        return left


class AdmissionGate:
    """Counts in-flight requests and lets a weight update close the door and wait for drain.

    `busy_s`: the seconds during which at least one request was inside (the engine's busy time as its
    client sees it: compute plus the HTTP/API time around it)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.inflight = 0
        self._busy_since = 0.0
        self._busy_s = 0.0

    async def __aenter__(self):
        await self._open.wait()
        if self.inflight == 0:
            self._busy_since = time.perf_counter()
        self.inflight += 1
        self._idle.clear()
        return self

    async def __aexit__(self, *exc):
        self.inflight -= 1
        if self.inflight == 0:
            self._busy_s += time.perf_counter() - self._busy_since
            self._idle.set()

    @property
    def busy_s(self) -> float:
        return self._busy_s + (time.perf_counter() - self._busy_since if self.inflight else 0.0)

    async def close_and_drain(self) -> None:
        self._open.clear()
        await self._idle.wait()

    def close(self) -> None:
        """Stop admitting; requests already inside carry on."""
        self._open.clear()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is inside, False if `timeout` seconds pass first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()
