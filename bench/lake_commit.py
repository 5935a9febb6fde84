"""Lake commit latency over many small commits, with and without periodic snapshot expiry.

    python bench/lake_commit.py [--commits 500] [--rows 64] [--settings 0 50 20 20/nomerge]

Each setting gets a fresh SQLite catalog in a temp state dir and one TrajectoryWriter that commits
`--commits` batches of `--rows` sample rows (about 100 completion tokens each), flushing after every
append, so one iteration = one Iceberg commit (plus, every N commits, a snapshot expiry, which is
counted in the iteration that runs it). A setting is the expiry period in commits (0: no expiry),
optionally with `/nomerge` to turn off the lake's manifest merging (`commit.manifest-merge.enabled`).
Reports mean/p50/p99 latency, the mean over the first and last 50 commits, and the ratio of the
last-50 mean without expiry to that with each expiry setting. Writes bench/results/lake_commit.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: E402
from rich.table import Table  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "lake_commit.json"
WINDOW = 50  # commits averaged at the start and at the end


def rows(run_id: str, commit: int, n: int) -> list[dict]:
    """n sample rows of one commit: 32 prompt tokens, 96 completion tokens."""
    return [{"run_id": run_id, "sample_id": f"{commit}-{j}", "group_id": f"{commit}-{j // 8}", "task_id": f"t{j}",
             "prompt_ids": list(range(32)), "completion_ids": list(range(96)), "logprobs": [-0.5] * 96,
             "versions": [commit // 4] * 96, "loss_mask": [1] * 96, "reward": float(j % 2), "turns": 1,
             "env": "arith", "finish_reason": "stop", "timings": {"generate_s": 0.1},
             "trained_step": commit, "trained_version": commit // 4, "staleness": 0} for j in range(n)]


def measure(setting: str, commits: int, n_rows: int, progress: Progress) -> dict:
    expire_every, _, option = setting.partition("/")
    expire_every, merge = int(expire_every), option != "nomerge"
    with tempfile.TemporaryDirectory(prefix="lake-bench-") as home:
        os.environ["FACTORY_HOME"] = home
        from factory.lake import TrajectoryWriter, open_catalog

        catalog = open_catalog()
        if not merge:
            with catalog.load_table(("factory", "samples")).transaction() as tx:
                tx.set_properties({"commit.manifest-merge.enabled": "false"})
        writer = TrajectoryWriter(catalog, run_id="bench", batch_rows=10**9, flush_interval_s=3600,
                                  expire_every=expire_every)
        label = (f"expire every {expire_every}" if expire_every else "no expiry") + ("" if merge else ", no merge")
        task = progress.add_task(label, total=commits)
        latencies = []
        started = time.perf_counter()
        for i in range(commits):
            writer.append("samples", rows("bench", i, n_rows))
            t0 = time.perf_counter()
            writer.flush()
            latencies.append(time.perf_counter() - t0)
            progress.advance(task)
        wall = time.perf_counter() - started
        writer.close()
        table = writer.catalog.load_table(("factory", "samples"))
        snapshots = len(table.metadata.snapshots)
        manifests = len(table.current_snapshot().manifests(table.io))
        metadata_bytes = Path(table.metadata_location.removeprefix("file://")).stat().st_size
    ordered = sorted(latencies)
    return {
        "setting": setting, "expire_every": expire_every, "manifest_merge": merge, "commits": commits,
        "rows_per_commit": n_rows,
        "mean_ms": 1000 * statistics.fmean(latencies), "p50_ms": 1000 * ordered[len(ordered) // 2],
        "p99_ms": 1000 * ordered[int(0.99 * (len(ordered) - 1))],
        "first50_mean_ms": 1000 * statistics.fmean(latencies[:WINDOW]),
        "last50_mean_ms": 1000 * statistics.fmean(latencies[-WINDOW:]),
        "rows_per_s": commits * n_rows / wall, "wall_s": wall, "snapshots_at_end": snapshots,
        "metadata_json_bytes_at_end": metadata_bytes, "manifests_at_end": manifests,
        "retries": writer.metrics()["lake/retries"],
        "latencies_ms": [round(1000 * x, 2) for x in latencies],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=500)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--settings", nargs="+", default=["0", "50", "20", "20/nomerge"],
                        help="expiry period in commits (0: none), optionally /nomerge")
    args = parser.parse_args()

    console = Console(width=140)
    results = []
    with Progress(TextColumn("{task.description:>16}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console) as progress:
        for setting in args.settings:
            results.append(measure(setting, args.commits, args.rows, progress))

    baseline = next((r for r in results if r["expire_every"] == 0 and r["manifest_merge"]), None)
    table = Table(title=f"lake commit latency, {args.commits} commits × {args.rows} rows")
    for column in ("setting", "mean ms", "p50 ms", "p99 ms", "first 50 ms", "last 50 ms", "rows/s", "snapshots",
                   "manifests", "no-expiry/this (last 50)"):
        table.add_column(column, justify="right")
    for r in results:
        ratio = baseline["last50_mean_ms"] / r["last50_mean_ms"] if baseline else float("nan")
        r["last50_ratio_vs_no_expiry"] = ratio
        r["mean_ratio_vs_no_expiry"] = baseline["mean_ms"] / r["mean_ms"] if baseline else float("nan")
        label = ("no expiry" if not r["expire_every"] else f"every {r['expire_every']}") + \
            ("" if r["manifest_merge"] else ", no merge")
        table.add_row(label,
                      f"{r['mean_ms']:.1f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
                      f"{r['first50_mean_ms']:.1f}", f"{r['last50_mean_ms']:.1f}", f"{r['rows_per_s']:.0f}",
                      str(r["snapshots_at_end"]), str(r["manifests_at_end"]), f"{ratio:.2f}×")
    console.print(table)

    import duckdb
    import pyiceberg

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "lake_commit", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_at_end": os.getloadavg(), "pyiceberg": pyiceberg.__version__,
                    "duckdb": duckdb.__version__},
        "settings": vars(args), "results": results,
    }, indent=1) + "\n")
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
