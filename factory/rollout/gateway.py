"""The gateway: an OpenAI-compatible chat endpoint that environments call, recording what was sampled.

Each episode gets its own base URL, `http://127.0.0.1:<port>/s/<session>/v1`, so an environment
uses a stock `openai` client and never learns about sessions. For every chat call the gateway

1. turns the messages into token ids once — on later turns only the new messages are tokenized
   and appended to the ids the engine already saw (token-in/token-out: no re-tokenization drift);
2. sends the ids to an engine (sticky per session, so a conversation keeps its prefix cache);
3. records prompt ids, sampled ids, their logprobs, the loss mask and the version of every token.

`finish(session)` turns the record into a `Sample`.

Single-turn environments without tools skip the HTTP hop (`reply`, used by `EpisodeRunner` when
`environment.direct` is on): the same record, made in-process from prompt ids rendered once per task.

Tool calling (OpenAI `tools=[...]`): a reply whose sampled text holds
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks naming offered tools comes back
as `message.tool_calls` (finish reason "tool_calls"), any text before the first block as its
content; a malformed block leaves the whole reply plain text. The agent sends tool results back
as `role: tool` messages; they enter the episode as non-sampled tokens (loss mask 0). Earlier
messages are compared as the template renders them (role, content, tool names and arguments),
so an agent may echo the assistant message back in any equivalent form (ids, argument spacing).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# Imported at module level on purpose: with postponed annotations FastAPI resolves the `Request`
# annotation of the endpoint from this module's globals; imported inside app() it would be
# mistaken for a query parameter and every call would get HTTP 422.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from factory.model.tokens import encode_chat, encode_continuation
from factory.rollout.engine import Generation, SamplingParams
from factory.core.types import NOT_SAMPLED, Sample

if TYPE_CHECKING:
    import uvicorn


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
    routed_experts: list[list[list[int]]] = field(default_factory=list)  # per token [layer][top_k] (when kept)
    messages: list[dict] = field(default_factory=list)  # the conversation the ids stand for
    turns: int = 0
    finish_reason: str = ""
    generate_s: float = 0.0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def _per_token(self, kept: list, values: Sequence | None, ids: list[int], sampled: bool) -> None:
        """A per-token record (`support`, `routed_experts`): once recorded, every completion token gets an
        entry, [] where unknown or not sampled (tool output)."""
        if values is not None or kept:
            kept += [[] for _ in range(len(self.completion_ids) - len(kept))]
            kept += [list(v) for v in values] if (sampled and values is not None) else [[] for _ in ids]

    def extend(self, ids: list[int], *, sampled: bool, logprobs: Sequence[float] = (), versions: Sequence[int] = (),
               support: list[list[int]] | None = None, routed_experts: list[list[list[int]]] | None = None):
        self._per_token(self.support, support, ids, sampled)
        self._per_token(self.routed_experts, routed_experts, ids, sampled)
        self.completion_ids += ids
        self.loss_mask += [1 if sampled else 0] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)
        self.versions += list(versions) if sampled else [NOT_SAMPLED] * len(ids)


def _strip_message(m: dict) -> dict:
    """A message without None fields, its content parts (OpenAI `[{"type": "text", ...}]`) joined."""
    if not isinstance(m, dict):
        raise GatewayError(f"each message must be an object, got {type(m).__name__}")
    out = {k: v for k, v in m.items() if v is not None}
    if isinstance(out.get("content"), list):
        parts = out["content"]
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
            raise GatewayError("message content parts other than text are not supported")
        out["content"] = "".join(str(p.get("text", "")) for p in parts)
    return out


def _call_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _rendered_form(m: dict) -> tuple:
    """What the chat template renders of a message: role, content and tool calls (name, arguments)."""
    calls = []
    for call in m.get("tool_calls") or []:
        f = call.get("function", call) if isinstance(call, dict) else {}
        calls.append((f.get("name"), json.dumps(_call_arguments(f.get("arguments")), sort_keys=True)))
    return m.get("role"), m.get("content") or "", tuple(calls)


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[tuple[str, dict]]]:
    """(content before the first call or None, [(tool name, arguments)]) from sampled text. All or
    nothing: if any block is not JSON naming an offered tool with object arguments, there are no calls
    and the content is the whole text."""
    found = list(_TOOL_CALL.finditer(text))
    calls = []
    for match in found:
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            return text, []
        # a sampled name may be any JSON (a list, an object: an untrained policy writes such): only a string names a tool
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
            return text, []
        arguments = _call_arguments(obj.get("arguments", {}))
        if not isinstance(arguments, dict):
            return text, []
        calls.append((obj["name"], arguments))
    if not calls:
        return text, []
    content = text[: found[0].start()]
    return (content if content.strip() else None), calls


def tool_names(body: dict[str, Any]) -> set[str]:
    """The names of the function tools a request offers (empty: tool calls are not parsed)."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise GatewayError(f"tool_choice {choice!r} is not supported: use 'auto' or 'none'")
    if not isinstance(tools, list):
        raise GatewayError("tools must be a list of {'type': 'function', 'function': {'name': ...}}")
    names = set()
    for i, tool in enumerate(tools):
        name = tool.get("function", {}).get("name") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(name, str) or not name:
            raise GatewayError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}")
        names.add(name)
    return set() if choice == "none" else names


class Gateway:
    def __init__(self, tokenizer, engines: list, sampling_defaults: SamplingParams, model_name: str = "policy",
                 seed: int | None = None):
        """`seed`: derive each request's sampling seed from it (`request_seed`); None: the engine draws."""
        if not engines:
            raise ValueError("the gateway needs at least one engine")
        self.tokenizer = tokenizer
        self.engines = engines
        self.defaults = sampling_defaults
        self.model_name = model_name
        self.seed = seed
        self.sessions: dict[str, SessionRecord] = {}
        self.end_id = tokenizer.eos_token_id
        self.stats = {"requests": 0, "sampled_tokens": 0, "prompt_tokens_new": 0}
        self._server: uvicorn.Server | None = None
        self.port: int | None = None

    # ---- token accounting (pure, unit-tested) ------------------------------------------------

    def render(self, messages: list[dict]) -> list[int]:
        """A conversation's opening token ids (what the first turn of a session sends)."""
        return encode_chat(self.tokenizer, [_strip_message(m) for m in messages])

    def prompt_ids_for(self, record: SessionRecord, messages: list[dict], tools: list | None = None,
                       rendered: list[int] | None = None) -> list[int]:
        """Token ids for the engine: the session's ids so far plus only the new messages' tokens.
        `rendered`: the first turn's ids, already `render`ed from these messages (no tools)."""
        messages = [_strip_message(m) for m in messages]
        if record.turns == 0:
            ids = list(rendered) if rendered is not None else encode_chat(self.tokenizer, messages, tools=tools)
            record.prompt_ids = list(ids)
            record.messages = messages
            self.stats["prompt_tokens_new"] += len(ids)
            return ids
        known = len(record.messages)
        if [_rendered_form(m) for m in messages[:known]] != [_rendered_form(m) for m in record.messages]:
            raise GatewayError(
                "conversation diverged from what this session already sampled; start a new session "
                "for a forked conversation"
            )
        new = messages[known:]
        if not new:
            raise GatewayError("no new messages since the last turn")
        try:
            delta = encode_continuation(self.tokenizer, record.messages, new, tools=tools)
        except ValueError as err:
            raise GatewayError(str(err)) from None
        record.extend(delta, sampled=False)
        record.messages = record.messages + new
        self.stats["prompt_tokens_new"] += len(delta)
        return record.all_ids

    def record_generation(self, record: SessionRecord, gen: Generation) -> str:
        """Append sampled tokens; returns the reply text (without the end token)."""
        ids = list(gen.token_ids)
        record.extend(ids, sampled=True, logprobs=gen.logprobs, versions=gen.versions, support=gen.support,
                      routed_experts=gen.routed_experts)
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

    def request_seed(self, body: dict[str, Any], session_id: str, turn: int) -> int | None:
        """The body's seed, else (with `seed` set) one derived from it, the session and the turn."""
        if body.get("seed") is not None:
            return int(body["seed"])
        if self.seed is None:
            return None
        return int.from_bytes(hashlib.sha256(f"{self.seed}/{session_id}/{turn}".encode()).digest()[:4], "big") >> 1

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
            return_routing=d.return_routing,
        )

    # ---- serving -----------------------------------------------------------------------------

    def engine_for(self, session_id: str):
        return self.engines[zlib.crc32(session_id.encode()) % len(self.engines)]

    async def _turn(self, session_id: str, body: dict[str, Any],
                    rendered: list[int] | None = None) -> tuple[list[int], Generation, str]:
        """One model call of a session, recorded: (the prompt ids sent, the generation, its text)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise GatewayError("messages must be a non-empty list")
        record = self.sessions.setdefault(session_id, SessionRecord(session_id))
        prompt_ids = self.prompt_ids_for(record, messages, body.get("tools") or None, rendered)
        sampling = self.sampling_from(body)
        sampling.seed = self.request_seed(body, session_id, record.turns)
        t0 = time.perf_counter()
        gen = await self.engine_for(session_id).generate(prompt_ids, sampling, f"{session_id}-{record.turns}")
        record.generate_s += time.perf_counter() - t0
        return prompt_ids, gen, self.record_generation(record, gen)

    async def reply(self, session_id: str, messages: list[dict], sampling: dict[str, Any],
                    rendered: list[int] | None = None) -> str:
        """A tool-less chat call made in-process: the reply's text, recorded exactly as `chat` records
        the same request (`sampling`: the keyword arguments an OpenAI client would send). `rendered`:
        `render(messages)`, computed once for the episodes of one task."""
        return (await self._turn(session_id, {**sampling, "messages": messages}, rendered))[2]

    async def chat(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        names = tool_names(body)
        prompt_ids, gen, text = await self._turn(session_id, body)
        record = self.sessions[session_id]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = "length" if gen.finish_reason == "length" else "stop"
        content, calls = parse_tool_calls(text, names) if names else (text, [])
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": [
                {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments)}} for name, arguments in calls]}
            record.messages[-1] = _strip_message(message)
            finish = "tool_calls"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{
                "index": 0,
                "message": message,
                "finish_reason": finish,
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
            info=info or {}, support=record.support, routed_experts=record.routed_experts,
            prompt_text=self.tokenizer.decode(record.prompt_ids, skip_special_tokens=False),
            completion_text=self.tokenizer.decode(record.completion_ids, skip_special_tokens=False),
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
