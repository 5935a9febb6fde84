"""Seeded requests to an attached vLLM server (`rollout.urls`), against a scripted server on loopback:
through our sample route when the server has it, else through our batch route (a server of an older
Factory: asked once, then left alone), one seed per /v1/completions call when it does not
(a plain `vllm serve`), so the default `rollout.seed` works with either. Weight updates likewise: one
call that loads and resets the prefix cache through our route, or vLLM's two dev endpoints."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from factory.rollout.engine import SamplingParams
from factory.rollout.vllm import AttachedServer, EngineStartError, VLLMEngine


LOAD_REPORT = json.dumps({"tensors": 1, "receive_s": 0.001, "load_s": 0.002})


class ScriptedVLLM:
    """A loopback HTTP server answering like vLLM (with or without our routes); records each call."""

    def __init__(self, batch_route: bool, sample_route: bool = False):
        self.batch_route = batch_route
        self.sample_route = sample_route
        self.calls: list[tuple[str, dict]] = []
        script = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.answer(200, {"data": [{"id": "policy"}]} if self.path == "/v1/models" else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                script.calls.append((self.path, body))
                if self.path == "/factory/v1/generate_batch" and batch_route:
                    self.answer(200, {"choices": [
                        {"token_ids": [r["sampling_params"]["seed"] % 100], "logprobs": {"content": [{"logprob": -0.5}]}}
                        for r in body["requests"]]})
                elif self.path == "/factory/v1/sample" and sample_route:
                    self.answer(200, {"choices": [
                        {"token_ids": [r["sampling_params"]["seed"] % 100], "logprobs": [-0.5], "finish_reason": "stop"}
                        for r in body["requests"]]})
                elif self.path == "/v1/completions":
                    self.answer(200, {"choices": [
                        {"index": i, "token_ids": [body.get("seed", 0) % 100], "logprobs": {"token_logprobs": [-0.5]},
                         "finish_reason": "stop"} for i in range(len(body["prompt"]))]})
                elif self.path == "/factory/v1/update_weights" and batch_route:
                    self.answer(200, {"results": [LOAD_REPORT], "prefix_cache_reset": True})
                elif self.path == "/collective_rpc":
                    self.answer(200, {"results": [LOAD_REPORT]})
                elif self.path.startswith("/reset_prefix_cache"):
                    self.answer(200, {"success": True})
                else:
                    self.answer(404, {"detail": "Not Found"})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def generation_calls(self) -> list[tuple[str, dict]]:
        return [(path, body) for path, body in self.calls if body.get("requests") != []]  # not the start's probe


@pytest.fixture(params=[(True, True), (True, False), (False, False)], ids=["sample-route", "batch-route", "plain-vllm"])
def server(request):
    script = ScriptedVLLM(*request.param)
    yield script
    script.http.shutdown()


def generate_seeded(url: str, seeds: list[int], partial: str = "wait") -> tuple[VLLMEngine, list]:
    async def scenario():
        engine = VLLMEngine("policy", server=AttachedServer(url), partial_rollout=partial, coalesce_ms=20)
        await engine.start()
        try:
            return engine, await asyncio.gather(*(
                engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, seed=seed), f"r{seed}") for seed in seeds))
        finally:
            await engine.close_client()

    return asyncio.run(scenario())


def test_seeded_prompts_reach_an_attached_server_with_their_own_seeds(server):
    engine, generations = generate_seeded(server.url, [11, 12, 13])
    assert [g.token_ids for g in generations] == [[11], [12], [13]]  # each sampled under its own seed
    assert [g.logprobs for g in generations] == [[-0.5]] * 3
    calls = server.generation_calls()
    assert engine.batch_route == server.batch_route  # asked at attach
    seeds = [(path, [r["sampling_params"]["seed"] for r in body["requests"]]) for path, body in calls
             if "requests" in body]
    if server.sample_route:  # one call, each prompt with its seed
        assert seeds == [("/factory/v1/sample", [11, 12, 13])] and engine.sample_route
    elif server.batch_route:  # the sample route answered 404: the batch route, from then on
        assert seeds == [("/factory/v1/sample", [11, 12, 13]), ("/factory/v1/generate_batch", [11, 12, 13])]
        assert not engine.sample_route
    else:  # /v1/completions takes one seed per call
        assert sorted((path, body["seed"], len(body["prompt"])) for path, body in calls) == \
            [("/v1/completions", seed, 1) for seed in (11, 12, 13)]


def test_inflight_on_a_server_without_the_batch_route_is_refused_at_attach():
    script = ScriptedVLLM(batch_route=False)
    try:
        with pytest.raises(EngineStartError, match="rollout.partial_rollout: inflight needs the token endpoint's batch"):
            generate_seeded(script.url, [1], partial="inflight")
    finally:
        script.http.shutdown()


def test_a_broadcast_update_loads_and_resets_the_prefix_cache_in_one_call_where_the_server_has_our_route(server):
    async def scenario():
        engine = VLLMEngine("policy", server=AttachedServer(server.url))
        await engine.start()
        try:
            await engine.begin_update()
            await engine.receive_broadcast()
            await engine.end_update(1)
        finally:
            await engine.close_client()
        return engine

    engine = asyncio.run(scenario())
    calls = [(path.split("?")[0], body) for path, body in server.calls if path != "/factory/v1/generate_batch"]
    if server.batch_route:
        assert [path for path, _ in calls] == ["/factory/v1/update_weights"]
        assert calls[0][1]["method"] == "receive_weights"
        assert calls[0][1]["reset_prefix_cache"] == {"running_requests": True}
    else:
        assert [path for path, _ in calls] == ["/factory/v1/update_weights", "/collective_rpc", "/reset_prefix_cache"]
    assert engine.version == 1 and engine.stats["load_s"] == 0.002
