"""`factory.paths.exclusive`: processes that would build the same thing under the state dir take turns,
and a holder that dies releases the lock."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

from factory.paths import exclusive


def _hold(lock: Path, log: Path, seconds: float) -> None:
    with exclusive(lock):
        with open(log, "a") as f:
            f.write(f"enter {os.getpid()} {time.monotonic()}\n")
        time.sleep(seconds)
        with open(log, "a") as f:
            f.write(f"leave {os.getpid()} {time.monotonic()}\n")


def _holding(lock, log, seconds: float):
    """A process that has taken `lock` (it holds it for `seconds`)."""
    holder = mp.get_context("spawn").Process(target=_hold, args=(lock, log, seconds))
    holder.start()
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text()):
        assert time.monotonic() < deadline, "the holder never took the lock"
        time.sleep(0.05)
    return holder


def test_a_waiter_is_told_who_holds_the_lock(tmp_path):
    lock, log = tmp_path / ".thing.lock", tmp_path / "log"
    holder = _holding(lock, log, 1.0)
    told: list[str] = []
    with exclusive(lock, on_wait=told.append):
        assert "leave" in log.read_text()  # entered only after the holder left
    holder.join(30)
    assert told == [str(holder.pid)]


def test_two_processes_take_turns(tmp_path):
    lock, log = tmp_path / "sub" / ".thing.lock", tmp_path / "log"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_hold, args=(lock, log, 0.5)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    events = [line.split() for line in log.read_text().splitlines()]
    # enter, leave of one process, then enter, leave of the other: never both inside
    assert [e[0] for e in events] == ["enter", "leave", "enter", "leave"], events
    assert events[0][1] == events[1][1] and events[2][1] == events[3][1] != events[0][1]
    assert float(events[2][2]) >= float(events[1][2])


def test_a_killed_holder_releases_the_lock(tmp_path):
    lock, log = tmp_path / ".thing.lock", tmp_path / "log"
    holder = _holding(lock, log, 600)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(30)
    t0 = time.monotonic()
    with exclusive(lock):
        waited = time.monotonic() - t0
    assert waited < 30  # the dead holder's lock went with its process, not after its 600 s


def test_without_wait_a_held_lock_is_refused_naming_its_holder(tmp_path):
    from assets.training import exclusive as run_lock
    from factory.paths import Locked

    lock, log = tmp_path / ".lock", tmp_path / "log"
    holder = mp.get_context("spawn").Process(target=_hold, args=(lock, log, 600))
    holder.start()
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_text()):
            assert time.monotonic() < deadline, "the holder never took the lock"
            time.sleep(0.05)
        try:
            with exclusive(lock, wait=False):
                raise AssertionError("took a held lock")
        except Locked as held:
            assert held.holder == str(holder.pid)
        # a run directory's lock (the rl_run asset): the same refusal, as one line for the user
        try:
            with run_lock(tmp_path):
                raise AssertionError("trained into a run another process holds")
        except Exception as err:  # noqa: BLE001  (dagster's Failure)
            assert f"another process is training this run (pid {holder.pid})" in str(err), err
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(30)
    with exclusive(lock, wait=False):  # free again once its holder is gone
        assert lock.read_text() == str(os.getpid())


def _build_into_shared(shared: Path, log: Path) -> None:
    """A builder in another process (`python -m tests.policies` in the user's state dir): publishes `shared`."""
    from factory.training.base_policy import build_once

    def build(tmp: Path) -> None:
        with open(log, "a") as f:
            f.write(f"enter {os.getpid()}\n")
        time.sleep(1.5)
        (tmp / "sft.json").write_text(str(os.getpid()))

    build_once(shared, build)


def test_a_policy_linked_before_it_is_built_is_waited_for_at_the_link_target(tmp_path):
    """A test session links the user's policy before `make test`'s background build has made it: a build
    through the link waits for that builder (its lock is the target's) and builds nothing itself; with
    no builder, it builds at the target, and the link then resolves to it."""
    from factory.training.base_policy import build_once

    user, session = tmp_path / "user" / "models", tmp_path / "session" / "models"
    session.mkdir(parents=True)
    (session / "tiny-a").symlink_to(user / "tiny-a", target_is_directory=True)
    log = tmp_path / "log"
    builder = mp.get_context("spawn").Process(target=_build_into_shared, args=(user / "tiny-a", log))
    builder.start()
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text()):
        assert time.monotonic() < deadline, "the builder never started"
        time.sleep(0.05)
    built_here: list[Path] = []
    assert build_once(session / "tiny-a", built_here.append) == session / "tiny-a"
    builder.join(30)
    assert built_here == [] and (session / "tiny-a" / "sft.json").read_text() == str(builder.pid)
    assert (session / "tiny-a").is_symlink() and sorted(p.name for p in user.iterdir()) == [".tiny-a.lock", "tiny-a"]

    (session / "tiny-b").symlink_to(user / "tiny-b", target_is_directory=True)
    build_once(session / "tiny-b", lambda tmp: (tmp / "sft.json").write_text("here"))
    assert (session / "tiny-b").is_symlink() and (user / "tiny-b" / "sft.json").read_text() == "here"
    assert not list(session.glob("*.tmp")) and not list(user.glob("*.tmp"))
