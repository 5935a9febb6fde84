"""An in-process transformers engine for platforms without vLLM (slow, but the same interface).

Requests are served one at a time in a worker thread; logprobs are taken from the processed
(temperature / top-k / top-p) distribution the token was sampled from, as with vLLM's
`processed_logprobs` mode.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

import torch

from factory.rollout.engine import AdmissionGate, Generation, SamplingParams

if TYPE_CHECKING:
    from factory.model.weightsync import WeightReceiver


class HFEngine:
    def __init__(self, model_path: str, threads: int = 1):
        self.model_path = model_path
        self.threads = threads
        self.version = 0
        self.partial = "wait"  # an update waits for in-flight requests (the only mode it has)
        self.gate = AdmissionGate()
        self.model: torch.nn.Module | None = None
        self._lock = threading.Lock()
        self._aborted: set[str] = set()
        self._receiver: WeightReceiver | None = None
        self.stats = {"requests": 0, "tokens": 0, "updates": 0}

    async def start(self) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(self.threads)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()

    async def stop(self) -> None:
        self.model = None

    def _loaded(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError(f"HF engine ({self.model_path}): not started")
        return self.model

    def _generate_sync(self, prompt_ids: list[int], sp: SamplingParams, request_id: str):
        """(ids, logprobs, finish reason, per-token candidate sets or None) for one prompt."""
        gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
        ids, lps = [], []
        support: list[list[int]] | None = [] if sp.support_k else None
        finish = "length"
        with self._lock, torch.no_grad():
            model = self._loaded()
            out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
            for i in range(sp.max_new_tokens):
                if request_id in self._aborted:
                    finish = "abort"
                    break
                logits = logits.float()
                if i < sp.min_new_tokens and sp.stop_token_ids:
                    logits[sp.stop_token_ids] = float("-inf")
                processed = _process(logits, sp)
                logp = torch.log_softmax(processed, dim=-1)
                if support is not None:
                    support.append(torch.isfinite(processed).nonzero()[:, 0].tolist())
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                ids.append(tok)
                lps.append(float(logp[tok]))
                if tok in sp.stop_token_ids:
                    finish = "stop"
                    break
                out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1]
        return ids, lps, finish, support

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> Generation:
        async with self.gate:
            version = self.version
            ids, lps, finish, support = await asyncio.to_thread(self._generate_sync, prompt_ids, sampling, request_id)
        self._aborted.discard(request_id)
        self.stats["requests"] += 1
        self.stats["tokens"] += len(ids)
        return Generation(ids, lps, [version] * len(ids), finish, len(prompt_ids), support)

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def pause(self) -> None:
        await self.gate.close_and_drain()

    async def resume(self) -> None:
        self.gate.open()

    async def begin_update(self) -> None:
        await self.gate.close_and_drain()

    async def init_broadcast(self, host: str, port: int, rank: int, world_size: int, plan_json: str,
                             local_host: str = "127.0.0.1", backend: str = "gloo") -> None:
        from factory.model.weightsync import WeightReceiver

        self._receiver = await asyncio.to_thread(WeightReceiver, host, port, rank, world_size, plan_json,
                                                 local_host=local_host, backend=backend)

    def _receive_sync(self) -> None:
        if self._receiver is None:
            raise RuntimeError("HF engine: receive_broadcast before init_broadcast")
        state = {k: v.float().cpu() for k, v in self._receiver.receive()}
        with self._lock:
            self._loaded().load_state_dict(state)

    async def receive_broadcast(self) -> None:
        await asyncio.to_thread(self._receive_sync)

    async def load_from_disk(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        fresh = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, path, dtype=torch.float32)
        with self._lock:
            self._loaded().load_state_dict(fresh.state_dict())

    async def end_update(self, version: int) -> None:
        self.version = version
        self.stats["updates"] += 1
        self.gate.open()

    def metrics(self) -> dict[str, float]:
        return {"rollout/engine_requests": self.stats["requests"], "rollout/engine_tokens": self.stats["tokens"],
                "rollout/engine_version": self.version, "weightsync/updates": self.stats["updates"]}


def _process(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p: masked entries get -inf."""
    logits = logits / sp.temperature
    if sp.top_k and sp.top_k > 0:
        kth = torch.topk(logits, min(sp.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > sp.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits
