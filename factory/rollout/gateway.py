"""The gateway: an OpenAI-compatible chat endpoint that environments call, recording what was sampled.

Each episode gets its own base URL, `http://127.0.0.1:<port>/s/<session>/v1`, so an environment
uses a stock `openai` client and never learns about sessions. For every chat call the gateway

1. turns the messages into token ids once — on later turns only the new messages are tokenized
   and appended to the ids the engine already saw (token-in/token-out: no re-tokenization drift);
2. sends the ids to an engine (sticky per session, so a conversation keeps its prefix cache);
3. records prompt ids, sampled ids, their logprobs, the loss mask and the version of every token.

`finish(session)` turns the record into a `Sample`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

# Imported at module level on purpose: with postponed annotations FastAPI resolves the `Request`
# annotation of the endpoint from this module's globals; imported inside app() it would be
# mistaken for a query parameter and every call would get HTTP 422.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from factory.model.tokens import encode_chat
from factory.rollout.engine import Generation, SamplingParams
from factory.types import NOT_SAMPLED, Sample


class GatewayError(ValueError):
    """A request the gateway cannot serve; becomes an HTTP 400 with this message."""


@dataclass
class SessionRecord:
    session_id: str
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    support: list[list[int]] = field(default_factory=list)  # sampler candidates per token (when kept)
    messages: list[dict] = field(default_factory=list)  # the conversation the ids stand for
    turns: int = 0
    finish_reason: str = ""
    generate_s: float = 0.0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def extend(self, ids: list[int], *, sampled: bool, logprobs: list[float] = (), versions: list[int] = (),
               support: list[list[int]] | None = None):
        if support is not None or self.support:  # once recorded, every token gets an entry ([] = unknown)
            self.support += [[] for _ in range(len(self.completion_ids) - len(self.support))]
            self.support += [list(s) for s in support] if (sampled and support is not None) else [[] for _ in ids]
        self.completion_ids += ids
        self.loss_mask += [1 if sampled else 0] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)
        self.versions += list(versions) if sampled else [NOT_SAMPLED] * len(ids)


def _strip_message(m: dict) -> dict:
    return {k: v for k, v in m.items() if v is not None}


class Gateway:
    def __init__(self, tokenizer, engines: list, sampling_defaults: SamplingParams, model_name: str = "policy"):
        if not engines:
            raise ValueError("the gateway needs at least one engine")
        self.tokenizer = tokenizer
        self.engines = engines
        self.defaults = sampling_defaults
        self.model_name = model_name
        self.sessions: dict[str, SessionRecord] = {}
        self.end_id = tokenizer.eos_token_id
        self.stats = {"requests": 0, "sampled_tokens": 0, "prompt_tokens_new": 0}
        self._server = None
        self.port: int | None = None

    # ---- token accounting (pure, unit-tested) ------------------------------------------------

    def prompt_ids_for(self, record: SessionRecord, messages: list[dict]) -> list[int]:
        """Token ids for the engine: the session's ids so far plus only the new messages' tokens."""
        messages = [_strip_message(m) for m in messages]
        if record.turns == 0:
            ids = encode_chat(self.tokenizer, messages)
            record.prompt_ids = list(ids)
            record.messages = messages
            self.stats["prompt_tokens_new"] += len(ids)
            return ids
        known = len(record.messages)
        if messages[:known] != record.messages:
            raise GatewayError(
                "conversation diverged from what this session already sampled; start a new session "
                "for a forked conversation"
            )
        new = messages[known:]
        if not new:
            raise GatewayError("no new messages since the last turn")
        # the template rendered for (old + new) minus the template rendered for old alone
        old_text = self.tokenizer.apply_chat_template(record.messages, tokenize=False, add_generation_prompt=False)
        full_text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not full_text.startswith(old_text):
            raise GatewayError("the chat template does not render the conversation as a prefix extension")
        delta = self.tokenizer(full_text[len(old_text):], add_special_tokens=False).input_ids
        record.extend(delta, sampled=False)
        record.messages = messages
        self.stats["prompt_tokens_new"] += len(delta)
        return record.all_ids

    def record_generation(self, record: SessionRecord, gen: Generation) -> str:
        """Append sampled tokens; returns the reply text (without the end token)."""
        ids = list(gen.token_ids)
        record.extend(ids, sampled=True, logprobs=gen.logprobs, versions=gen.versions, support=gen.support)
        # what the model sees next turn is exactly these ids: close an unterminated reply ourselves
        if not ids or ids[-1] != self.end_id:
            record.extend([self.end_id], sampled=False)
        text = self.tokenizer.decode([t for t in ids if t != self.end_id], skip_special_tokens=False)
        record.messages = record.messages + [{"role": "assistant", "content": text}]
        record.turns += 1
        record.finish_reason = gen.finish_reason
        self.stats["requests"] += 1
        self.stats["sampled_tokens"] += len(ids)
        return text

    def sampling_from(self, body: dict[str, Any]) -> SamplingParams:
        if body.get("n", 1) != 1:
            raise GatewayError("n must be 1: run one episode per completion")
        d = self.defaults
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or d.max_new_tokens
        return SamplingParams(
            max_new_tokens=min(int(max_tokens), d.max_new_tokens),
            temperature=float(d.temperature if body.get("temperature") is None else body["temperature"]),
            top_p=float(body.get("top_p") or d.top_p),
            top_k=int(body.get("top_k") or d.top_k),
            stop_token_ids=[self.end_id],
            seed=body.get("seed"),
            min_new_tokens=d.min_new_tokens,
            support_k=d.support_k,
        )

    # ---- serving -----------------------------------------------------------------------------

    def engine_for(self, session_id: str):
        return self.engines[zlib.crc32(session_id.encode()) % len(self.engines)]

    async def chat(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise GatewayError("messages must be a non-empty list")
        record = self.sessions.setdefault(session_id, SessionRecord(session_id))
        prompt_ids = self.prompt_ids_for(record, messages)
        sampling = self.sampling_from(body)
        t0 = time.perf_counter()
        gen = await self.engine_for(session_id).generate(prompt_ids, sampling, f"{session_id}-{record.turns}")
        record.generate_s += time.perf_counter() - t0
        text = self.record_generation(record, gen)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length" if gen.finish_reason == "length" else "stop",
            }],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen.token_ids),
                      "total_tokens": len(prompt_ids) + len(gen.token_ids)},
        }

    def finish(self, session_id: str, *, sample_id: str, group_id: str, task_id: str, reward: float,
               env: str, info: dict | None = None, timings: dict | None = None) -> Sample | None:
        """Close a session and return its Sample (None if the episode never called the model)."""
        record = self.sessions.pop(session_id, None)
        if record is None or record.turns == 0:
            return None
        return Sample(
            sample_id=sample_id, group_id=group_id, task_id=task_id,
            prompt_ids=record.prompt_ids, completion_ids=record.completion_ids, logprobs=record.logprobs,
            loss_mask=record.loss_mask, versions=record.versions, reward=reward, env=env, turns=record.turns,
            finish_reason=record.finish_reason, timings={"generate_s": record.generate_s, **(timings or {})},
            info=info or {}, support=record.support,
        )

    def drop(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def app(self):
        """The ASGI app (built once): served on loopback by `serve`, or called in-process."""
        if getattr(self, "_app", None) is not None:
            return self._app
        app = self._app = FastAPI(title="factory gateway")

        @app.post("/s/{session_id}/v1/chat/completions")
        async def chat_completions(session_id: str, request: Request):
            try:
                return await self.chat(session_id, await request.json())
            except GatewayError as err:
                return JSONResponse({"error": {"message": str(err), "type": "invalid_request_error"}}, 400)

        @app.get("/s/{session_id}/v1/models")
        async def models(session_id: str):
            return {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}

        @app.get("/health")
        async def health():
            return {"ok": True}

        return app

    async def serve(self, port: int = 0) -> int:
        """Start serving on 127.0.0.1 in this event loop; returns the port."""
        import socket

        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", port))
        self.port = sock.getsockname()[1]
        # keep-alive longer than any pause between calls: a server closing an idle connection while the
        # client reuses it is a ReadError for the episode (seen at 128 concurrent episodes)
        config = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=3600, backlog=4096)
        self._server = uvicorn.Server(config)
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            await asyncio.sleep(0.01)
        return self.port

    def base_url(self, session_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/s/{session_id}/v1"

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._serve_task
            self._server = None

    def metrics(self) -> dict[str, float]:
        return {"gateway/requests": self.stats["requests"], "gateway/sampled_tokens": self.stats["sampled_tokens"],
                "gateway/open_sessions": len(self.sessions)}
