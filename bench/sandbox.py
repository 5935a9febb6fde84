"""Sandbox throughput and latency: executions/s and p50/p99 per backend at several concurrency levels.

    python bench/sandbox.py [--runs 1000] [--concurrency 1 2 4 8] [--backends bubblewrap docker]

Each level: a SandboxPool of that size (Docker: that many warm containers), a few unmeasured warm-up
runs, then `--runs` executions of a one-line Python program by `concurrency` closed-loop workers.
Latency is one `run` call (files written, sandbox set up, program run, output read, cleanup).
Writes bench/results/sandbox.json and prints a side-by-side table. Each cell records how many cores
other work kept busy just before it (`other_work_busy_cores_before`): on a shared machine that is
what moves the numbers most.
Targets: bubblewrap >= 80/s with p99 < 60 ms on 2 cores; Docker warm pool >= 12/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.progress import (  # noqa: E402
    BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn,
)
from rich.table import Table  # noqa: E402
from rich.text import Text  # noqa: E402

from factory.sandbox import Limits, Program, SandboxPool, SandboxUnavailable, make_sandbox  # noqa: E402

PROGRAM = Program.python("import sys\nprint(sum(range(1000)))")
EXPECTED = "499500\n"
LIMITS = Limits(wall_s=10, memory_mb=256, pids=64)
TARGETS = {"bubblewrap": {"per_s": 80, "p99_ms": 60}, "docker": {"per_s": 12}}
RESULTS = Path(__file__).resolve().parent / "results" / "sandbox.json"


class RateColumn(ProgressColumn):
    def render(self, task) -> Text:
        return Text(f"{task.speed:6.1f}/s" if task.speed else "", style="progress.data.speed")


def busy_cores(seconds: float = 2.0) -> float:
    """How many cores the machine's other work keeps busy (sampled from /proc/stat while we idle)."""
    def busy_and_total() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields) - fields[3] - fields[4], sum(fields)  # all but idle and iowait

    busy0, total0 = busy_and_total()
    time.sleep(seconds)
    busy1, total1 = busy_and_total()
    return round((busy1 - busy0) / max(1, total1 - total0) * (os.cpu_count() or 1), 2)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(backend: str, concurrency: int, runs: int, progress: Progress) -> dict:
    """One (backend, concurrency) cell: closed-loop workers over a warm pool."""
    sandbox = make_sandbox(backend)
    pool = SandboxPool(sandbox, size=concurrency, limits=LIMITS)
    task = progress.add_task(f"{backend} ×{concurrency}", total=runs)
    background = busy_cores()
    try:
        await pool.start()
        await pool.run_many([PROGRAM] * (2 * concurrency))  # warm-up, not measured
        latencies: list[float] = []
        failures: dict[str, int] = {}
        remaining = runs

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                started = time.perf_counter()
                result = await pool.run(PROGRAM)
                latencies.append(time.perf_counter() - started)
                if result.reason != "ok" or result.stdout != EXPECTED:
                    failures[result.reason] = failures.get(result.reason, 0) + 1
                progress.advance(task)

        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    finally:
        await pool.aclose()
    return {
        "runs": len(latencies), "seconds": round(elapsed, 3), "per_s": round(len(latencies) / elapsed, 2),
        "p50_ms": round(1000 * percentile(latencies, 0.50), 2), "p99_ms": round(1000 * percentile(latencies, 0.99), 2),
        "mean_ms": round(1000 * sum(latencies) / len(latencies), 2), "max_ms": round(1000 * max(latencies), 2),
        "failures": failures, "other_work_busy_cores_before": background,
        "load_1min_before": round(load_before, 2), "load_1min_after": round(os.getloadavg()[0], 2),
    }


def table(results: dict, levels: list[int]) -> Table:
    out = Table(title="sandbox executions (python3 one-liner)")
    out.add_column("concurrency", justify="right")
    for backend in results:
        out.add_column(f"{backend} exec/s", justify="right")
        out.add_column(f"{backend} p50 ms", justify="right")
        out.add_column(f"{backend} p99 ms", justify="right")
    for level in levels:
        row = [str(level)]
        for cells in results.values():
            cell = cells.get(str(level))
            row += [f"{cell['per_s']:.1f}", f"{cell['p50_ms']:.1f}", f"{cell['p99_ms']:.1f}"] if cell else ["-"] * 3
        out.add_row(*row)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000, help="measured executions per cell")
    parser.add_argument("--docker-runs", type=int, default=None, help="override --runs for docker")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--backends", nargs="+", default=["bubblewrap", "docker"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    console = Console(stderr=True)
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    progress = Progress(TextColumn("{task.description:>16}"), BarColumn(), MofNCompleteColumn(),
                        RateColumn(), TimeRemainingColumn(), console=console)
    with progress:
        for backend in args.backends:
            runs = args.docker_runs if backend == "docker" and args.docker_runs else args.runs
            try:
                results[backend] = {str(c): asyncio.run(measure(backend, c, runs, progress)) for c in args.concurrency}
            except SandboxUnavailable as err:
                skipped[backend] = str(err)
                console.print(f"[yellow]skipping {backend}: {err}")
    console.print(table(results, args.concurrency))
    report = {
        "program": "python3 main.py  # print(sum(range(1000)))",
        "limits": {"wall_s": LIMITS.wall_s, "memory_mb": LIMITS.memory_mb, "pids": LIMITS.pids, "cpus": LIMITS.cpus},
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "targets": TARGETS, "results": results, "skipped": skipped,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
