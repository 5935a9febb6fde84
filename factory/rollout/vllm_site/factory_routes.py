"""A batch form of vLLM's token endpoint, added to the servers we launch (see sitecustomize.py).

`POST /factory/v1/generate_batch` takes `{"requests": [<body of /inference/v1/generate>, ...]}` and
answers `{"choices": [<choices[0] of each answer, or {"error": ...}>, ...]}` in the same order.

Why: the token endpoint is the only one that reports which weight version sampled each output
token (`weight_versions` spans), which inflight partial rollouts need, but it takes one prompt
per HTTP request, and vLLM's API server spends ~10 ms of CPU per request here — the bound on
inflight throughput. Each prompt of a batch goes through the endpoint's own handler
(`ServingTokens.serve_tokens`) as a separate engine request, so versions, logprobs, aborts by
request id and pause/resume behave exactly as they do one by one.
"""

from __future__ import annotations

import asyncio

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


def attach(app: FastAPI) -> None:
    app.include_router(router)
