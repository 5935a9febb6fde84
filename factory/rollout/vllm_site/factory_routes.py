"""Routes added to the vLLM servers we launch (see sitecustomize.py).

A batch form of vLLM's token endpoint:

`POST /factory/v1/generate_batch` takes `{"requests": [<body of /inference/v1/generate>, ...]}` and
answers `{"choices": [<choices[0] of each answer, or {"error": ...}>, ...]}` in the same order.

Why: the token endpoint is the only one that reports which weight version sampled each output
token (`weight_versions` spans), which inflight partial rollouts need, but it takes one prompt
per HTTP request, and vLLM's API server spends ~10 ms of CPU per request here — the bound on
inflight throughput. Each prompt of a batch goes through the endpoint's own handler
(`ServingTokens.serve_tokens`) as a separate engine request, so versions, logprobs, aborts by
request id and pause/resume behave exactly as they do one by one.

`POST /factory/v1/sample` takes `{"requests": [{"request_id", "token_ids", "sampling_params"}, ...]}` and
answers `{"choices": [{"token_ids", "logprobs", "finish_reason"[, "top"][, "routed_experts"]} or {"error": ...}, ...]}`:
each prompt is one engine request (vLLM's `SamplingParams` as given, no detokenization, the engine
request id as given); `logprobs` are the sampled tokens' and, when the params ask for k > 0, `top` holds
each position's `[[token_id, logprob], ...]`; `routed_experts` (requests whose params carry
`extra_args: {"factory_routing": 1}`, MoE models) is base64 `.npy` of `[n_sampled, layers, top_k]`,
as vLLM's own endpoints send it (factory_routing.py). Why: the token endpoint's handler (request models,
response models with a dict per token) cost the API server 0.050 CPU-s per 64 seeded 16-token prompts
here with detokenization off, this 0.033, the same tokens sampled (bench/vllm_routes.py). Runs use it
where the caller fixes the version (wait mode); inflight mode keeps the token endpoint for its per-token
weight versions, and LoRA its adapter lookup.

`POST /factory/v1/update_weights` (dev mode only, as `/collective_rpc`): one worker RPC, with the
body of `/collective_rpc`, then, if the body holds `"reset_prefix_cache": {"running_requests": bool}`,
vLLM's prefix-cache reset; answers `{"results": [...], "prefix_cache_reset": bool | null}`. Why: a
weight update needs both, and on this server each HTTP request costs ~10 ms of CPU; one call saves
a round trip per update.
"""

from __future__ import annotations

import asyncio
import math

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

router = APIRouter()


async def _one(handler, body: dict) -> dict:
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    try:
        out = await handler.serve_tokens(GenerateRequest(**body), None)
    except Exception as err:  # one bad prompt must not fail the others
        return {"error": f"{type(err).__name__}: {err}"}
    data = out.model_dump()
    if "error" in data:  # an ErrorResponse
        return {"error": data["error"].get("message", str(data["error"]))}
    return data["choices"][0]


@router.post("/factory/v1/generate_batch")
async def generate_batch(raw_request: Request) -> JSONResponse:
    handler = getattr(raw_request.app.state, "serving_tokens", None)
    if handler is None:
        return JSONResponse({"error": "the token endpoint is off: start vLLM with --enable-scale-out"}, 501)
    body = await raw_request.json()
    choices = await asyncio.gather(*(_one(handler, r) for r in body.get("requests", [])))
    return JSONResponse({"choices": list(choices)})


def _clamp(logprob: float) -> float:
    return -9999.0 if math.isnan(logprob) else max(logprob, -9999.0)


async def _sample_one(client, body: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    try:
        params = SamplingParams(**body["sampling_params"], detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in client.generate(TokensPrompt(prompt_token_ids=body["token_ids"]), params,
                                         body["request_id"]):
            final = out
        if final is None:
            return {"error": "the engine returned no output"}
        c = final.outputs[0]
        if c.finish_reason == "error":
            return {"error": "the engine failed this request"}
        ids = list(c.token_ids)
        steps = [c.logprobs[i] for i in range(len(ids))] if c.logprobs is not None else [None] * len(ids)
        # as the token endpoint reports them: a sampled token missing from its position's map (or -inf,
        # NaN) reads -9999; `top` is the first max(k, 1) entries of each position's map, in its order
        choice = {"token_ids": ids, "finish_reason": c.finish_reason or "stop",
                  "logprobs": [_clamp(step[t].logprob) if step and t in step else -9999.0
                               for step, t in zip(steps, ids)]}
        if c.routed_experts is not None:  # routing replay: [n_sampled, layers, top_k] (factory_routing.py)
            from vllm.utils.serial_utils import numpy2base64

            choice["routed_experts"] = numpy2base64(c.routed_experts)
        if params.logprobs:
            choice["top"] = [[[t, _clamp(lp.logprob)] for t, lp in list((step or {}).items())[:max(params.logprobs, 1)]]
                             for step in steps]
        return choice
    except Exception as err:  # one bad prompt must not fail the others
        return {"error": f"{type(err).__name__}: {err}"}


@router.post("/factory/v1/sample")
async def sample(raw_request: Request) -> JSONResponse:
    body = await raw_request.json()
    client = raw_request.app.state.engine_client
    choices = await asyncio.gather(*(_sample_one(client, r) for r in body.get("requests", [])))
    return JSONResponse({"choices": list(choices)})


@router.post("/factory/v1/update_weights")
async def update_weights(raw_request: Request) -> JSONResponse:
    from vllm import envs

    if not envs.VLLM_SERVER_DEV_MODE:  # the same guard as vLLM's /collective_rpc
        return JSONResponse({"error": "start vLLM with VLLM_SERVER_DEV_MODE=1"}, 404)
    body = await raw_request.json()
    client = raw_request.app.state.engine_client
    results = await client.collective_rpc(method=body["method"], timeout=body.get("timeout"),
                                          args=tuple(body.get("args", [])), kwargs=body.get("kwargs", {}))
    reset = body.get("reset_prefix_cache")
    success = None
    if reset is not None:
        success = bool(await client.reset_prefix_cache(bool(reset.get("running_requests", False)), False))
    return JSONResponse({"results": [r if r is None or isinstance(r, dict | list) else str(r) for r in results or []],
                         "prefix_cache_reset": success})


def attach(app: FastAPI) -> None:
    app.include_router(router)
