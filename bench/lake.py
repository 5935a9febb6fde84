"""Lake benchmark: stream-writer ingest rate and Iceberg commit latency over 1,000 commits.

    python bench/lake.py [--samples 64000] [--append-rows 64] [--commits 1000] [--rows 64]
                         [--settings 20] [--maintain]

1. Ingest: one TrajectoryWriter with its defaults (batch 64 rows or 2 s; the commit thread takes
   everything pending, so batches grow when appends outpace commits) receives `--samples` sample
   rows in appends of `--append-rows` (a training step's batch), then flushes. Reported: samples/s
   from the first append until everything is committed, the commits it took and their mean latency.
2. Commit latency: per setting, a fresh lake and a writer that commits `--commits` batches of
   `--rows` rows, flushing after each append, so one iteration = one Iceberg commit (plus, every N
   commits, the snapshot expiry the writer runs inline, counted in that iteration). A setting is
   the expiry period in commits (0: none), optionally `/nomerge` to turn manifest merging off;
   the default `20` is the lake's maintenance as runs use it. Reported: latency around commit
   10, 100 and 1,000 (mean of the 10 commits ending there), p50/p99, first/last 50.
   With `--maintain`, `factory.lake.maintenance.maintain` (compaction, expiry, orphan files)
   runs on the samples table at the end: its time, files before/after, and a full scan before/after.

Each part runs on every backend of `--backends`, side by side: `embedded` (SQLite catalog, local
warehouse: the default profile) and `production` (the production profile's SQL catalog on
PostgreSQL with the warehouse on S3 (s3rver), both started for the benchmark by infra/stack.py on
free loopback ports and stopped after; each part gets a fresh namespace). Ratios production /
embedded are printed and saved.

Rows: 32 prompt tokens, 96 completion tokens (logprobs, versions, mask) each. Results:
bench/results/lake.json.
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
from contextlib import contextmanager, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: E402
from rich.table import Table  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "lake.json"
MARKS = (10, 100, 1000)  # commits at which latency is reported
WINDOW = 50


def rows(run_id: str, batch: int, n: int) -> list[dict]:
    """n sample rows of one batch: 32 prompt tokens, 96 completion tokens."""
    return [{"run_id": run_id, "sample_id": f"{batch}-{j}", "group_id": f"{batch}-{j // 8}", "task_id": f"t{j}",
             "prompt_ids": list(range(32)), "completion_ids": list(range(96)), "logprobs": [-0.5] * 96,
             "versions": [batch // 4] * 96, "loss_mask": [1] * 96, "reward": float(j % 2), "turns": 1,
             "env": "arith", "finish_reason": "stop", "timings": {"generate_s": 0.1},
             "trained_step": batch, "trained_version": batch // 4, "staleness": 0,
             "status": "trained", "step": batch} for j in range(n)]


BACKEND = {"name": "embedded"}  # the backend the parts run on (main sets it)


@contextmanager
def fresh_lake():
    """Yields (catalog, namespace) of an empty lake: embedded, a temp state dir with a new SQLite
    catalog; production, a new namespace in the running stack's Postgres catalog on S3."""
    import uuid

    from factory.lake import open_catalog

    if BACKEND["name"] == "production":
        namespace = f"bench_{uuid.uuid4().hex[:8]}"
        yield open_catalog(namespace=namespace), namespace
        return
    with tempfile.TemporaryDirectory(prefix="lake-bench-") as home:
        before = os.environ.get("FACTORY_HOME")
        os.environ["FACTORY_HOME"] = home
        try:
            yield open_catalog(), "factory"
        finally:
            if before is None:
                os.environ.pop("FACTORY_HOME", None)
            else:
                os.environ["FACTORY_HOME"] = before


@contextmanager
def production_stack():
    """Postgres + s3rver of the production profile on free ports, for the benchmark's duration."""
    from infra.stack import down, free_port_settings, up, write_env_file

    root = Path(tempfile.mkdtemp(prefix="factory-lake-bench-"))
    root.chmod(0o755)  # the postgres account enters it
    env_file = write_env_file(root / ".env", free_port_settings())
    saved = {k: os.environ.get(k) for k in ("FACTORY_PROFILE", "FACTORY_ENV_FILE")}
    try:
        up(env_file, root / "stack", only=["postgres", "s3"])
        os.environ.update({"FACTORY_PROFILE": "production", "FACTORY_ENV_FILE": str(env_file)})
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        down(root / "stack")
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def ingest(samples: int, append_rows: int, progress: Progress) -> dict:
    from factory.lake import TrajectoryWriter

    appends = samples // append_rows
    batches = [rows("ingest", i, append_rows) for i in range(appends)]  # built before the clock starts
    with fresh_lake() as (catalog, namespace):
        writer = TrajectoryWriter(catalog, namespace, run_id="ingest")
        task = progress.add_task(f"ingest ({BACKEND['name']})", total=appends)
        started = time.perf_counter()
        append_s = 0.0
        for batch in batches:
            t0 = time.perf_counter()
            writer.append("samples", batch)
            append_s += time.perf_counter() - t0
            progress.advance(task)
        writer.flush()
        wall = time.perf_counter() - started
        metrics = writer.metrics()
        writer.close()
        table = catalog.load_table((namespace, "samples"))
        stored = table.scan(selected_fields=("sample_id",)).to_arrow().num_rows
    return {"samples": appends * append_rows, "rows_per_append": append_rows, "stored": stored,
            "wall_s": wall, "samples_per_s": appends * append_rows / wall,
            "append_s_total": append_s, "append_us_per_row": 1e6 * append_s / (appends * append_rows),
            "commits": int(metrics["lake/commits"]), "rows_per_commit": appends * append_rows / metrics["lake/commits"],
            "commit_ms_mean": 1000 * metrics["lake/commit_s_mean"], "retries": int(metrics["lake/retries"])}


def commit_latency(setting: str, commits: int, n_rows: int, maintain_after: bool, progress: Progress) -> dict:
    from factory.lake import TrajectoryWriter

    expire_every, _, option = setting.partition("/")
    expire_every, merge = int(expire_every), option != "nomerge"
    with fresh_lake() as (catalog, namespace):
        if not merge:
            with catalog.load_table((namespace, "samples")).transaction() as tx:
                tx.set_properties({"commit.manifest-merge.enabled": "false"})
        writer = TrajectoryWriter(catalog, namespace, run_id="bench", batch_rows=10**9, flush_interval_s=3600,
                                  expire_every=expire_every)
        label = (f"expire every {expire_every}" if expire_every else "no expiry") + ("" if merge else ", no merge") \
            + f" ({BACKEND['name']})"
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
        retries = writer.metrics()["lake/retries"]
        writer.close()
        table = catalog.load_table((namespace, "samples"))
        result = {
            "setting": setting, "expire_every": expire_every, "manifest_merge": merge, "commits": commits,
            "rows_per_commit": n_rows, "wall_s": wall, "rows_per_s": commits * n_rows / wall, "retries": retries,
            "snapshots_at_end": len(table.metadata.snapshots),
            "manifests_at_end": len(table.current_snapshot().manifests(table.io)),
            "metadata_json_bytes_at_end": len(table.io.new_input(table.metadata_location).open().read()),
        }
        if maintain_after and BACKEND["name"] == "embedded":  # orphan removal: local warehouses only
            result["maintenance"] = maintain(catalog)
    ordered = sorted(latencies)
    result.update({
        "at_commit_ms": {str(m): 1000 * statistics.fmean(latencies[max(0, m - 10):m])
                         for m in MARKS if m <= commits},
        "mean_ms": 1000 * statistics.fmean(latencies), "p50_ms": 1000 * ordered[len(ordered) // 2],
        "p99_ms": 1000 * ordered[int(0.99 * (len(ordered) - 1))],
        "first50_mean_ms": 1000 * statistics.fmean(latencies[:WINDOW]),
        "last50_mean_ms": 1000 * statistics.fmean(latencies[-WINDOW:]),
        "latencies_ms": [round(1000 * x, 2) for x in latencies],
    })
    return result


def maintain(catalog) -> dict:
    """Compaction + expiry + orphan removal on the samples table, with a full scan before and after."""
    from factory.lake.maintenance import data_file_count, live_files_on_disk, maintain as run_maintenance

    table = catalog.load_table(("factory", "samples"))

    def scan_s() -> float:
        t0 = time.perf_counter()
        table.refresh().scan().to_arrow()
        return time.perf_counter() - t0

    before = {"data_files": data_file_count(table), "files_on_disk": live_files_on_disk(table), "scan_s": scan_s()}
    t0 = time.perf_counter()
    report = run_maintenance(catalog, orphan_older_than_s=0.0)["samples"]
    seconds = time.perf_counter() - t0
    after = {"data_files": data_file_count(table.refresh()), "files_on_disk": live_files_on_disk(table),
             "scan_s": scan_s()}
    return {"seconds": seconds, "before": before, "after": after, "report": report}


def production_over_embedded(per_backend: dict[str, dict]) -> dict[str, float]:
    """Ratios of the production lake's figures to the embedded one's, measured in this run."""
    if not {"embedded", "production"} <= set(per_backend):
        return {}
    emb, prod = per_backend["embedded"], per_backend["production"]
    ratios = {}
    if "ingest" in emb and "ingest" in prod:
        ratios["ingest_samples_per_s"] = prod["ingest"]["samples_per_s"] / emb["ingest"]["samples_per_s"]
    for e, p in zip(emb["commit_latency"], prod["commit_latency"]):
        for mark, ms in e["at_commit_ms"].items():
            ratios[f"commit_ms_at_{mark}[{e['setting']}]"] = p["at_commit_ms"][mark] / ms
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64_000, help="samples ingested in part 1 (0 skips it)")
    parser.add_argument("--append-rows", type=int, default=64)
    parser.add_argument("--commits", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=64, help="rows per commit in part 2")
    parser.add_argument("--settings", nargs="+", default=["20"],
                        help="expiry period in commits (0: none), optionally /nomerge; e.g. 0 20 20/nomerge")
    parser.add_argument("--maintain", action="store_true", help="run compaction etc. after each setting")
    parser.add_argument("--backends", nargs="+", default=["embedded", "production"],
                        choices=["embedded", "production"], help="lakes to measure side by side")
    args = parser.parse_args()

    console = Console(width=140)
    per_backend: dict[str, dict] = {}
    with Progress(TextColumn("{task.description:>32}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console) as progress:
        for backend in args.backends:
            BACKEND["name"] = backend
            with production_stack() if backend == "production" else nullcontext():
                results: dict = {}
                if args.samples:
                    results["ingest"] = ingest(args.samples, args.append_rows, progress)
                results["commit_latency"] = [commit_latency(s, args.commits, args.rows, args.maintain, progress)
                                             for s in args.settings]
            per_backend[backend] = results

    for backend, results in per_backend.items():
        if "ingest" in results:
            r = results["ingest"]
            console.print(f"ingest ({backend}): {r['samples']} samples in {r['wall_s']:.1f} s = [bold]"
                          f"{r['samples_per_s']:.0f} samples/s[/bold] ({r['commits']} commits of "
                          f"~{r['rows_per_commit']:.0f} rows, {r['commit_ms_mean']:.0f} ms each; append "
                          f"{r['append_us_per_row']:.0f} µs/row)")
    table = Table(title=f"commit latency, {args.commits} commits × {args.rows} rows")
    columns = ["lake", "setting", *(f"@{m} ms" for m in MARKS if m <= args.commits), "p50 ms", "p99 ms", "first 50 ms",
               "last 50 ms", "rows/s", "snapshots", "manifests"]
    for column in columns:
        table.add_column(column, justify="right")
    rows_out = [(backend, r) for backend, results in per_backend.items() for r in results["commit_latency"]]
    for backend, r in rows_out:
        label = ("no expiry" if not r["expire_every"] else f"expire every {r['expire_every']}") + \
            ("" if r["manifest_merge"] else ", no merge")
        table.add_row(backend, label, *(f"{v:.1f}" for v in r["at_commit_ms"].values()), f"{r['p50_ms']:.1f}",
                      f"{r['p99_ms']:.1f}", f"{r['first50_mean_ms']:.1f}", f"{r['last50_mean_ms']:.1f}",
                      f"{r['rows_per_s']:.0f}", str(r["snapshots_at_end"]), str(r["manifests_at_end"]))
    console.print(table)
    ratios = production_over_embedded(per_backend)
    if ratios:
        console.print("production / embedded: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    for _, r in rows_out:
        m = r.get("maintenance")
        if m:
            console.print(f"maintain ({r['setting']}): {m['seconds']:.1f} s; data files {m['before']['data_files']} → "
                          f"{m['after']['data_files']}; full scan {m['before']['scan_s']:.2f} s → "
                          f"{m['after']['scan_s']:.2f} s")

    import duckdb
    import pyiceberg

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "lake", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_at_end": os.getloadavg(), "pyiceberg": pyiceberg.__version__,
                    "duckdb": duckdb.__version__},
        "settings": vars(args), **per_backend.get("embedded", {}),
        **({"production": per_backend["production"]} if "production" in per_backend else {}),
        "production_over_embedded": ratios,
    }, indent=1) + "\n")
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
