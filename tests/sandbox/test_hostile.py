"""Hostile programs on both backends: each is contained, reported with the right reason, leaves no
process, container or cgroup behind, and leaves the host unchanged."""

from __future__ import annotations

import json
import os
import socket
import textwrap
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from factory.paths import REPO_ROOT
from factory.sandbox import Limits, Program

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("clean_after")]

FAST = Limits(wall_s=2, memory_mb=64, pids=16, output_bytes=4096)


def py(source: str, **kw) -> Program:
    return Program.python(textwrap.dedent(source), **kw)


def test_fork_bomb(sandbox):
    result = sandbox.run_sync(py("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """), Limits(wall_s=1, memory_mb=128, pids=16))
    assert result.reason == "pids", result
    assert result.wall_s < 4


def test_memory_bomb(sandbox):
    result = sandbox.run_sync(py("""
        chunks = []
        while True:
            chunks.append(bytearray(8 << 20))
    """), FAST)
    assert result.reason == "memory", result
    assert result.wall_s < 2


def test_infinite_loop(sandbox):
    result = sandbox.run_sync(py("while True: pass"), Limits(wall_s=1))
    assert result.reason == "timeout", result
    assert 1 <= result.wall_s < 3


def test_sleep_past_timeout(sandbox):
    result = sandbox.run_sync(py("import time; print('going to sleep', flush=True); time.sleep(60)"), Limits(wall_s=1))
    assert result.reason == "timeout", result
    assert result.stdout == "going to sleep\n"
    assert result.wall_s < 3


def test_busy_cpu_over_budget(sandbox):
    """Two spinning processes exhaust a 1 s CPU budget well before the 10 s wall limit."""
    result = sandbox.run_sync(py("""
        import os
        os.fork()
        while True:
            pass
    """), Limits(wall_s=10, cpu_s=1, cpus=2))
    assert result.reason == "cpu", result
    assert result.wall_s < 4


def test_cpu_rate_is_capped(sandbox):
    """With cpus=0.5 a spinning program gets about half a core."""
    result = sandbox.run_sync(py("""
        import time
        end = time.time() + 1.5
        while time.time() < end:
            pass
    """), Limits(wall_s=5, cpus=0.5))
    assert result.reason == "ok", result
    assert result.cpu_s is not None and result.cpu_s < 1.0, result


def test_huge_output(sandbox):
    result = sandbox.run_sync(py("while True: print('x' * 1000)"), FAST)
    assert result.reason == "output_limit", result
    assert result.truncated and len(result.stdout) == FAST.output_bytes


def test_huge_output_from_c_program(sandbox):
    result = sandbox.run_sync(Program(command=["yes"]), FAST)
    assert result.reason == "output_limit", result
    assert result.stdout.startswith("y\ny\n") and len(result.stdout) == FAST.output_bytes


def test_network_is_unreachable(sandbox):
    """Neither the host's loopback services nor an outside address (TEST-NET-1, never routed) answer."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0)
    port = server.getsockname()[1]
    try:
        result = sandbox.run_sync(py(f"""
            import errno, json, socket
            out = {{}}
            for name, addr in {{"host_loopback": ("127.0.0.1", {port}), "external": ("192.0.2.1", 80)}}.items():
                try:
                    socket.create_connection(addr, timeout=1).close()
                    out[name] = "connected"
                except OSError as err:
                    out[name] = errno.errorcode.get(err.errno, str(err))
            try:
                socket.getaddrinfo("example.com", 80)
                out["dns"] = "resolved"
            except OSError as err:
                out["dns"] = "failed"
            out["interfaces"] = [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]]
            print(json.dumps(out))
        """), FAST)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host's listener
    finally:
        server.close()
    assert result.reason == "ok", result
    out = json.loads(result.stdout)
    assert out["host_loopback"] == "ECONNREFUSED"
    assert out["external"] == "ENETUNREACH"
    assert out["dns"] == "failed"
    assert out["interfaces"] == ["lo"]


def test_reading_host_secrets_fails(sandbox):
    result = sandbox.run_sync(py(f"""
        import json, os
        out = {{}}
        for path in ["/etc/shadow", "/root", "{REPO_ROOT / 'pyproject.toml'}", "/var/run/docker.sock", "/run/docker.sock"]:
            try:
                if os.path.isdir(path):
                    os.listdir(path)
                else:
                    open(path, "rb").read(1)
                out[path] = "read"
            except OSError as err:
                out[path] = type(err).__name__
        import socket
        for path in ["/var/run/docker.sock", "/run/docker.sock"]:
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(path)
                out["connect " + path] = "connected"
            except OSError as err:
                out["connect " + path] = type(err).__name__
        print(json.dumps(out))
    """), FAST)
    assert result.reason == "ok", result
    out = json.loads(result.stdout)
    assert out and all(v != "read" and v != "connected" for v in out.values()), out


def test_writing_outside_the_sandbox_fails(sandbox, tmp_path):
    """Writes to the root fs fail; writes to /tmp and /dev/shm land in private tmpfs, not the host's."""
    token = uuid.uuid4().hex
    canary = Path("/tmp") / f"factory-canary-{token}"
    canary.write_text("untouched")
    shm_canary = Path("/dev/shm") / f"factory-canary-{token}"
    repo_target = REPO_ROOT / f"factory-canary-{token}"
    try:
        result = sandbox.run_sync(py(f"""
            import json
            out = {{}}
            for path in ["/etc/factory-{token}", "/usr/factory-{token}", "/factory-{token}", "{repo_target}",
                         "{canary}", "{shm_canary}"]:
                try:
                    with open(path, "w") as f:
                        f.write("pwned")
                    out[path] = "written"
                except OSError as err:
                    out[path] = type(err).__name__
            print(json.dumps(out))
        """), FAST)
        assert result.reason == "ok", result
        out = json.loads(result.stdout)
        for path in (f"/etc/factory-{token}", f"/usr/factory-{token}", f"/factory-{token}", str(repo_target)):
            assert out[path] != "written", out
            assert not Path(path).exists()
        assert canary.read_text() == "untouched"  # the sandbox's /tmp is its own
        assert not shm_canary.exists()
    finally:
        canary.unlink(missing_ok=True)
        shm_canary.unlink(missing_ok=True)


@pytest.mark.parametrize("attack", ["ppid", "pid1", "own_group", "everyone"])
def test_killing_the_parent(sandbox, attack):
    """The program can kill at most its own sandbox; a run beside it and the host are unaffected."""
    kill = {"ppid": "os.kill(os.getppid(), 9)", "pid1": "os.kill(1, 9)", "own_group": "os.killpg(0, 9)",
            "everyone": "os.kill(-1, 9)"}[attack]
    hostile = py(f"""
        import os, time
        try:
            {kill}
        except OSError as err:
            print("refused", err)
        time.sleep(0.3)
        print("alive")
    """)
    bystander = py("import time; time.sleep(0.8); print('bystander ok')")
    with ThreadPoolExecutor(2) as threads:
        other = threads.submit(sandbox.run_sync, bystander, Limits(wall_s=10))
        result = sandbox.run_sync(hostile, Limits(wall_s=5))
        assert other.result().stdout == "bystander ok\n"
    assert os.getppid() > 1  # the test process and its parent live on
    expected = {
        # bubblewrap: pid 1 of the sandbox is bwrap's init, which the kernel shields from its namespace
        ("bubblewrap", "ppid"): "ok", ("bubblewrap", "pid1"): "ok", ("bubblewrap", "everyone"): "ok",
        ("docker", "pid1"): "ok",  # docker-init is pid 1, shielded the same way
    }.get((sandbox.name, attack), "killed")  # else the program took down its own supervisor or itself
    assert result.reason == expected, result
    assert sandbox.run_sync(py("print('still works')")).stdout == "still works\n"


def test_daemonized_child_does_not_survive(sandbox):
    result = sandbox.run_sync(py("""
        import subprocess
        subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print("spawned")
    """), FAST)
    assert result.reason == "ok" and result.stdout == "spawned\n", result


def test_program_cannot_reach_host_files_through_links(sandbox):
    """Links the program plants in its work dir must not make the host read or write through them."""
    result = sandbox.run_sync(py("""
        import os
        for name in ("link_to_shadow", "main2.py"):
            os.symlink("/etc/shadow", name)
        for io in ("/io/stdout", "/io/stderr"):
            try:
                os.remove(io)
                os.symlink("/etc/shadow", io)
            except OSError:
                pass
        print("planted")
    """), FAST)
    assert "root:" not in result.stdout + result.stderr
    again = sandbox.run_sync(Program(files={"main2.py": "print('fresh')"}, command=["python3", "main2.py"]), FAST)
    assert again.stdout == "fresh\n", again
