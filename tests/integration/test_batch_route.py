"""The token endpoint's batch form our vLLM servers add (`/factory/v1/generate_batch`), live."""

from __future__ import annotations

import httpx
import ray


def token_request(request_id: str, prompt: list[int], **params) -> dict:
    sampling = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0, "skip_special_tokens": False, **params}
    return {"request_id": request_id, "token_ids": prompt, "sampling_params": sampling}


def test_batch_route_answers_like_the_token_endpoint_in_order(engine, policy):
    from transformers import AutoTokenizer

    from factory.model.tokens import encode_chat

    url = ray.get(engine.url.remote())
    tok = AutoTokenizer.from_pretrained(policy)
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in ("1 + 2 = ?", "40 + 5 = ?", "7 + 70 = ?")]
    one_by_one = [httpx.post(f"{url}/inference/v1/generate", json=token_request(f"single-{i}", p), timeout=60).json()
                  ["choices"][0] for i, p in enumerate(prompts)]
    batch = [token_request(f"batch-{i}", p) for i, p in enumerate(prompts)]
    batch.insert(1, token_request("bad", [], max_tokens=-3))  # one bad request fails alone
    resp = httpx.post(f"{url}/factory/v1/generate_batch", json={"requests": batch}, timeout=60)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == 4 and "error" in choices[1]
    del choices[1]
    for single, batched in zip(one_by_one, choices):
        assert batched["token_ids"] == single["token_ids"] and len(batched["token_ids"]) > 0  # greedy: equal
        assert [c["logprob"] for c in batched["logprobs"]["content"]] == \
               [c["logprob"] for c in single["logprobs"]["content"]]
        assert batched["weight_versions"], "no per-token version spans in the batch answer"


def test_sample_route_samples_what_the_token_endpoint_samples(engine, policy):
    """`/factory/v1/sample` (the wait mode's seeded batches): for seeded, sampled requests (temperature 1,
    top-k 5 with its candidates' logprobs) the same tokens, logprobs and top candidates as the token
    endpoint's batch form, in order; a bad request fails alone."""
    from transformers import AutoTokenizer

    from factory.model.tokens import encode_chat

    url = ray.get(engine.url.remote())
    tok = AutoTokenizer.from_pretrained(policy)
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in ("3 + 4 = ?", "12 + 30 = ?", "8 + 80 = ?")]
    params = {"temperature": 1.0, "top_k": 5, "logprobs": 5, "max_tokens": 8}
    tokens = [token_request(f"tok-{i}", p, seed=100 + i, **params) for i, p in enumerate(prompts)]
    sampled = [{"request_id": f"smp-{i}", "token_ids": p, "sampling_params": {"seed": 100 + i, **params}}
               for i, p in enumerate(prompts)]
    sampled.insert(1, {"request_id": "bad", "token_ids": prompts[0], "sampling_params": {"max_tokens": -3}})
    reference = httpx.post(f"{url}/factory/v1/generate_batch", json={"requests": tokens}, timeout=60).json()["choices"]
    resp = httpx.post(f"{url}/factory/v1/sample", json={"requests": sampled}, timeout=60)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == 4 and "error" in choices[1] and "token_ids" not in choices[1]
    del choices[1]
    for ref, got in zip(reference, choices):
        assert got["token_ids"] == ref["token_ids"] and len(got["token_ids"]) > 0
        assert got["finish_reason"] == ref["finish_reason"]
        content = ref["logprobs"]["content"]
        assert got["logprobs"] == [c["logprob"] for c in content]
        assert got["top"] == [[[t["token_id"], t["logprob"]] for t in c["top_logprobs"]] for c in content]
