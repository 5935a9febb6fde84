"""Code rewards: run a candidate program against a task's unit tests in a sandbox.

The reward is the fraction of test cases that pass; `all_pass` says whether every one did. A test
case is one top-level statement of `check(candidate)` that contains an assert (statements without
one are set-up, run in order; if set-up fails, every case after it fails). Cases run one at a time
inside the sandbox, each under its own alarm, so one slow or failing case does not sink the others.

What the candidate can and cannot do to its score: it runs as an untrusted program in the sandbox
(no network, no host files, bounded time, memory and processes). Its own output goes to /dev/null;
the harness reports on a duplicated descriptor, each line tagged with a nonce the host sends on
stdin, so printing "pass" or exiting early earns nothing. Code that deliberately introspects the
harness in its own interpreter, or returns an object equal to everything, could still pass
`assert candidate(x) == y`: in-process unit tests cannot be made tamper-proof; the sandbox only
keeps such code away from the host.
"""

from __future__ import annotations

import ast
import re
import secrets
from dataclasses import asdict, dataclass
from typing import Any

from factory.sandbox.base import Limits, Program
from factory.core.types import Task

CASE_TIMEOUT_S = 3.0  # one test case's alarm inside the sandbox

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)

# Runs inside the sandbox (as main.py): argv = entry point, per-case seconds; stdin = the nonce.
HARNESS = r'''
import ast, os, signal, sys

nonce = sys.stdin.readline().strip()
report_fd = os.dup(1)
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)  # the candidate's prints go nowhere; reports go to report_fd
write = os.write


def report(*words):
    write(report_fd, (" ".join([nonce, *map(str, words)]) + "\n").encode())


class CaseTimeout(BaseException):
    pass


def on_alarm(signum, frame):
    raise CaseTimeout()


entry, case_s = sys.argv[1], float(sys.argv[2])
tests = open("tests.py").read()
candidate = open("candidate.py").read()
check = next(n for n in ast.parse(tests).body if isinstance(n, ast.FunctionDef) and n.name == "check")
arg = check.args.args[0].arg if check.args.args else "candidate"
units = [i for i, st in enumerate(check.body) if any(isinstance(n, ast.Assert) for n in ast.walk(st))]
namespace = {"__name__": "candidate"}
signal.signal(signal.SIGALRM, on_alarm)
try:
    signal.setitimer(signal.ITIMER_REAL, case_s)
    exec(compile(candidate, "candidate.py", "exec"), namespace)
    signal.setitimer(signal.ITIMER_REAL, 0)
    function = namespace[entry]
    exec(compile(tests, "tests.py", "exec"), namespace)
except BaseException as err:
    signal.setitimer(signal.ITIMER_REAL, 0)
    report("load_error", type(err).__name__)
    sys.exit(0)
scope = dict(namespace)
scope[arg] = function
if not units:  # no top-level assert: the whole check is one case
    steps = [(0, compile(f"check({arg})", "tests.py", "exec"), True)]
else:
    steps = [(i, compile(ast.Module(body=[st], type_ignores=[]), "tests.py", "exec"), i in units)
             for i, st in enumerate(check.body)]
broken = False
for i, code, is_case in steps:
    ok = False
    if not broken:
        try:
            signal.setitimer(signal.ITIMER_REAL, case_s)
            exec(code, scope)
            ok = True
        except BaseException as err:
            ok = False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    if is_case:
        report("case", i, "pass" if ok else "fail")
    elif not ok:
        broken = True  # set-up failed: the cases after it cannot run
report("done")
'''


@dataclass
class CodeScore:
    """How a candidate did on a task's tests. `reason`: "ok" (the tests ran), "no_code", "load_error"
    (the candidate did not define the entry point without raising), or the sandbox's reason for
    stopping (timeout, memory, ...)."""

    passed: int
    total: int
    reason: str
    detail: str = ""

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_pass(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fraction": self.fraction, "all_pass": self.all_pass}


def extract_code(completion: str | None, entry_point: str | None = None) -> str:
    """The program in a completion: a fenced block (the one defining `entry_point` if several do not,
    else the first Python one; an unclosed fence runs to the end), or the raw text when there is no fence."""
    if not completion:
        return ""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
    if not blocks:
        return completion.strip("\n").rstrip()
    if entry_point:
        defining = [b for _, b in blocks if _defines(b, entry_point)]
        if defining:
            return defining[0].rstrip()
    python = [b for lang, b in blocks if lang in ("", "python", "py", "python3")]
    return (python or [blocks[0][1]])[0].rstrip()


def _defines(code: str, name: str) -> bool:
    return re.search(rf"(?m)^(async\s+)?def\s+{re.escape(name)}\s*\(", code) is not None


def candidate_source(code: str, prompt: str, entry_point: str) -> str:
    """The module the tests import: the prompt (imports and helpers) then the candidate's full function,
    or, if the candidate is only a body, the prompt continued by it."""
    if _defines(code, entry_point):
        return prompt + "\n\n" + code + "\n"
    return prompt + code + "\n"


def count_cases(test: str) -> int:
    """How many test cases `check` holds (see the module docstring); a check without top-level
    asserts is one case."""
    try:
        tree = ast.parse(test)
    except SyntaxError as err:
        raise ValueError(f"test source does not parse: {err.msg} (line {err.lineno})") from None
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None:
        raise ValueError("test source defines no check(candidate) function")
    units = sum(any(isinstance(n, ast.Assert) for n in ast.walk(st)) for st in check.body)
    return units or 1


def harness_program(source: str, test: str, entry_point: str, nonce: str, case_s: float = CASE_TIMEOUT_S) -> Program:
    """The sandbox program that runs `source` against `test` and reports each case."""
    return Program(files={"main.py": HARNESS, "candidate.py": source, "tests.py": test},
                   command=["python3", "main.py", entry_point, str(case_s)], stdin=(nonce + "\n").encode())


def parse_report(stdout: str, nonce: str, total: int) -> tuple[int, str | None, bool]:
    """(cases passed, load error or None, whether the harness finished) from the harness's nonce-tagged
    lines; any other line is ignored."""
    passed: set[int] = set()
    failed: set[int] = set()
    load_error, done = None, False
    for line in stdout.splitlines():
        words = line.split()
        if len(words) < 2 or words[0] != nonce:
            continue
        if words[1] == "case" and len(words) == 4 and words[2].isdigit():
            (passed if words[3] == "pass" else failed).add(int(words[2]))
        elif words[1] == "load_error":
            load_error = words[2] if len(words) > 2 else "error"
        elif words[1] == "done":
            done = True
    return min(len(passed - failed), total), load_error, done


async def score_code(completion: str | None, task: Task, sandbox, limits: Limits | None = None,
                     case_s: float = CASE_TIMEOUT_S) -> CodeScore:
    """Run the code in `completion` against `task`'s tests in `sandbox` (a Sandbox or SandboxPool, under
    `limits` or else its own default limits)."""
    meta = task.metadata
    missing = [k for k in ("prompt", "entry_point", "test") if not isinstance(meta.get(k), str)]
    if missing:
        raise ValueError(f"task {task.task_id}: not a code task (metadata lacks {', '.join(missing)})")
    total = count_cases(meta["test"])
    code = extract_code(completion, meta["entry_point"])
    if not code.strip():
        return CodeScore(0, total, "no_code")
    nonce = secrets.token_hex(16)
    program = harness_program(candidate_source(code, meta["prompt"], meta["entry_point"]), meta["test"],
                           meta["entry_point"], nonce, case_s)
    result = await sandbox.run(program, limits)
    passed, load_error, done = parse_report(result.stdout, nonce, total)
    if load_error:
        return CodeScore(0, total, "load_error", load_error)
    if done:
        return CodeScore(passed, total, "ok")
    # the run ended before the harness did (a limit, or the candidate killed its own interpreter)
    reason = "exit_nonzero" if result.reason == "ok" else result.reason
    return CodeScore(passed, total, reason, result.stderr[-300:])


def is_code_task(task: Task) -> bool:
    return isinstance(task.metadata.get("test"), str) and isinstance(task.metadata.get("entry_point"), str)
