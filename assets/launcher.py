"""The embedded default's run launcher: Dagster's DefaultRunLauncher plus a health check of the
run worker process, so run monitoring notices a worker that died without a word (kill -9, OOM).

The default launcher starts each run worker as a local process but cannot tell whether it still
lives, so a SIGKILLed worker leaves its run STARTED forever and no failure sensor fires. Every run
worker reports its pid ("Started process for run (pid: N)"); this launcher checks that process.
Only meaningful where runs are local processes (the embedded default); production uses a k8s or
Docker launcher with its own health checks. Configured in dagster.yaml (`run_launcher`).
"""

from __future__ import annotations

import os

import dagster as dg
from dagster._core.launcher import CheckRunHealthResult, DefaultRunLauncher, WorkerStatus


# Engine events whose pid is the process executing the run: a run worker's, and the in-process
# executor's (also `execute_in_process`). Step subprocesses report pids too, but they end with each step.
RUN_PROCESS_EVENTS = ("Started process for run", "Executing steps in process")


def run_worker_pid(instance: dg.DagsterInstance, run_id: str) -> int | None:
    """The pid of the process executing the run, as it reported it (the newest report)."""
    pid = None
    for record in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        data = record.dagster_event.engine_event_data if record.dagster_event else None
        value = data.metadata.get("pid") if data is not None and data.metadata else None
        if value is not None and (record.message or "").startswith(RUN_PROCESS_EVENTS):
            pid = int(str(value.value))  # Dagster reports it as text
    return pid


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


class LocalProcessRunLauncher(DefaultRunLauncher):
    """DefaultRunLauncher whose run workers' health is their process being alive."""

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
        pid = run_worker_pid(self._instance, run.run_id)
        if pid is None:  # not reported yet: cannot tell
            return CheckRunHealthResult(WorkerStatus.RUNNING, "no run worker pid reported; assumed running")
        if process_alive(pid):
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"run worker pid {pid} is alive")
        return CheckRunHealthResult(WorkerStatus.FAILED, f"run worker pid {pid} is gone (killed or crashed)")
