"""A sandbox health check: a known-good program must succeed and known-bad ones must be stopped for
the right reason (the basis of `factory sandbox check` and the Dagster asset check)."""

from __future__ import annotations

from factory.sandbox.base import Limits, Program, Sandbox

# name -> (program, limits, expected reason, expected stdout or None)
HEALTH_PROGRAMS: dict[str, tuple[Program, Limits, str, str | None]] = {
    "hello": (Program.python("print('hello from the sandbox')"), Limits(wall_s=10), "ok", "hello from the sandbox\n"),
    "stdin_echo": (Program.python("import sys; print(sys.stdin.read().upper())", stdin="ping"), Limits(wall_s=10), "ok",
                   "PING\n"),
    "infinite_loop": (Program.python("while True: pass"), Limits(wall_s=1), "timeout", None),
    "memory_bomb": (Program.python("a = []\nwhile True: a.append(bytearray(1 << 24))"),
                    Limits(wall_s=10, memory_mb=64), "memory", None),
}


async def check_sandbox(sandbox: Sandbox) -> dict:
    """Run HEALTH_PROGRAMS; `ok` is True iff every one ended as expected. Memory needs cgroups: where
    the backend has none (bubblewrap unprivileged), an allocation failure ("exit_nonzero") also passes."""
    checks = {}
    for name, (program, limits, want, stdout) in HEALTH_PROGRAMS.items():
        result = await sandbox.run(program, limits)
        accepted = {want}
        if want == "memory" and getattr(sandbox, "cgroup_version", "present") is None:
            accepted |= {"exit_nonzero", "killed"}
        passed = result.reason in accepted and (stdout is None or result.stdout == stdout)
        checks[name] = {"expected": want, "reason": result.reason, "passed": passed, "wall_s": round(result.wall_s, 3),
                        "exit_code": result.exit_code, "stderr_tail": result.stderr[-200:]}
    return {"backend": sandbox.name, "ok": all(c["passed"] for c in checks.values()), "checks": checks}
