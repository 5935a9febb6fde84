"""Well-behaved programs give the right output on both backends; the pool bounds concurrency."""

from __future__ import annotations

import asyncio
import time

import pytest

from factory.sandbox import Limits, Program, SandboxPool

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("clean_after")]


def test_hello_world(sandbox):
    result = sandbox.run_sync(Program.python("print('hello, world')"))
    assert (result.reason, result.exit_code, result.stdout, result.stderr) == ("ok", 0, "hello, world\n", "")
    assert result.ok and not result.truncated and result.backend == sandbox.name


def test_stdin_echo(sandbox):
    data = "line one\nünïcode ✓\n" * 100
    result = sandbox.run_sync(Program.python("import sys; sys.stdout.write(sys.stdin.read())", stdin=data))
    assert result.stdout == data


def test_reads_its_files_and_runs_as_nobody(sandbox):
    program = Program(
        files={"main.py": "import os, helper\nprint(helper.VALUE, open('data/in.txt').read(), len(open('blob.bin', 'rb').read()),"
                          " os.getuid(), os.getcwd(), os.environ['GREETING'])",
               "helper.py": "VALUE = 41 + 1", "data/in.txt": "payload", "blob.bin": bytes(range(256))},
        command=["python3", "main.py"], env={"GREETING": "hi"})
    result = sandbox.run_sync(program)
    assert result.stdout == "42 payload 256 65534 /work hi\n", result


def test_can_write_its_work_dir_and_tmp(sandbox):
    result = sandbox.run_sync(Program.python(
        "open('out.txt', 'w').write('a'); open('/tmp/t', 'w').write('b'); print(open('out.txt').read() + open('/tmp/t').read())"))
    assert result.stdout == "ab\n", result


def test_nonzero_exit_and_stderr(sandbox):
    result = sandbox.run_sync(Program.python("import sys; print('bad input', file=sys.stderr); sys.exit(3)"))
    assert (result.reason, result.exit_code, result.stderr) == ("exit_nonzero", 3, "bad input\n")


def test_uncaught_exception(sandbox):
    result = sandbox.run_sync(Program.python("raise ValueError('nope')"))
    assert result.reason == "exit_nonzero" and "ValueError: nope" in result.stderr


def test_state_does_not_leak_between_runs(sandbox):
    sandbox.run_sync(Program.python(
        "import os\nfor d in ('.', '/tmp', '/dev/shm'):\n"
        "    os.makedirs(d + '/locked/in', exist_ok=True); os.chmod(d + '/locked', 0)"))
    result = sandbox.run_sync(Program.python("import os; print(os.listdir('.'), os.listdir('/tmp'), os.listdir('/dev/shm'))"))
    assert result.stdout == "['main.py'] [] []\n", result


@pytest.mark.parametrize("name", ["/etc/passwd", "../escape.py", "a/../../b", ""])
def test_bad_file_names_are_refused(sandbox, name):
    with pytest.raises(ValueError, match="relative path"):
        sandbox.run_sync(Program(files={name: "x"}, command=["true"]))


def test_pool_bounds_concurrency(sandbox):
    async def scenario():
        pool = SandboxPool(sandbox, size=2)
        started = time.monotonic()
        results = await pool.run_many([Program.python(f"import time; time.sleep(0.4); print({i})") for i in range(4)],
                                      Limits(wall_s=10))
        return pool, time.monotonic() - started, results

    pool, elapsed, results = asyncio.run(scenario())
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert elapsed >= 0.8  # two waves of two
    metrics = pool.metrics()
    assert metrics["sandbox/runs"] == 4 and metrics["sandbox/reason/ok"] == 4 and metrics["sandbox/inflight"] == 0
