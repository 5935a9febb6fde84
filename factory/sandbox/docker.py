"""The Docker backend: programs run by `exec` in warm, locked-down containers that are reused.

Each container: image `factory-sandbox-<name>:latest` (built by `factory sandbox build`), no network
(`network_mode=none` unless `Limits.network`), read-only root, tmpfs /tmp, user 65534, every capability
dropped, no-new-privileges, memory (no swap), CPU-rate (nano_cpus) and pids limits, docker-init as
pid 1 reaping orphans. A host temp dir is bind-mounted at /work (the program's files) and /io (stdin
and captured stdout/stderr; `put_archive` cannot write into a read-only container).

A run takes an idle container with the same limits (or starts one), execs
`sh -c 'ulimit …; timeout -s KILL <wall> <command> </io/stdin >/io/stdout 2>/io/stderr'` as 65534,
and reads the result from the host dir. The container goes back to the pool only if nothing of the
run survived; otherwise, on a timeout the in-container `timeout` missed, or past the CPU budget, it
is killed and removed (killing the client alone leaves containers running, so every container is
labelled with its owner: `close()` removes them, and a new DockerSandbox removes those of dead owners).

Memory/pids reasons and the total CPU budget need the container's cgroup to be readable from here
(a local engine, as in CI); with a remote engine the run reports "killed" instead and only
RLIMIT_CPU bounds CPU time.
"""

from __future__ import annotations

import asyncio
import atexit
import math
import os
import shutil
import socket
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from factory.sandbox.base import (
    SANDBOX_ENV, SANDBOX_UID, WORKDIR, Limits, Program, Result, Sandbox, SandboxUnavailable, decide_reason,
    fresh_workdir, read_capped, safe_relpath, scratch_root, watch_limits, write_files,
)
from factory.sandbox.cgroups import Cgroup

if TYPE_CHECKING:
    from docker.models.containers import Container

LABEL = "factory.sandbox"
IO_DIR = "/io"
_GRACE_S = 1.0  # past wall_s before the host gives up on the in-container `timeout` and kills the container
_OVERHEAD_PIDS = 4  # docker-init, sleep, sh, timeout


def _engine_unavailable(err: Exception) -> SandboxUnavailable:
    return SandboxUnavailable(f"no Docker engine answers ({type(err).__name__}): apt-get install -y docker.io "
                              f"and start dockerd (.ci/sandbox-setup.sh does both), or use backend 'bubblewrap'")


def docker_client(timeout: float = 600, ping_timeout: float = 3.0, tries: int = 3):
    """A docker SDK client whose engine answered a ping within `ping_timeout` s (`tries` pings, 0.5 s apart),
    else SandboxUnavailable. Several: a dockerd busy removing containers missed a 2 s ping once under a
    loaded 2-core CI run (a test then failed with "no Docker engine answers" while dockerd ran)."""
    try:
        import docker
    except ImportError:
        raise SandboxUnavailable("python package docker not installed: pip install 'docker==7.2.*'") from None
    for attempt in range(tries):
        try:
            docker.from_env(timeout=ping_timeout).ping()
            return docker.from_env(timeout=timeout, max_pool_size=64)
        except Exception as err:  # DockerException, connection errors, timeouts: all mean "no engine"
            if attempt + 1 >= tries:
                raise _engine_unavailable(err) from None
            time.sleep(0.5)
    raise AssertionError("unreachable")


def _proc_start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (FileNotFoundError, IndexError):
        return None


class _ContainerGone(Exception):
    """The container stopped before the program could be started in it."""


@dataclass
class _Worker:
    """One warm container and its host directory."""

    container: Container
    host: Path
    key: tuple
    cgroup: Cgroup | None
    base: set[int] = field(default_factory=set)  # host pids of docker-init and the keeper
    runs: int = 0

    @property
    def id(self) -> str:
        return self.container.id


class DockerSandbox(Sandbox):
    """Runs programs in a pool of warm containers (see the module docstring)."""

    name = "docker"

    def __init__(self, image: str = "python", default_limits: Limits | None = None, max_idle: int = 16,
                 client=None) -> None:
        super().__init__(default_limits)
        from factory.sandbox.images import docker_tag

        self.client = client or docker_client()
        self.tag = image if ":" in image else docker_tag(image)
        import docker.errors

        try:
            self.client.images.get(self.tag)
        except docker.errors.ImageNotFound:
            name = self.tag.removeprefix("factory-sandbox-").removesuffix(":latest")
            raise SandboxUnavailable(f"sandbox image {self.tag} not found: run `factory sandbox build {name}` "
                                     f"(or .ci/sandbox-setup.sh)") from None
        self.max_idle = max_idle
        self.owner = f"{os.getpid()}:{_proc_start_time(os.getpid())}:{uuid.uuid4().hex[:8]}"  # pid:start:instance
        self.labels = {LABEL: "1", f"{LABEL}.host": socket.gethostname(), f"{LABEL}.owner": self.owner}
        self._scratch = scratch_root()
        self._lock = threading.Lock()
        self._idle: dict[tuple, list[_Worker]] = {}
        self._live: dict[str, _Worker] = {}
        self._pending: set[Future] = set()
        self._targets: dict[tuple, int] = {}
        self._closed = False
        self._threads = ThreadPoolExecutor(max_workers=64, thread_name_prefix="docker-sandbox")
        self.reap_orphans()
        atexit.register(self.close)  # containers outlive their client: never leave them on a normal exit

    # -- containers ------------------------------------------------------------------------------
    def reap_orphans(self) -> int:
        """Remove sandbox containers of this host whose owning process is gone; returns how many."""
        import docker.errors

        removed = 0
        for container in self.client.containers.list(all=True, filters={"label": [f"{LABEL}.host={socket.gethostname()}"]}):
            pid, started = (container.labels.get(f"{LABEL}.owner", "").split(":") + ["", ""])[:2]
            if pid.isdigit() and _proc_start_time(int(pid)) == started and started != "None":
                continue
            try:
                container.remove(force=True)
                removed += 1
            except docker.errors.APIError:
                pass  # another reaper got there first
        return removed

    def _key(self, limits: Limits) -> tuple:
        return (limits.memory_mb, limits.pids, limits.cpus, limits.network)

    def _start_worker(self, key: tuple) -> _Worker:
        """Create and start one container for limits `key` (blocking: ~0.3 s)."""
        memory_mb, pids, cpus, network = key
        host = self._scratch / f"c-{uuid.uuid4().hex[:12]}"
        host.mkdir(mode=0o711)
        fresh_workdir(host / "work")
        (host / "io").mkdir(mode=0o755)  # root-owned: the program can write its outputs but not swap them for links
        container = self.client.containers.create(
            self.tag, ["sleep", "infinity"], init=True, labels=self.labels, hostname="sandbox",
            network_mode="bridge" if network else "none", read_only=True, user=f"{SANDBOX_UID}:{SANDBOX_UID}",
            cap_drop=["ALL"], security_opt=["no-new-privileges"], ipc_mode="private",
            mem_limit=f"{memory_mb}m", memswap_limit=f"{memory_mb}m", nano_cpus=int(cpus * 1e9),
            pids_limit=pids + _OVERHEAD_PIDS, tmpfs={"/tmp": f"size={memory_mb}m,mode=1777"},
            volumes={str(host / "work"): {"bind": WORKDIR, "mode": "rw"}, str(host / "io"): {"bind": IO_DIR, "mode": "rw"}},
            working_dir=WORKDIR, environment=SANDBOX_ENV,
        )
        try:
            container.start()
            container.reload()
        except Exception:
            container.remove(force=True)
            shutil.rmtree(host, ignore_errors=True)
            raise
        worker = _Worker(container, host, key, Cgroup.of_pid(container.attrs["State"]["Pid"]))
        deadline = time.monotonic() + 10
        while len(procs := self._procs(worker) or set()) != 2 and time.monotonic() < deadline:
            time.sleep(0.005)  # docker-init has not started the keeper yet
        if len(procs) != 2:
            container.remove(force=True)
            shutil.rmtree(host, ignore_errors=True)
            raise SandboxUnavailable(f"docker sandbox container did not settle to init + keeper (has {len(procs)})")
        worker.base = procs
        with self._lock:
            self._live[worker.id] = worker
            closed = self._closed
        if closed:  # close() ran while this container was starting
            self._discard(worker)
            raise SandboxUnavailable("docker sandbox closed")
        return worker

    def _discard(self, worker: _Worker) -> None:
        """Kill and remove a container and its host dir (blocking)."""
        import docker.errors

        try:
            worker.container.remove(force=True)
        except docker.errors.NotFound:
            pass
        with self._lock:
            self._live.pop(worker.id, None)
        shutil.rmtree(worker.host, ignore_errors=True)

    def _submit(self, fn, *args) -> Future:
        future = self._threads.submit(fn, *args)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(lambda f: self._pending.discard(f))
        return future

    async def _acquire(self, key: tuple) -> _Worker:
        dead = []
        try:
            with self._lock:
                if self._closed:
                    raise SandboxUnavailable("docker sandbox closed")
                idle = self._idle.get(key, [])
                while idle:
                    worker = idle.pop()
                    if worker.cgroup is None or set(worker.cgroup.procs()) == worker.base:
                        return worker
                    dead.append(worker)  # died while idle (its keeper was killed, or the engine restarted)
        finally:
            for worker in dead:
                self._submit(self._discard, worker)  # outside the lock: _submit takes it
        return await asyncio.wrap_future(self._submit(self._start_worker, key))

    def _release(self, worker: _Worker, reusable: bool) -> None:
        with self._lock:
            idle = self._idle.setdefault(worker.key, [])
            keep = reusable and not self._closed and sum(map(len, self._idle.values())) < self.max_idle
            if keep:
                idle.append(worker)
            short = self._targets.get(worker.key, 0) - len(idle)
        if not keep:
            self._submit(self._discard, worker)
        if not reusable and short > 0 and not self._closed:
            self._submit(self._replenish, worker.key)

    def _replenish(self, key: tuple) -> None:
        worker = self._start_worker(key)
        self._release(worker, reusable=True)

    async def warm(self, count: int, limits: Limits | None = None) -> None:
        """Start containers until `count` idle ones with these limits exist; keep that many after discards."""
        key = self._key(limits or self.default_limits)
        with self._lock:
            self._targets[key] = max(self._targets.get(key, 0), count)
            missing = count - len(self._idle.get(key, []))
        futures = [asyncio.wrap_future(self._submit(self._start_worker, key)) for _ in range(max(0, missing))]
        for worker in await asyncio.gather(*futures):
            self._release(worker, reusable=True)

    # -- runs ------------------------------------------------------------------------------------
    def _script(self, limits: Limits) -> str:
        rlimits = [f"-f {math.ceil((limits.output_bytes + 1) / 512)}", "-c 0"]
        if limits.cpu_s is not None:
            rlimits.append(f"-t {math.ceil(limits.cpu_s)}")
        # `exec`: no shell left to print "Killed" into the program's stderr; exec_start still waits for exit
        # leftovers of the previous run in this container's tmpfs go first (chmod: it may have locked a dir)
        scratch = "/tmp/* /tmp/.[!.]* /dev/shm/* /dev/shm/.[!.]*"
        return (f"rm -rf {scratch} 2>/dev/null || {{ chmod -R u+rwx {scratch} 2>/dev/null; rm -rf {scratch} 2>/dev/null; }}; "
                + "".join(f"ulimit {flag} || exit 125; " for flag in rlimits)
                + f'exec timeout -s KILL {limits.wall_s:g} "$@" <{IO_DIR}/stdin >{IO_DIR}/stdout 2>{IO_DIR}/stderr')

    def _prepare(self, worker: _Worker, program: Program) -> None:
        write_files(worker.host / "work", program.files)
        io = worker.host / "io"
        for name in ("stdin", "stdout", "stderr"):
            (io / name).unlink(missing_ok=True)
            fd = os.open(io / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644 if name == "stdin" else 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write((program.stdin or b"") if name == "stdin" else b"")
            if name != "stdin":
                os.chown(io / name, SANDBOX_UID, SANDBOX_UID)

    def _exec(self, worker: _Worker, program: Program, limits: Limits) -> tuple[int | None, bytes]:
        """Run the program by exec; returns its exit code and what the wrapper itself printed."""
        import docker.errors

        api = self.client.api
        try:
            exec_id = api.exec_create(worker.id, ["/bin/sh", "-c", self._script(limits), "sh", *program.command],
                                      user=f"{SANDBOX_UID}:{SANDBOX_UID}", workdir=WORKDIR,
                                      environment=program.env or None)["Id"]
        except docker.errors.APIError as err:
            if err.status_code in (404, 409):  # no such container / not running
                raise _ContainerGone(str(err)) from None
            raise
        output = api.exec_start(exec_id) or b""
        return api.exec_inspect(exec_id).get("ExitCode"), output

    def _procs(self, worker: _Worker) -> set[int] | None:
        """Host pids of the container's processes (None if the engine cannot say)."""
        if worker.cgroup is not None:
            return set(worker.cgroup.procs())
        try:
            top = self.client.api.top(worker.id)
        except Exception:
            return None
        column = top["Titles"].index("PID")
        return {int(row[column]) for row in top.get("Processes") or []}

    def _clean(self, worker: _Worker) -> bool:
        """True if exactly the container's own docker-init and keeper are left (the run left nothing, and
        did not kill the keeper: a count alone would take a dying init plus a survivor for them)."""
        for _ in range(4):
            if self._procs(worker) == worker.base:
                return True
            time.sleep(0.005)  # the run's last processes may still be on their way out
        return False

    async def run(self, program: Program, limits: Limits | None = None) -> Result:
        limits = limits or self.default_limits
        for name in program.files:
            safe_relpath(name)  # refuse before a container is taken
        for attempt in range(2):
            key = self._key(limits)
            worker = await (self._acquire(key) if attempt == 0 else asyncio.wrap_future(self._submit(self._start_worker, key)))
            try:
                return await self._run_on(worker, program, limits)
            except _ContainerGone:
                if attempt:
                    raise SandboxUnavailable("docker sandbox: containers die as soon as they start; "
                                             "see the engine log") from None
        raise AssertionError("unreachable")

    async def _run_on(self, worker: _Worker, program: Program, limits: Limits) -> Result:
        """One run on one container; the container goes back to the pool only if the run left nothing."""
        loop = asyncio.get_running_loop()
        reusable = False
        try:
            await loop.run_in_executor(self._threads, self._prepare, worker, program)
            group = worker.cgroup
            cpu0, oom0, pids0 = (group.cpu_seconds(), group.oom_kills(), group.pids_hits()) if group else (None, 0, 0)
            started = time.monotonic()
            done = asyncio.wrap_future(self._threads.submit(self._exec, worker, program, limits))
            killed_container = False
            spent = (lambda: (group.cpu_seconds() or 0) - cpu0) if group is not None and cpu0 is not None else None
            timed_out, cpu_exceeded = await watch_limits(done, started + limits.wall_s + _GRACE_S, limits.cpu_s, spent)
            if not done.done():
                killed_container = True
                await loop.run_in_executor(self._threads, _kill, worker.container)
            try:
                exit_code, wrapper_out = await done
            except Exception:
                if not killed_container:
                    raise
                exit_code, wrapper_out = 137, b""  # SIGKILLed with its container
            wall = time.monotonic() - started
            if exit_code == 125 and b"ulimit" in wrapper_out:
                raise SandboxUnavailable(f"docker sandbox wrapper failed: {wrapper_out.decode(errors='replace')[:300]}")
            cpu = None
            if group is not None and cpu0 is not None and not killed_container:
                cpu = (group.cpu_seconds() or cpu0) - cpu0
            oom = (group.oom_kills() - oom0) if group and not killed_container else 0
            pids_hit = (group.pids_hits() - pids0) if group and not killed_container else 0
            if exit_code == 137 and wall >= limits.wall_s and not oom:
                timed_out = True  # the in-container `timeout -s KILL` fired
            if limits.cpu_s is not None and (exit_code == 128 + 24 or (cpu or 0) >= limits.cpu_s):
                cpu_exceeded = True  # 24 = SIGXCPU: RLIMIT_CPU fired
            io = worker.host / "io"
            stdout, cut_out = read_capped(io / "stdout", limits.output_bytes)
            stderr, cut_err = read_capped(io / "stderr", limits.output_bytes)
            reusable = not killed_container and await loop.run_in_executor(self._threads, self._clean, worker)
            reason = decide_reason(exit_code=exit_code, oom_kills=oom, pids_hits=pids_hit, timed_out=timed_out,
                                   cpu_exceeded=cpu_exceeded, truncated=cut_out or cut_err)
            return Result(exit_code=exit_code, stdout=stdout, stderr=stderr, reason=reason, wall_s=wall, cpu_s=cpu,
                          truncated=cut_out or cut_err, backend=self.name)
        finally:
            if reusable:
                fresh_workdir(worker.host / "work")
                worker.runs += 1
            self._release(worker, reusable)

    # -- lifecycle -------------------------------------------------------------------------------
    def settle(self, timeout_s: float = 30.0) -> None:
        """Wait for background container work (discards, replacements) to finish."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return
            for future in pending:
                try:
                    future.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:
                    pass
            if time.monotonic() > deadline:
                return

    def idle_workers(self) -> list[_Worker]:
        with self._lock:
            return [w for idle in self._idle.values() for w in idle]

    def containers(self) -> list:
        """This sandbox's containers as the engine lists them (running or not)."""
        return self.client.containers.list(all=True, filters={"label": [f"{LABEL}.owner={self.owner}"]})

    def close(self) -> None:
        """Kill and remove every container this sandbox started, including ones still starting."""
        with self._lock:
            if self._closed and not self._live:
                return
            self._closed = True
            pending = list(self._pending)
            self._idle.clear()
        for future in pending:
            try:
                future.result(timeout=60)
            except Exception:
                pass
        with self._lock:
            workers = list(self._live.values())
        for worker in workers:
            self._discard(worker)
        for container in self.containers():  # anything a crashed call left unrecorded
            container.remove(force=True)
        self._threads.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self._scratch, ignore_errors=True)


def _kill(container) -> None:
    import docker.errors

    try:
        container.kill()
    except docker.errors.APIError:
        pass
