"""The daemon-less backend: each run is one bubblewrap sandbox in its own cgroup.

What a run gets (as root, the normal case here and in CI):
- Its own user, pid, mount, network, IPC, UTS and cgroup namespaces (`--unshare-all`); no network
  unless `Limits.network`; no nested user namespaces (`--disable-userns`).
- The real host uid/gid 65534 (bwrap is started through `setpriv` as nobody, not as root with a
  mapped uid: a root-started bwrap with `--uid 65534` still owns every root file on the host).
- A read-only root: the image's rootfs (`sandboxes/<name>/`, built by `factory sandbox build`) when
  built, else read-only binds of the host's /usr, /bin, /lib* and a few /etc files; private tmpfs
  /tmp and /dev/shm (bounded by the memory limit); the work dir bound read-write at /work.
- A fresh cgroup (v1 or v2) with memory (no swap), pids and CPU-rate limits, removed after the run;
  the CPU budget `cpu_s` is polled there and also set as RLIMIT_CPU per process.
- RLIMIT_FSIZE at `output_bytes` (stdout/stderr are files), RLIMIT_CORE 0.
- On timeout: SIGKILL to the launcher's process group; bwrap's pid-1 dies with it (`--die-with-parent`)
  and the kernel kills everything left in the pid namespace; then the cgroup is frozen and swept.

Where cgroups are unavailable (not root, or no writable cgroup fs) the backend still isolates the
filesystem, network and pids namespace and still kills everything on timeout, but memory is only
bounded per process (RLIMIT_AS), process count per uid (RLIMIT_NPROC, shared by all sandboxes of the
user) and CPU per process (RLIMIT_CPU); there is no CPU-rate cap, no total CPU budget and no
"memory"/"pids" reason (an allocation failure shows as exit_nonzero or killed). `enforcement()`
reports which case applies.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

from factory.sandbox import cgroups
from factory.sandbox.base import (
    SANDBOX_ENV, SANDBOX_UID, WORKDIR, Limits, Program, Result, Sandbox, SandboxUnavailable, decide_reason,
    fresh_workdir, read_capped, scratch_root, watch_limits, write_files,
)

_HOST_ETC = ("passwd", "group", "nsswitch.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime",
             "alternatives", "hosts", "mime.types", "ssl")
_STATUS_FD = 3
_OVERHEAD_PIDS = 2  # bwrap and its pid-1 init share the sandbox's pids budget


def _which(name: str) -> str:
    path = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin:/sbin:/bin")
    if path is None:
        raise SandboxUnavailable(f"{name} not found: apt-get install -y "
                                 f"{'bubblewrap' if name == 'bwrap' else 'util-linux'}")
    return path


class BubblewrapSandbox(Sandbox):
    """Runs each program in a fresh bubblewrap sandbox (≈20 ms), see the module docstring."""

    name = "bubblewrap"

    def __init__(self, rootfs: str | Path | None = None, default_limits: Limits | None = None) -> None:
        super().__init__(default_limits)
        self.bwrap = _which("bwrap")
        self.rootfs = Path(rootfs) if rootfs else None
        if self.rootfs is not None and not (self.rootfs / "usr" / "bin").is_dir():
            raise SandboxUnavailable(f"sandbox rootfs {self.rootfs} is incomplete: run `factory sandbox build`")
        self.as_root = os.geteuid() == 0
        self.setpriv = _which("setpriv") if self.as_root else None
        self.cgroup_version, self.cgroup_problem = cgroups.detect()
        version = subprocess.run([self.bwrap, "--version"], capture_output=True, text=True).stdout
        found = re.search(r"(\d+)\.(\d+)", version)
        self._has_size = found is not None and (int(found[1]), int(found[2])) >= (0, 8)  # --size, --disable-userns
        self._scratch = scratch_root()
        self._fs_args = self._filesystem_args()

    def enforcement(self) -> dict[str, str]:
        """What bounds which limit on this host (for logs and the docs)."""
        cg = self.cgroup_version
        return {
            "filesystem": f"read-only {'image rootfs ' + str(self.rootfs) if self.rootfs else 'host /usr, /lib, /etc subset'}",
            "user": "host uid 65534" if self.as_root else f"host uid {os.getuid()} (not root: no setpriv)",
            "network": "own empty network namespace unless Limits.network",
            "memory": f"cgroup {cg} (no swap)" if cg else "RLIMIT_AS per process only",
            "pids": f"cgroup {cg} pids.max" if cg else "RLIMIT_NPROC per uid (shared) only",
            "cpu_rate": f"cgroup {cg} CFS quota" if cg else "not enforced",
            "cpu_time": f"cgroup {cg} total + RLIMIT_CPU" if cg else "RLIMIT_CPU per process only",
            "wall_time": "SIGKILL of the process group; pid namespace teardown",
            "output": "RLIMIT_FSIZE on stdout/stderr files",
            "why_no_cgroups": self.cgroup_problem,
        }

    def _filesystem_args(self) -> list[str]:
        if self.rootfs is not None:
            return ["--ro-bind", str(self.rootfs), "/"]
        args = ["--ro-bind", "/usr", "/usr"]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / name
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), str(host)]
            elif host.is_dir():
                args += ["--ro-bind", str(host), str(host)]
        for name in _HOST_ETC:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        return args

    def _argv(self, program: Program, limits: Limits, workdir: Path, join: list[Path]) -> list[str]:
        """`sh` joins the cgroup and sets rlimits as root, then drops to nobody and execs bwrap."""
        tmp_bytes = str(limits.memory_mb * 1024 * 1024)
        size = lambda: ["--size", tmp_bytes] if self._has_size else []  # noqa: E731
        bwrap = [
            self.bwrap, "--unshare-all", *(["--share-net"] if limits.network else []),
            "--unshare-user", *(["--disable-userns"] if self._has_size else []),
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
            "--die-with-parent", "--new-session", *self._fs_args,
            "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", *size(), "--tmpfs", "/tmp", "--perms", "1777", *size(), "--tmpfs", "/dev/shm",
            "--bind", str(workdir), WORKDIR, "--chdir", WORKDIR, "--clearenv",
            "--remount-ro", "/",  # last: in host mode / is bwrap's tmpfs, which would otherwise be writable
        ]
        for key, value in {**SANDBOX_ENV, **program.env}.items():
            bwrap += ["--setenv", key, value]
        bwrap += ["--json-status-fd", str(_STATUS_FD), "--", *program.command]

        rlimits = [f"-f {math.ceil((limits.output_bytes + 1) / 512)}", "-c 0"]
        if limits.cpu_s is not None:
            rlimits.append(f"-t {math.ceil(limits.cpu_s)}")
        if not join:  # no cgroup: the per-process fallbacks the module docstring lists
            rlimits += [f"-v {limits.memory_mb * 1024}", f"-p {limits.pids + _OVERHEAD_PIDS}"]
        script = "".join(f"echo $$ > {path} || exit 125; " for path in join)
        script += "".join(f"ulimit {flag} || exit 125; " for flag in rlimits)
        if self.setpriv:
            script += f'exec {self.setpriv} --reuid={SANDBOX_UID} --regid={SANDBOX_UID} --clear-groups -- "$@"'
        else:
            script += 'exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *bwrap]

    async def run(self, program: Program, limits: Limits | None = None) -> Result:
        limits = limits or self.default_limits
        run_id = uuid.uuid4().hex[:16]
        host = self._scratch / run_id
        host.mkdir(mode=0o711)  # bwrap (as nobody) must reach work/; stdin/stdout/stderr here stay root-only
        group = None
        try:
            workdir = fresh_workdir(host / "work")
            write_files(workdir, program.files)
            (host / "stdin").write_bytes(program.stdin or b"")
            (host / "stdin").chmod(0o600)
            if self.cgroup_version:
                group = cgroups.Cgroup.create(self.cgroup_version, run_id, limits.memory_mb,
                                              limits.pids + _OVERHEAD_PIDS, limits.cpus)
            argv = self._argv(program, limits, workdir, group.procs_files() if group else [])
            return await self._spawn_and_wait(argv, host, limits, group)
        finally:
            if group is not None:
                await _empty(group)
                if not group.remove():
                    raise RuntimeError(f"sandbox cgroup {run_id} kept processes that would not die")
            shutil.rmtree(host, ignore_errors=True)

    async def _spawn_and_wait(self, argv: list[str], host: Path, limits: Limits, group) -> Result:
        stdin = os.open(host / "stdin", os.O_RDONLY)
        out = os.open(host / "stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(host / "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        status_r, status_w = os.pipe()
        started = time.monotonic()
        try:
            pid = os.posix_spawn(argv[0], argv, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, setsid=True, file_actions=[
                (os.POSIX_SPAWN_DUP2, stdin, 0), (os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_DUP2, err, 2),
                (os.POSIX_SPAWN_DUP2, status_w, _STATUS_FD),
            ])
        finally:
            for fd in (stdin, out, err, status_w):
                os.close(fd)
        with os.fdopen(status_r, "rb") as status_file:
            timed_out, cpu_exceeded, usage = await self._wait(pid, started, limits, group)
            status_text = status_file.read().decode(errors="replace")
        wall = time.monotonic() - started
        events = [json.loads(line) for line in status_text.splitlines() if line.strip().startswith("{")]
        exit_code = next((e["exit-code"] for e in events if "exit-code" in e), None)
        oom_kills = group.oom_kills() if group else 0
        if exit_code is None:
            if not (timed_out or cpu_exceeded or oom_kills):
                # bwrap reports an exit code whenever the program ran; without one, its set-up failed
                problem = read_capped(host / "stderr", 2000)[0].strip().splitlines() or ["no status from bwrap"]
                raise SandboxUnavailable(f"bubblewrap could not start the sandbox: {problem[-1]}")
            exit_code = 128 + signal.SIGKILL
        cpu = group.cpu_seconds() if group else usage.ru_utime + usage.ru_stime
        if limits.cpu_s is not None and (exit_code == 128 + signal.SIGXCPU or (cpu or 0) >= limits.cpu_s):
            cpu_exceeded = True
        stdout, cut_out = read_capped(host / "stdout", limits.output_bytes)
        stderr, cut_err = read_capped(host / "stderr", limits.output_bytes)
        reason = decide_reason(exit_code=exit_code, oom_kills=oom_kills, pids_hits=group.pids_hits() if group else 0,
                               timed_out=timed_out, cpu_exceeded=cpu_exceeded, truncated=cut_out or cut_err)
        return Result(exit_code=exit_code, stdout=stdout, stderr=stderr, reason=reason, wall_s=wall, cpu_s=cpu,
                      truncated=cut_out or cut_err, backend=self.name)

    async def _wait(self, pid: int, started: float, limits: Limits, group) -> tuple[bool, bool, resource.struct_rusage]:
        """Wait for the launcher to exit, killing the sandbox at the wall deadline or past the CPU
        budget; reaps it. Returns (timed out, CPU budget exceeded, rusage)."""
        exited = await _exit_waiter(pid)
        try:
            timed_out, cpu_exceeded = await watch_limits(exited, started + limits.wall_s, limits.cpu_s,
                                                         group.cpu_seconds if group is not None else None)
            if not exited.done():
                _kill_group(pid)  # bwrap's pid 1 dies with it, and the kernel empties its pid namespace
                if group is not None:
                    group.kill_all()
                await exited
            _, _, usage = os.wait4(pid, 0)
        except BaseException:
            _kill_group(pid)
            os.waitpid(pid, 0)
            raise
        finally:
            exited.cancel()
        return timed_out, cpu_exceeded, usage

    def close(self) -> None:
        shutil.rmtree(self._scratch, ignore_errors=True)


async def _exit_waiter(pid: int) -> asyncio.Future:
    """A future that completes when process `pid` exits (pidfd readability; no thread, no SIGCHLD)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    pidfd = os.pidfd_open(pid)

    def on_exit() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        if not future.done():
            future.set_result(None)

    def on_cancel(fut: asyncio.Future) -> None:
        if fut.cancelled():
            loop.remove_reader(pidfd)
            os.close(pidfd)

    loop.add_reader(pidfd, on_exit)
    future.add_done_callback(on_cancel)
    return future


async def _empty(group: cgroups.Cgroup, timeout_s: float = 2.0) -> None:
    """Kill stragglers (a dying pid-1 leaves its namespace a moment later) without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while group.procs() and time.monotonic() < deadline:
        group.kill_all()
        await asyncio.sleep(0.001)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
