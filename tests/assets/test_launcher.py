"""The embedded launcher's health check: a run whose worker process is gone is reported FAILED."""

import subprocess
import sys
import time

import dagster as dg
from dagster._core.events import EngineEventData
from dagster._core.launcher import WorkerStatus

from assets.launcher import LocalProcessRunLauncher, run_worker_pid


def started_run(instance, run_id: str, pid: int | None) -> dg.DagsterRun:
    run = instance.add_run(dg.DagsterRun(job_name="rl_run_job", run_id=run_id, status=dg.DagsterRunStatus.STARTED))
    instance.report_engine_event("Launching subprocess for step (pid: 1).", run, EngineEventData.in_process(1))
    if pid is not None:
        instance.report_engine_event(f"Started process for run (pid: {pid}).", run, EngineEventData.in_process(pid))
    return run


def test_a_killed_run_worker_is_reported_failed(instance):
    launcher = LocalProcessRunLauncher()
    launcher.register_instance(instance)
    assert launcher.supports_check_run_worker_health

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = started_run(instance, "alive", worker.pid)
        assert run_worker_pid(instance, "alive") == worker.pid
        assert launcher.check_run_worker_health(run).status == WorkerStatus.RUNNING
        worker.kill()  # not reaped: once the signal lands it is a zombie, which is dead too
        deadline = time.monotonic() + 10
        while launcher.check_run_worker_health(run).status != WorkerStatus.FAILED:
            assert time.monotonic() < deadline, "a killed, unreaped worker still counts as running"
            time.sleep(0.05)
        assert worker.poll() is not None  # (poll reaps it only now)
    finally:
        worker.kill()
        worker.wait()
    health = launcher.check_run_worker_health(run)
    assert health.status == WorkerStatus.FAILED and f"pid {worker.pid} is gone" in health.msg

    # no pid reported yet (a run still starting): nothing to judge, so not failed
    assert launcher.check_run_worker_health(started_run(instance, "new", None)).status == WorkerStatus.RUNNING


def test_an_in_process_materialization_reports_its_own_pid(instance):
    import os

    @dg.asset
    def tiny() -> None:
        return None

    result = dg.materialize([tiny], instance=instance)
    assert run_worker_pid(instance, result.run_id) == os.getpid()
