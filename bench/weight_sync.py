"""Weight sync, side by side: what moving the trainer's weights into a live vLLM server costs.

Rows, all in one run against one vLLM server and one trainer:
- `raw_gloo`: the same bucketed bytes broadcast over gloo to a plain receiver actor (no model):
  the floor any in-process sync pays.
- `broadcast/<mode>`: the full sync the run loop does (`factory.run.publish_weights`) — close the
  engine, gloo broadcast into the vLLM worker and re-pack its weights, reset the prefix cache,
  reopen — under each partial-rollout mode.
- `disk`: the fallback: save an HF checkpoint, `reload_weights` from it.
- `lora`: adapter-only sync of a rank-8 LoRA trainer into a second server started with LoRA
  enabled (save the adapter, `/v1/load_lora_adapter` in place).

While each row runs, a load of concurrent requests keeps generating; a sync happens every
`--interval` seconds. Reported per row: seconds per sync (mean, p50, max), the share of the row's
wall time generation was paused (engine closed or frozen), and the tokens generated per second
under that regime; broadcast rows also split the sync by the engine's own counters: the load call
into the server (`engine_rpc_ms`: one HTTP call that receives, loads and resets the prefix cache
where the server has our route), and inside the worker the wire (`engine_receive_ms`) and writing
and re-packing the weights (`engine_load_ms`), each per sync. Writes bench/results/weight_sync.json.

    python bench/weight_sync.py [--syncs 10] [--interval 1.0] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402


@ray.remote(num_cpus=0)
class RawReceiver:
    """Receives the trainer's buckets into fresh tensors and does nothing with them."""

    def init(self, host: str, port: int, plan_json: str) -> None:
        from factory.model.weightsync import WeightReceiver

        self.receiver = WeightReceiver(host, port, 1, 2, plan_json)

    def receive(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.receiver.receive())


class Load:
    """Keeps `concurrency` requests in flight against the engine from a background thread."""

    def __init__(self, engine, prompt: list[int], concurrency: int, max_new_tokens: int):
        from factory.rollout.engine import SamplingParams

        self.engine, self.prompt, self.concurrency = engine, prompt, concurrency
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
        self.tokens = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._n = 0

    def _submit(self):
        self._n += 1
        return self.engine.generate.remote(self.prompt, self.sampling, f"load-{self._n}")

    def _loop(self) -> None:
        inflight = [self._submit() for _ in range(self.concurrency)]
        while not self._stop.is_set():
            done, inflight = ray.wait(inflight, num_returns=1, timeout=1.0)
            for ref in done:
                self.tokens += len(ray.get(ref).token_ids)
                inflight.append(self._submit())
        ray.get(inflight)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


ENGINE_PARTS = {"engine_rpc_ms": "weightsync/engine_rpc_s_total", "engine_receive_ms": "weightsync/engine_receive_s_total",
                "engine_load_ms": "weightsync/engine_load_s_total"}


def timed_rows(name: str, sync, syncs: int, interval: float, load: Load | None, engine=None) -> dict:
    """Run `sync()` `syncs` times, `interval` s apart, measuring sync seconds and paused share (and, given
    the engine actor, its per-sync share of each `ENGINE_PARTS` counter)."""
    before = ray.get(engine.metrics.remote()) if engine is not None else {}
    seconds = []
    tokens0 = load.tokens if load else 0
    t_start = time.perf_counter()
    for _ in range(syncs):
        time.sleep(interval)
        t0 = time.perf_counter()
        sync()
        seconds.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_start
    row = {"method": name, "syncs": syncs, "sync_s_mean": statistics.mean(seconds),
           "sync_s_p50": statistics.median(seconds), "sync_s_max": max(seconds),
           "paused_share": sum(seconds) / wall, "wall_s": wall}
    if load is not None:
        row["tokens_per_s_under_load"] = (load.tokens - tokens0) / wall
    if engine is not None:
        after = ray.get(engine.metrics.remote())
        row.update({part: (after[key] - before[key]) * 1000 / syncs for part, key in ENGINE_PARTS.items()})
        print(f"{'':>24}  in the engine: load call {row['engine_rpc_ms']:.1f} ms, of which wire "
              f"{row['engine_receive_ms']:.1f} ms, load {row['engine_load_ms']:.1f} ms", flush=True)
    print(f"{name:>24}: {row['sync_s_mean'] * 1000:7.1f} ms/sync (p50 {row['sync_s_p50'] * 1000:.1f}, "
          f"max {row['sync_s_max'] * 1000:.1f})", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--syncs", type=int, default=10)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds of generation between syncs")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--modes", nargs="+", default=["wait", "abort_resume", "inflight"])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "weight_sync.json"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from transformers import AutoTokenizer

    from factory.training.base_policy import ensure_base_policy
    from factory.model.tokens import encode_chat
    from factory.recipe import load_recipe
    from factory.run import connect_broadcast, publish_weights
    from factory.runtime.actors import EngineActor, TrainerActor
    from factory.runtime.cluster import local_ray

    recipe = load_recipe(REPO / "recipes" / "default.yaml", ["name=bench-weight-sync"])
    policy = ensure_base_policy(recipe)
    prompt = encode_chat(AutoTokenizer.from_pretrained(policy), [{"role": "user", "content": "Calculate 12 + 34."}])
    rows = []
    with local_ray(), tempfile.TemporaryDirectory() as tmp:
        trainer = TrainerActor.remote(str(policy), recipe.algorithm, recipe.train, recipe.rollout)
        plan = ray.get(trainer.plan_json.remote())
        from factory.model.weightsync import BucketPlan

        total_bytes = BucketPlan.from_json(plan).total_bytes

        # the floor: the same buckets over gloo into a receiver that does nothing with them
        receiver = RawReceiver.remote()
        host, port = ray.get(trainer.open_broadcast.remote(2, "gloo"))
        ray.get([trainer.join_broadcast.remote(), receiver.init.remote(host, port, plan)])
        sent = []

        def raw():
            sent.append(ray.get([trainer.broadcast.remote(), receiver.receive.remote()])[0])

        rows.append(timed_rows("raw_gloo", raw, args.syncs, 0.0, None))
        rows[-1].update(bytes=sent[-1], paused_share=None)  # no engine, nothing to pause
        ray.kill(receiver)

        engine = EngineActor.remote("vllm", str(policy), recipe.rollout, str(Path(tmp) / "vllm.log"))
        ray.get(engine.start.remote())
        connect_broadcast([engine], trainer)
        version = [0]

        def full(mode: str):
            def sync():
                version[0] += 1
                publish_weights([engine], trainer, version[0], mode)
            return sync

        with Load(engine, prompt, args.concurrency, args.max_new_tokens) as load:
            time.sleep(3.0)  # warm-up: the first requests of a fresh server are slow
            t0, tok0 = time.perf_counter(), load.tokens
            time.sleep(args.interval * args.syncs / 2)
            baseline = (load.tokens - tok0) / (time.perf_counter() - t0)
            print(f"{'no sync':>24}: {baseline:.0f} tokens/s", flush=True)
            for mode in args.modes:
                ray.get(engine.set_partial_rollout.remote(mode))
                rows.append(timed_rows(f"broadcast/{mode}", full("broadcast"), args.syncs, args.interval, load,
                                       engine))
                rows[-1]["bytes"] = sent[-1]
            ray.get(engine.set_partial_rollout.remote("wait"))
            rows.append(timed_rows("disk", full("disk"), args.syncs, args.interval, load))
        ray.get(engine.stop.remote())

        lora = load_recipe(REPO / "recipes" / "default.yaml",
                           ["name=bench-weight-sync", "train.lora.enabled=true", "rollout.weight_sync=lora"])
        lora_trainer = TrainerActor.remote(str(policy), lora.algorithm, lora.train, lora.rollout)
        lora_engine = EngineActor.remote("vllm", str(policy), lora.rollout, str(Path(tmp) / "vllm-lora.log"),
                                         lora.train.lora.rank)
        ray.get(lora_engine.start.remote())

        adapter_bytes = []

        def adapter():
            version[0] += 1
            adapter_bytes.append(publish_weights([lora_engine], lora_trainer, version[0], "lora")["weightsync/bytes"])

        with Load(lora_engine, prompt, args.concurrency, args.max_new_tokens) as load:
            time.sleep(3.0)
            rows.append(timed_rows(f"lora/r{lora.train.lora.rank}", adapter, args.syncs, args.interval, load))
        rows[-1]["bytes"] = adapter_bytes[-1]
        ray.get(lora_engine.stop.remote())

    raw_s = rows[0]["sync_s_mean"]
    print(f"\n{'method':>24} {'ms/sync':>8} {'x raw':>6} {'paused':>7} {'tok/s':>7} {'load call':>10} {'x raw':>6}")
    for r in rows:
        r["vs_raw_gloo"] = r["sync_s_mean"] / raw_s
        tps = r.get("tokens_per_s_under_load")
        paused = "" if r["paused_share"] is None else f"{r['paused_share']:.1%}"
        call = ""
        if "engine_rpc_ms" in r:  # the load call alone (no drain, pause or Ray hops) against the same floor
            r["engine_rpc_vs_raw_gloo"] = r["engine_rpc_ms"] / 1000 / raw_s
            call = f"{r['engine_rpc_ms']:>10.1f} {r['engine_rpc_vs_raw_gloo']:>5.1f}x"
        print(f"{r['method']:>24} {r['sync_s_mean'] * 1000:>8.1f} {r['vs_raw_gloo']:>5.1f}x {paused:>7} "
              f"{'' if tps is None else f'{tps:.0f}':>7} {call}")
    write_results(args.out, {"rows": rows, "generation_tokens_per_s_without_sync": baseline,
                             "plan_bytes": total_bytes, "settings": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
