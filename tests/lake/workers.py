"""Entry points of the writer processes the lake tests spawn (importable, so `spawn` can run them)."""

from __future__ import annotations

import os
import queue
import time


def collect(procs, out, timeout_s: float) -> list:
    """One report from each of `procs` through queue `out`; fail at once, naming it, when a process
    dies without reporting (a crashed writer would otherwise cost the whole timeout)."""
    reports, deadline = [], time.monotonic() + timeout_s
    while len(reports) < len(procs):
        try:
            reports.append(out.get(timeout=1))
            continue
        except queue.Empty:
            pass
        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        assert not dead, f"a writer process died with exit code {dead[0]} before reporting (see its traceback above)"
        assert time.monotonic() < deadline, f"{len(procs) - len(reports)} writers did not report in {timeout_s:.0f} s"
    return reports


def append_many(home: str, worker: int, commits: int, rows_per_commit: int, out, env: dict | None = None,
                start=None) -> None:
    """Commit `commits` batches of `rows_per_commit` samples (flush after each); report metrics.
    `env`: further variables, e.g. FACTORY_PROFILE=production for the profile's catalog. `start`: a
    barrier the writers pass together once their catalogs are open, so that their commits overlap (a
    spawned writer can take seconds longer to start than another takes for all its commits: seen)."""
    os.environ["FACTORY_HOME"] = home
    os.environ.update(env or {})
    from factory.lake import TrajectoryWriter, open_catalog
    from tests.lake.rows import sample_row

    # frequent expiry keeps commits cheap and races expiry against the other writer's appends
    writer = TrajectoryWriter(open_catalog(), run_id="shared", batch_rows=10_000, flush_interval_s=60,
                              expire_every=10, keep_snapshots=2)
    first = last = 0.0  # wall clock of the first and the last commit: the test checks the writers overlapped
    if start is not None:
        start.wait(timeout=300)
    for i in range(commits):
        writer.append("samples", [sample_row("shared", f"w{worker}-{i}-{j}", step=i)
                                  for j in range(rows_per_commit)])
        writer.flush()
        last = time.time()
        first = first or last
    writer.close()
    out.put({**writer.metrics(), "first_commit_at": first, "last_commit_at": last})


def crash_after_steps(home: str) -> None:
    """Commit steps 1..5 (and their samples), queue 6..7 without flushing, then die without close()."""
    os.environ["FACTORY_HOME"] = home
    from factory.lake import TrajectoryWriter, open_catalog
    from tests.lake.rows import sample_row, step_row

    writer = TrajectoryWriter(open_catalog(), run_id="r", batch_rows=10_000, flush_interval_s=60)
    for step in range(1, 6):
        writer.append("steps", [step_row("r", step)])
        writer.append("samples", [sample_row("r", f"s{step}-{k}", step=step) for k in range(2)])
    writer.flush()
    for step in (6, 7):
        writer.append("steps", [step_row("r", step)])
        writer.append("samples", [sample_row("r", f"s{step}-{k}", step=step) for k in range(2)])
    os._exit(0)  # a crash: no close(), pending rows lost
