"""The fork server (factory/rollout/zygote.py) with a small probe module instead of vLLM: what a forked
process gets (its own session, the request's argv, environment, cwd and log), its exit status on the
requester's handle, one zygote for many forks, a server outliving its zygote, a zygote that cannot
import its module, and another uid. (A forked vLLM server against a spawned one:
tests/integration/test_vllm_zygote.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from factory.paths import REPO_ROOT
from factory.rollout.server import ServerProcess
from factory.rollout.zygote import (
    ForkedProcess,
    ZygoteUnavailable,
    fork_server,
    running_zygotes,
    stop_named,
    _code_fingerprint,
    zygote_name,
)

PROBE = """
import json, os, sys, time
if os.environ.get("PROBE_MAIN_ONLY") and __name__ != "__main__":
    raise ImportError("this module runs only as a program")
if __name__ == "__main__":
    out, mode, code = sys.argv[1:4]
    print("probe says hello", flush=True)
    with open(out, "w") as f:
        json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("PROBE"), "pid": os.getpid(),
                   "pgid": os.getpgid(0), "sid": os.getsid(0), "ppid": os.getppid()}, f)
    if mode == "sleep":
        time.sleep(600)
    sys.exit(int(code))
"""


@pytest.fixture
def probe(tmp_path):
    """A module to fork, and an environment naming a zygote of this test's own (its PYTHONPATH)."""
    (tmp_path / "zyg_probe.py").write_text(textwrap.dedent(PROBE))
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)]),
           "PROBE": "from the request", "FACTORY_VLLM_ZYGOTE_IDLE_S": "120"}
    yield tmp_path, env
    stop_named(zygote_name("zyg_probe", env))


def argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "zyg_probe", *args]


def test_a_forked_process_is_a_session_of_its_own_with_the_request_s_argv_env_cwd_log_and_exit_status(probe):
    tmp, env = probe
    (tmp / "wd").mkdir()
    zlog = tmp / "zygote.log"
    first = fork_server(argv(str(tmp / "a.json"), "exit", "3"), env, tmp / "a.log", cwd=str(tmp / "wd"),
                        zygote_log=zlog, timeout_s=60)
    assert isinstance(first, ForkedProcess) and first.wait(timeout=60) == 3
    seen = json.loads((tmp / "a.json").read_text())
    assert seen["argv"] == [str(tmp / "a.json"), "exit", "3"] and seen["cwd"] == str(tmp / "wd")
    assert seen["probe"] == "from the request"
    assert seen["pid"] == seen["pgid"] == seen["sid"] == first.pid  # what start_new_session=True gives
    assert "probe says hello" in (tmp / "a.log").read_text()
    zygote = seen["ppid"]
    assert zygote != os.getpid() and psutil.Process(zygote).ppid() != os.getpid()  # detached: nobody's child

    second = fork_server(argv(str(tmp / "b.json"), "exit", "0"), dict(env, PROBE="another"), tmp / "b.log",
                         zygote_log=zlog, timeout_s=60)
    assert second.wait(timeout=60) == 0
    seen = json.loads((tmp / "b.json").read_text())
    assert seen["ppid"] == zygote and seen["probe"] == "another"  # the same zygote, the request's environment
    assert zlog.read_text().count("imported zyg_probe") == 1

    name = zygote_name("zyg_probe", env)
    assert name in running_zygotes() and stop_named(name)
    deadline = time.monotonic() + 20
    while name in running_zygotes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert name not in running_zygotes()


def test_a_server_outlives_its_zygote_and_its_handle_still_sees_it_end(probe):
    tmp, env = probe
    proc = fork_server(argv(str(tmp / "s.json"), "sleep", "0"), env, tmp / "s.log", zygote_log=tmp / "z.log",
                       timeout_s=60)
    # its own session before its pid is known: the owner's reaper, started as the pid arrives, watches
    # that group (before, the reaper could find no group yet and quit, leaving the server unwatched)
    assert os.getpgid(proc.pid) == os.getsid(proc.pid) == proc.pid
    deadline = time.monotonic() + 30
    while not (tmp / "s.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert psutil.Process(proc.pid).cmdline() == argv(str(tmp / "s.json"), "sleep", "0")  # what `ps` shows
    assert stop_named(zygote_name("zyg_probe", env))
    assert proc.poll() is None and psutil.pid_exists(proc.pid)
    proc.kill()
    assert proc.wait(timeout=20) == -1  # gone; its status went with the zygote
    again = fork_server(argv(str(tmp / "t.json"), "sleep", "0"), env, tmp / "t.log", zygote_log=tmp / "z.log",
                        timeout_s=60)  # a new zygote for the next request
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            again.wait(timeout=0.3)
    finally:
        again.kill()
    assert again.wait(timeout=20) == -9


def test_a_zygote_that_cannot_import_its_module_is_reported_at_once_and_the_server_is_spawned(probe):
    tmp, env = probe
    env = dict(env, PROBE_MAIN_ONLY="1")
    start = time.monotonic()
    with pytest.raises(ZygoteUnavailable, match="without forking; see "):
        fork_server(argv(str(tmp / "x.json"), "exit", "0"), env, tmp / "x.log", zygote_log=tmp / "z.log",
                    timeout_s=120)
    assert time.monotonic() - start < 60  # not the whole timeout
    assert "this module runs only as a program" in (tmp / "z.log").read_text()

    class Probe(ServerProcess):
        zygote = True

    server = Probe()
    server.args, server.env, server.log_path = argv(str(tmp / "y.json"), "exit", "0"), env, tmp / "y.log"
    server.launch()
    assert isinstance(server.proc, subprocess.Popen) and server.proc.wait(timeout=60) == 0
    assert json.loads((tmp / "y.json").read_text())["ppid"] == os.getpid()  # spawned, as before


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_another_uid_is_not_served(probe):
    tmp, env = probe
    assert fork_server(argv(str(tmp / "a.json"), "exit", "0"), env, tmp / "a.log", zygote_log=tmp / "z.log",
                       timeout_s=60).wait(timeout=60) == 0
    request = json.dumps({"argv": [str(tmp / "evil.json"), "exit", "0"], "env": env, "cwd": "/", "log": "/dev/null"})
    code = ("import socket, sys\ns = socket.socket(socket.AF_UNIX); s.connect('\\0' + sys.argv[1])\n"
            "try:\n    s.sendall(sys.argv[2].encode() + b'\\n'); s.settimeout(20)\n    print(repr(s.recv(100)))\n"
            "except (ConnectionResetError, BrokenPipeError):  # closed before or after the request was sent\n"
            "    print('reset')")
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable  # the venv may be root's only
    out = subprocess.run([python, "-c", code, zygote_name("zyg_probe", env), request], text=True, cwd="/",
                         capture_output=True, timeout=60, user=65534)
    assert out.stdout.strip() in ("b''", "reset"), out  # closed unanswered
    assert not (tmp / "evil.json").exists()


def test_a_zygote_is_named_by_what_its_imports_read_not_by_what_they_set_or_what_each_server_brings():
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/a", "FACTORY_VLLM_FORK_ENGINE_CORE": "1", "HF_HUB_OFFLINE": "1"}
    name = zygote_name("m", base)
    # set by torch's and vLLM's own imports in a requester that had imported them (seen under Ray)
    assert zygote_name("m", dict(base, KMP_INIT_AT_FORK="FALSE", KMP_DUPLICATE_LIB_OK="True",
                                 TORCHINDUCTOR_CACHE_DIR="/tmp/x", TOKENIZERS_PARALLELISM="false")) == name
    # each server's own, applied in the forked child
    assert zygote_name("m", dict(base, VLLM_CACHE_ROOT="/elsewhere", OMP_NUM_THREADS="2",
                                 VLLM_CPU_KVCACHE_SPACE="1", RAY_ADDRESS="x")) == name
    # what the zygote's imports read: other code, other hooks, other settings
    for changed in ({"PYTHONPATH": "/b"}, {"FACTORY_VLLM_FORK_ENGINE_CORE": "0"}, {"HF_HUB_OFFLINE": "0"},
                    {"VLLM_LOGGING_LEVEL": "DEBUG"}, {"TORCHDYNAMO_DISABLE": "1"}):
        assert zygote_name("m", dict(base, **changed)) != name, changed
    assert zygote_name("other.module", base) != name
    # and the files it holds in memory: our vLLM hooks and this module (an edit names a new zygote)
    held = {Path(path).name for path, *_ in _code_fingerprint("json")}
    assert {"zygote.py", "sitecustomize.py", "factory_routes.py", "lean_imports.py", "__init__.py"} <= held
