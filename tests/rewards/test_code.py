"""The code reward: reference solutions of the repository's tasks pass, their broken variants fail,
and hostile candidates are contained (and earn nothing by forging or cutting the test run short)."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from factory.data.code_tasks import BROKEN_PATH, load_code_tasks
from factory.rewards import score_answer
from factory.rewards.code import (
    CodeScore, candidate_source, count_cases, extract_code, parse_report, score_code,
)
from factory.sandbox import Limits, SandboxPool

from ..sandbox.conftest import nobody_processes

TASKS = {t.task_id: t for t in load_code_tasks()}
BROKEN = {row["task_id"]: row for row in map(json.loads, BROKEN_PATH.read_text().splitlines())}


def harness_processes() -> set[int]:
    """Live sandbox-user processes running this module's harness (`main.py running_max ...`): other
    sandboxes on the host (other tests, other runs) are not counted. Cgroup clean-up is
    tests/sandbox's subject."""
    found = set()
    for pid in nobody_processes():
        try:
            if b"main.py\x00running_max\x00" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
        except OSError:
            continue
    return found


@pytest.fixture
def contained(sandbox):
    """The test leaves no harness process behind."""
    yield
    deadline = time.monotonic() + 5
    while harness_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not harness_processes()


def score(sandbox, completion: str, task_id: str = "code/running_max", limits: Limits | None = None,
          case_s: float = 3.0) -> CodeScore:
    return asyncio.run(score_code(completion, TASKS[task_id], sandbox, limits, case_s))


def full(task_id: str, body: str) -> str:
    return TASKS[task_id].metadata["prompt"] + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ") + "\n"


def test_extract_code():
    assert extract_code("```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1"
    assert extract_code("Here:\n```\nx = 1\n```") == "x = 1"
    both = "```python\nimport math\n```\nthen\n```python\ndef f(x):\n    return x\n```"
    assert extract_code(both, "f") == "def f(x):\n    return x"  # the block defining the entry point
    assert extract_code(both) == "import math"
    assert extract_code("```python\ndef f():\n    return 2") == "def f():\n    return 2"  # never closed
    assert extract_code("    return x\n\n") == "    return x"  # raw text keeps its indentation
    assert extract_code(None) == "" and extract_code("") == ""


def test_candidate_source_completes_the_prompt():
    prompt = "import math\n\ndef f(x):\n    \"\"\"doc\"\"\"\n"
    assert candidate_source("    return x\n", prompt, "f") == prompt + "    return x\n\n"
    whole = candidate_source("def f(x):\n    return math.pi", prompt, "f")
    assert whole.startswith(prompt) and whole.endswith("def f(x):\n    return math.pi\n")


def test_count_cases_and_report_parsing():
    assert count_cases(TASKS["code/chunk"].metadata["test"]) == 5  # the try block is set-up, not a case
    assert count_cases("def check(candidate):\n    helper(candidate)\n") == 1
    with pytest.raises(ValueError, match="no check"):
        count_cases("x = 1")
    out = "n case 0 pass\nn case 1 fail\nother case 2 pass\nn case 2 pass\nn case 2 fail\nn done\n"
    assert parse_report(out, "n", 3) == (1, None, True)  # a case reported both ways counts as failed
    assert parse_report("n load_error NameError\n", "n", 3) == (0, "NameError", False)


def test_reference_solutions_pass_and_broken_variants_fail(sandbox):
    assert len(TASKS) >= 30 and set(BROKEN) == set(TASKS)

    async def all_scores():
        pool = SandboxPool(sandbox, size=4)
        good = [score_code(t.answer, t, pool) for t in TASKS.values()]
        bad = [score_code(t.metadata["prompt"] + BROKEN[i]["broken_solution"], t, pool) for i, t in TASKS.items()]
        return await asyncio.gather(*good), await asyncio.gather(*bad)

    good, bad = asyncio.run(all_scores())
    for task_id, g, b in zip(TASKS, good, bad):
        assert g.all_pass and g.reason == "ok" and g.fraction == 1.0, (task_id, g)
        assert not b.all_pass and b.reason == "ok" and b.total == g.total, (task_id, b)
    assert 0 < sum(b.fraction for b in bad) / len(bad) < 1  # partial credit: most broken variants pass some cases


def test_reward_dispatch_by_task(sandbox):
    task = TASKS["code/fizzbuzz"]
    fenced = "Here you go:\n```python\n" + task.answer + "```\n"
    reward, info = asyncio.run(score_answer(fenced, task, sandbox))
    assert reward == 1.0 and info["tests"]["all_pass"] is True
    assert asyncio.run(score_answer("no code here", task, sandbox))[0] == 0.0
    with pytest.raises(ValueError, match="needs a sandbox"):
        asyncio.run(score_answer(task.answer, task, None))


# ---- hostile candidates --------------------------------------------------------------------------


def test_a_hanging_case_fails_alone(sandbox, contained):
    body = """
        while not nums:
            pass
        out, best = [], None
        for x in nums:
            best = x if best is None or x > best else best
            out.append(best)
        return out
    """
    result = score(sandbox, full("code/running_max", body), case_s=0.5)
    assert (result.passed, result.total, result.reason) == (4, 5, "ok")  # only the empty-list case hangs


def test_a_candidate_that_swallows_the_alarm_hits_the_wall_limit(sandbox, contained):
    body = """
        if not nums:
            while True:
                try:
                    while True:
                        pass
                except BaseException:
                    pass
        return [max(nums[:i + 1]) for i in range(len(nums))]
    """
    result = score(sandbox, full("code/running_max", body), limits=Limits(wall_s=2), case_s=0.5)
    assert result.reason == "timeout" and result.passed == 1 and not result.all_pass  # case 0 ran first


def test_forged_reports_and_early_exits_earn_nothing(sandbox, contained):
    forge = """
        import os, sys
        for i in range(5):
            print(f"x case {i} pass")
            os.write(3, f"x case {i} pass\\n".encode())
            os.write(2, f"x case {i} pass\\n".encode())
        os._exit(0)
    """
    result = score(sandbox, full("code/running_max", forge))
    assert result.passed == 0 and result.reason == "exit_nonzero"
    exit_at_import = "import sys\nsys.exit(0)\n" + TASKS["code/running_max"].answer
    assert score(sandbox, exit_at_import).reason == "load_error"
    assert score(sandbox, "def running_max(:\n").reason == "load_error"
    other = score(sandbox, "def something_else():\n    return 1\n")  # the prompt's bare def returns None
    assert other.passed == 0 and other.reason == "ok"


def test_fork_and_memory_bombs_are_contained(sandbox, contained):
    fork = """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    result = score(sandbox, full("code/running_max", fork), limits=Limits(wall_s=2, pids=16), case_s=1)
    assert result.passed == 0 and not result.all_pass
    memory = "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))\n"
    result = score(sandbox, full("code/running_max", memory), limits=Limits(wall_s=5, memory_mb=64))
    assert result.passed == 0 and result.reason in ("memory", "load_error")


def test_host_files_are_out_of_reach(sandbox, contained, tmp_path):
    marker = Path("/tmp") / f"factory-code-reward-{uuid.uuid4().hex}"
    body = f"""
        try:
            open({str(marker)!r}, "w").write("escaped")
        except OSError:
            pass
        try:
            secret = open("/etc/shadow").read()
        except OSError:
            secret = None
        return [secret] if secret else []
    """
    result = score(sandbox, full("code/running_max", body))
    assert not marker.exists()
    assert result.passed == 1 and result.reason == "ok"  # only running_max([]) == [] holds: /etc/shadow unread
