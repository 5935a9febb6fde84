"""The stack supervisor's stop of a service (infra/stack.py `kill_tree`), on plain shell processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import psutil

from infra.stack import Service, alive, kill_tree


def killed_parent_with_orphan(group_dies_with_it: bool) -> tuple[Service, int]:
    """A service whose process (bash) started a child, then was SIGKILLed: the child lives on,
    re-parented, in the service's process group (as uvicorn under a killed `mlflow server`)."""
    service = Service("double", ["bash", "-c", "sleep 300 & wait"], ready=lambda: True,
                      group_dies_with_it=group_dies_with_it)
    service.process = subprocess.Popen(service.argv, start_new_session=True)
    deadline = time.monotonic() + 10
    while not (children := psutil.Process(service.process.pid).children()):
        assert time.monotonic() < deadline, "bash never started its child"
        time.sleep(0.05)
    (child,) = children
    os.kill(service.process.pid, signal.SIGKILL)
    service.process.wait(timeout=5)
    assert alive(child.pid) and os.getpgid(child.pid) == service.process.pid
    return service, child.pid


def test_a_killed_services_leftovers_in_its_group_are_stopped_before_it_restarts():
    service, orphan = killed_parent_with_orphan(group_dies_with_it=True)
    kill_tree(service)
    assert not alive(orphan)


def test_a_group_that_outlives_its_service_is_left_alone():
    """The code server's group holds run workers, which outlive a restart of the code server."""
    service, orphan = killed_parent_with_orphan(group_dies_with_it=False)
    try:
        kill_tree(service)
        assert alive(orphan)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)
