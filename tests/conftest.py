"""Suite-wide: every test under tests/integration/ and tests/infra/ carries the `integration` marker
(it starts servers: vLLM, Ray, Dagster, Postgres…), as do modules that declare it themselves, so
`pytest -m "not integration"` (`make unit`) is the fast part of the suite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

SERVER_DIRS = ("integration", "infra")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).parts
        if any(d in parts[-3:-1] for d in SERVER_DIRS):
            item.add_marker(pytest.mark.integration)
    _sglang_users_together(items)


# ---- the suite's own state -------------------------------------------------------------------
# Every test session runs in a state dir of its own (FACTORY_HOME: lake, MLflow, Dagster home, runs,
# caches), removed at the end; the variables that would point a test at the user's services are unset
# for the session. Only built things are shared from the user's state dir, as links to read: base
# policies (`models/tiny-*` with their sft.json: SFT is the slow part of a session) and SGLang's venv.
# The suite's own policies (tests/policies.py) are linked even while `make test` still builds them in
# the background, beside the suite's first tests: a test that needs one waits for that build
# (factory.training.base_policy.build_once builds at a link's target, under its lock), or builds it there itself.
# Any other policy the user's cache lacks is built in the session's own dir. FACTORY_KEEP_TEST_STATE=1
# keeps the session's dir.

USER_ENV = ("FACTORY_HOME", "MLFLOW_TRACKING_URI", "DAGSTER_HOME", "RAY_ADDRESS", "FACTORY_PROFILE",
            "FACTORY_ENV_FILE", "FACTORY_DEPLOYMENT")
SHARED_BUILDS = ("sglang-venv",)


def share_builds(user_home: Path, home: Path, suite: tuple[str, ...] = ()) -> list[Path]:
    """Link the user's built policies and SGLang venv into the session's state dir, and the suite's
    policies named in `suite` whether built yet or not; the links made."""
    links = []
    (home / "models").mkdir(parents=True, exist_ok=True)
    for built in sorted((user_home / "models").glob("tiny-*")):
        if (built / "sft.json").is_file() and built.name not in suite:  # complete: sft.json is published last
            links.append(home / "models" / built.name)
    links += [home / name for name in SHARED_BUILDS if (user_home / name).is_dir()]
    for link in links:
        link.symlink_to(user_home / link.relative_to(home), target_is_directory=True)
    return links + [p for p in (home / "models" / name for name in suite) if link_user_policy(p, user_home)]


def link_user_policy(path: Path, user_home: Path | str | None = None) -> bool:
    """In a test session, make `path` (a policy dir under the session's models/) a link to the user's
    state dir's policy of that name, built or not (see above); whether it made one (not outside a
    session, nor where `path` exists). `user_home`: the user's state dir (default: the session's record of it)."""
    import os

    user_home = user_home or os.environ.get("FACTORY_TEST_USER_HOME")
    if not user_home or path.is_symlink() or path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(Path(user_home) / "models" / path.name, target_is_directory=True)
    return True


def pytest_configure(config):
    import os
    import tempfile

    from factory.paths import REPO_ROOT
    from tests.policies import base_policy_names

    user_home = Path(os.environ.get("FACTORY_HOME", REPO_ROOT / ".state")).resolve()
    home = Path(tempfile.mkdtemp(prefix="factory-tests-")).resolve()
    saved = {name: os.environ.pop(name, None) for name in USER_ENV}
    os.environ["FACTORY_HOME"] = str(home)
    os.environ["FACTORY_TEST_USER_HOME"] = str(user_home)  # for the test that checks it stays untouched
    share_builds(user_home, home, base_policy_names())
    config.stash[_STATE] = (home, saved)
    config.stash[_ZYGOTES] = running_zygotes()


def running_zygotes() -> set[str]:
    from factory.rollout.zygote import running_zygotes

    return running_zygotes()


def pytest_collection_finish(session):
    """The production stack starts in the background when the session will test it (tests/infra/conftest.py),
    and the vLLM zygote (factory/rollout/zygote.py) when it will start vLLM servers: its imports (~10 s)
    run beside the first tests, and the servers it forks are the session's descendants (the CPU report)."""
    import os

    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("integration") for item in session.items):
        from factory.rollout.vllm import prestart_zygote

        session.config.stash[_ZYGOTE] = prestart_zygote()
    if os.environ.get("FACTORY_TEST_EARLY_STACK", "1") != "0" and any(
            Path(str(item.fspath)).parent.name == "infra" for item in session.items):
        from tests.infra.conftest import start_early

        start_early()


def pytest_unconfigure(config):
    import os
    import shutil
    import sys

    infra = sys.modules.get("tests.infra.conftest")
    if infra is not None:
        infra.stop_early()
    if _ZYGOTES in config.stash:  # the zygotes this session started (ours, or its runs' Ray actors')
        from factory.rollout.zygote import stop_named

        for name in running_zygotes() - config.stash[_ZYGOTES]:
            stop_named(name)
        if (zygote := config.stash.get(_ZYGOTE, None)) is not None:
            zygote.wait(timeout=30)
    home, saved = config.stash.get(_STATE, (None, {}))
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.environ.pop("FACTORY_TEST_USER_HOME", None)
    if home is not None and not os.environ.get("FACTORY_KEEP_TEST_STATE"):
        shutil.rmtree(home, ignore_errors=True)  # links only: the user's builds stay


_STATE = pytest.StashKey[tuple]()
_ZYGOTES = pytest.StashKey[set]()  # the zygotes running before the session (not ours to stop)
_ZYGOTE = pytest.StashKey[Any]()  # the zygote the session started itself (its child)


# ---- one SGLang server per session ------------------------------------------------------------
# Starting SGLang costs ~25-40 s here; its tests (tests/rollout/test_sglang.py, the runs in
# tests/integration/test_sglang_run.py) share one server, behind the EngineActor a run uses: runs take
# it as `engines=[sglang_engine]`, the engine tests send requests to its url through clients of their own.


def require_sglang() -> str:
    """SGLang's python, or a failure naming the set-up script (CI builds the venv: no skip)."""
    import subprocess

    from factory.rollout.sglang import VENV_HINT, sglang_python

    python = sglang_python()
    probe = subprocess.run([python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.fail(f"no SGLang to test against ({python} cannot import sglang): {VENV_HINT}", pytrace=False)
    return python


@pytest.fixture(scope="session")
def sglang_engine(tmp_path_factory):
    """The session's SGLang server (the tiny test policy, a 1 GB KV pool) behind an EngineActor, in
    the session's local Ray (started here unless a fixture already did)."""
    import time

    import ray

    from factory.training.base_policy import ensure_base_policy
    from factory.runtime.actors import EngineActor
    from factory.runtime.cluster import local_ray
    from tests.integration.conftest import small_recipe

    require_sglang()
    recipe = small_recipe("rollout.engine=sglang", "rollout.kv_cache_gb=1")
    policy = ensure_base_policy(recipe)
    with local_ray():
        log = tmp_path_factory.mktemp("sglang") / "server.log"
        actor = EngineActor.remote("sglang", str(policy), recipe.rollout, str(log))
        t0 = time.perf_counter()
        ray.get(actor.start.remote())
        print(f"SGLang server ready in {time.perf_counter() - t0:.1f} s")
        _SGLANG["stop"] = lambda: ray.get(actor.stop.remote())
        yield actor
        _stop_sglang()


# The shared server (~2 GB; before --sleep-on-idle its idle scheduler also held a core) must not outlive its tests.
# Its users run back to back (collection order), and it stops after the last one, not at session end.
_SGLANG: dict = {}


def _stop_sglang() -> None:
    stop = _SGLANG.pop("stop", None)
    if stop is not None:
        stop()


def _sglang_users_together(items) -> None:
    users = [item for item in items if "sglang_engine" in getattr(item, "fixturenames", ())]
    if not users:
        return
    ids = {id(item) for item in users}
    first = next(i for i, item in enumerate(items) if id(item) in ids)
    rest = [item for item in items if id(item) not in ids]
    items[:] = rest[:first] + users + rest[first:]
    _SGLANG["last"] = users[-1].nodeid


def pytest_runtest_teardown(item, nextitem):
    if item.nodeid == _SGLANG.get("last"):
        _stop_sglang()


# ---- CPU per test (printed after pytest's --durations) -------------------------------------------
# The suite is CPU-bound on 2 cores (two pytest workers make every test 1.5-2x slower), so
# what shortens it is less CPU, and wall time alone hides where CPU goes. Each test's CPU is that of
# this process's tree over the test: every live process's own and reaped children's CPU seconds
# (/proc/<pid>/stat utime, stime, cutime, cstime), so servers started by fixtures count toward the
# tests that kept them busy. A process that leaves the tree takes its CPU with it (a daemon that
# double-forks, as the production stack's supervisor does, so tests/infra/ counts only its client;
# Ray's agents, orphaned when a cluster shuts down): a test that loses one counts 0. A lower bound.

_CPU: dict[str, float] = {}


def _tree_cpu_s() -> float:
    import os

    import psutil

    ticks = os.sysconf("SC_CLK_TCK")
    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        except (OSError, psutil.Error, IndexError, ValueError):
            continue  # gone meanwhile
    return total / ticks


def _machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all cores, every process: /proc/stat's first line less
    idle and iowait), so work outside this process's tree (a double-forked daemon, dockerd's containers,
    the background policy build) counts too."""
    import os

    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


_TIMES: dict[str, dict[str, float]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import time

    before, busy, t0 = _tree_cpu_s(), _machine_busy_s(), time.monotonic()
    yield
    _CPU[item.nodeid] = max(0.0, _tree_cpu_s() - before)
    _TIMES[item.nodeid] = {"wall_s": round(time.monotonic() - t0, 2), "tree_cpu_s": round(_CPU[item.nodeid], 2),
                           "machine_cpu_s": round(_machine_busy_s() - busy, 2)}


def pytest_terminal_summary(terminalreporter):
    if not _CPU:
        return
    _write_times(terminalreporter)
    top = sorted(_CPU.items(), key=lambda kv: -kv[1])[:30]
    terminalreporter.write_sep("=", f"most CPU: 30 of {len(_CPU)} tests, {sum(_CPU.values()):.0f} CPU-s in all")
    for nodeid, seconds in top:
        terminalreporter.write_line(f"{seconds:8.1f} CPU-s  {nodeid}")


def _write_times(terminalreporter) -> None:
    """Each test's wall time, its tree's CPU and the machine's, as JSON in $FACTORY_TEST_TIMES (a path) when
    set; the line says how busy the 2 cores were over the suite (a suite that waits is shortened by waiting
    less, one that computes by computing less)."""
    import json
    import os

    wall = sum(t["wall_s"] for t in _TIMES.values())
    busy = sum(t["machine_cpu_s"] for t in _TIMES.values())
    cores = os.cpu_count() or 1
    if wall:
        terminalreporter.write_sep("=", f"machine busy over the tests: {busy:.0f} CPU-s of {wall * cores:.0f} "
                                        f"({busy / (wall * cores):.0%} of {cores} cores over {wall:.0f} s)")
    path = os.environ.get("FACTORY_TEST_TIMES")
    if path:
        Path(path).write_text(json.dumps(_TIMES, indent=1))
