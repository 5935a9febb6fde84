"""Every command in the docs runs: the ```bash and ```yaml blocks of README.md and the getting-started,
recipes and own-model-and-data pages (tests/docs/blocks.py: which pages, the markers above a fence).

- A yaml block validates as a recipe or a fragment of one (every field has a default), and passes this
  machine's checks (`machine_problems`: a model.path that exists, an engine installed) unless marked skip.
  Pure and fast: the suite's unit part.
- A shell block runs as one bash script (`set -e`) from the repo root, with .state/venv/bin first on PATH
  and `.state` read as a state dir of its own per page (FACTORY_HOME), in which the suite's built tiny
  policies are linked: nothing is retrained. Its `factory run` lines get the block's overrides and must
  reach one of the suite's policies (tests/policies.py). A command that starts a server which stays up
  (`SERVERS`) runs in the background, on a free port, until that port answers HTTP, and is then stopped
  by its process group. `make main` and `make test` are not run (`NOT_RUN_MAKE`): their targets must
  exist. Files a block writes into the checkout (`> recipe.schema.json`) are removed after it. These are
  `integration` tests (real runs); the checks that need no run are unit tests.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.docs import blocks
from tests.docs.blocks import Block, MarkerError, Server

REPO = Path(__file__).resolve().parents[2]

# Commands that start a server which stays up until stopped: (first words, the flag that sets its port, what).
SERVERS = (
    Server("python -m assets", "-p", "Dagster's UI and daemon (dagster dev)"),
    Server("mlflow ui", "--port", "MLflow's UI"),
    Server("mlflow server", "--port", "an MLflow tracking server"),
    Server("factory serve", "--port", "a vLLM engine runs attach to"),
)
SERVER_TIMEOUT_S = 180  # to answer HTTP, on 2 cores beside the suite
BLOCK_TIMEOUT_S = 600

# `make` targets named in the docs but not run here: their targets must exist in the Makefile
NOT_RUN_MAKE = {
    "main": "the full first run (a warm start and minutes of RL); its pieces are run by the suite",
    "test": "the suite itself, which runs this test",
}

SHORTEN_HINT = ("add `<!-- test: overrides ... -->` above the fence with overrides that shorten it and reach "
                "one of the suite's warm starts, e.g. model.sft_steps=30 train.steps=2 eval.before=false "
                "eval.after=false (as tests/integration/test_shipped_recipes.py shortens a shipped recipe)")


def _blocks(lang: str) -> list:
    try:
        found = [b for b in blocks.page_blocks(REPO, blocks.PAGES) if b.lang == lang]
    except MarkerError as err:
        return [pytest.param(None, id="markers", marks=pytest.mark.skip(reason=f"see test_markers_parse: {err}"))]
    return [pytest.param(b, id=b.where) for b in found] or [
        pytest.param(None, id="none", marks=pytest.mark.skip(reason="no such block on the pages"))]


# ---- the checks ---------------------------------------------------------------------------------------

def yaml_problems(block: Block, machine: bool = True) -> list[str]:
    """One line per problem of a yaml block, each naming the page and the block's line."""
    from factory.data.check import machine_problems
    from factory.recipe import RecipeError, recipe_from_dict

    try:
        data = yaml.safe_load(block.text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{block.page}:{block.line + 1 + mark.line}" if mark else block.where
        return [f"{where}: invalid YAML ({str(getattr(err, 'problem', None) or err).splitlines()[0]})"]
    try:
        recipe = recipe_from_dict(data, block.where)
    except RecipeError as err:
        return list(err.problems)
    return machine_problems(recipe, block.where) if machine else []


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+)\s*:(?!=)", (REPO / "Makefile").read_text(), re.MULTILINE))


def run_arguments(command: str) -> tuple[str | None, list[str]]:
    """A `factory run` command's recipe (None with --resume) and overrides."""
    words = shlex.split(blocks.split_comment(command)[0])
    words = words[words.index("run") + 1:]
    recipe, overrides, resume = None, [], False
    while words:
        word = words.pop(0)
        if word in ("--resume", "--run-dir"):
            resume = resume or word == "--resume"
            words.pop(0) if words else None
        elif word.startswith("--"):
            resume = resume or word.startswith("--resume=")
        elif recipe is None and "=" not in word:
            recipe = word
        else:
            overrides.append(word)
    return (None if resume else recipe), overrides


def shell_problems(block: Block) -> list[str]:
    """What keeps a shell block from running as written, found without running it."""
    from factory.model.policy_cache import cached_policy_dir
    from factory.recipe import RecipeError, load_recipe
    from tests.policies import base_policy_names

    problems = []
    made = blocks.script(block, SERVERS, NOT_RUN_MAKE, lambda: 0)
    if made.placeholders:
        problems.append(f"{block.where}: {', '.join(dict.fromkeys(made.placeholders))} must be filled in by the "
                        "reader: write a command that runs as it stands")
    missing = [t for t in made.make_targets if t not in makefile_targets()]
    if missing:
        problems.append(f"{block.where}: `make {' '.join(missing)}`: no such Makefile target")
    if made.runs and not block.overrides:
        problems.append(f"{block.where}: `factory run` is a whole run here: {SHORTEN_HINT}")
    for run in made.runs if block.overrides else []:
        recipe_file, overrides = run_arguments(run)
        if recipe_file is None or "<" in recipe_file:
            continue
        try:
            recipe = load_recipe(REPO / recipe_file, overrides)
        except RecipeError as err:
            problems += [f"{block.where}: {line}" for line in err.problems]
            continue
        if not recipe.model.path and cached_policy_dir(recipe).name not in base_policy_names():
            problems.append(f"{block.where}: `{run}` would build a warm start of its own "
                            f"({cached_policy_dir(recipe).name}), not one the suite builds: {SHORTEN_HINT}")
    return problems


# ---- the parser, on a planted page ----------------------------------------------------------------------

PLANTED = """# A page

<!-- test: skip: needs a GPU -->
```bash
factory run recipes/default.yaml rollout.device=cuda
```

<!-- test: overrides train.steps=2 'environment.system_prompt=Say #### N' -->
```bash
. .state/venv/bin/activate
factory run recipes/default.yaml async.max_staleness=0   # synchronous
python -m assets -p 3000
mlflow ui --backend-store-uri sqlite:///.state/mlflow/mlflow.db
make main   # everything
```

```yaml
train:
  steps: -1
```

```text
not tested <run>
```
"""


def test_the_parser_reads_skips_overrides_and_fences():
    skipped, run, fragment = blocks.parse(PLANTED, "docs/planted.md")
    assert (skipped.where, skipped.lang, skipped.skip) == ("docs/planted.md:4", "bash", "needs a GPU")
    assert run.overrides == ("train.steps=2", "environment.system_prompt=Say #### N") and run.skip is None
    assert (fragment.lang, fragment.line, fragment.text) == ("yaml", 17, "train:\n  steps: -1\n")

    made = blocks.script(run, SERVERS, NOT_RUN_MAKE, lambda: 43210, state="/tmp/home")
    lines = made.text.splitlines()
    assert lines[0] == ". /tmp/home/venv/bin/activate"
    assert lines[1] == ("factory run recipes/default.yaml async.max_staleness=0 train.steps=2 "
                        "'environment.system_prompt=Say #### N'  # synchronous")
    assert made.servers[0] == "python -m assets -p 43210" and lines[2].startswith("docs_server 43210 ")
    assert made.servers[1] == "mlflow ui --backend-store-uri sqlite:////tmp/home/mlflow/mlflow.db --port 43210"
    assert made.make_targets == ["main"] and lines[4].startswith(": ")


def test_a_yaml_fragment_that_fails_is_one_line_naming_page_and_line():
    fragment = blocks.parse(PLANTED, "docs/planted.md")[2]
    problems = yaml_problems(fragment)
    assert len(problems) == 1 and problems[0].startswith("docs/planted.md:17: train.steps"), problems
    assert "\n" not in problems[0]
    bad_yaml = Block("docs/planted.md", 10, "yaml", "train:\n  steps: [1\n")
    assert yaml_problems(bad_yaml)[0].startswith("docs/planted.md:1") and len(yaml_problems(bad_yaml)) == 1


@pytest.mark.parametrize("marker, complaint", [
    ("<!-- test: skip: takes too long -->", "skip reason 'takes too long' is not accepted"),
    ("<!-- test: skip: flaky -->", "not accepted"),
    ("<!-- test: overrides -->", "dotted key=value"),
    ("<!-- test: sometimes -->", "unknown test marker"),
])
def test_the_parser_refuses_a_marker_it_cannot_apply(marker, complaint):
    with pytest.raises(MarkerError, match=re.escape(complaint)) as err:
        blocks.parse(f"text\n{marker}\n```bash\ntrue\n```\n", "docs/planted.md")
    assert str(err.value).startswith("docs/planted.md:2: ")


def test_a_marker_must_sit_directly_above_a_tested_fence():
    with pytest.raises(MarkerError, match="directly above"):
        blocks.parse("<!-- test: skip: needs a GPU -->\n\n```bash\ntrue\n```\n", "p.md")
    with pytest.raises(MarkerError, match="not tested"):
        blocks.parse("<!-- test: skip: needs a cluster -->\n```text\nout\n```\n", "p.md")
    for reason in ("needs a GPU", "needs a cluster", "needs 8 GPUs"):
        assert blocks.parse(f"<!-- test: skip: {reason} -->\n```yaml\na: 1\n```\n", "p.md")[0].skip == reason
    with pytest.raises(MarkerError, match="not accepted"):  # a server is started and stopped, never skipped
        blocks.parse("<!-- test: skip: starts a long-lived server -->\n```bash\nmlflow ui\n```\n", "p.md")


def test_a_run_line_without_overrides_or_with_a_placeholder_is_a_problem():
    bare = Block("p.md", 3, "bash", "factory run recipes/default.yaml\nfactory replay <run>\n")
    problems = shell_problems(bare)
    assert any("p.md:3: <run> must be filled in" in p for p in problems), problems
    assert any("p.md:3: `factory run` is a whole run here: add `<!-- test: overrides" in p for p in problems)
    long = Block("p.md", 3, "bash", "factory run recipes/default.yaml\n", overrides=("train.steps=2",))
    assert any("would build a warm start of its own" in p for p in shell_problems(long))
    short = Block("p.md", 3, "bash", "factory run recipes/default.yaml  # a run\nmake test\n",
                  overrides=("model.sft_steps=30", "train.steps=2"))
    assert shell_problems(short) == []


# ---- the pages ------------------------------------------------------------------------------------------

def test_markers_parse():
    blocks.page_blocks(REPO, blocks.PAGES)  # MarkerError: one line naming the page and line


@pytest.mark.parametrize("block", _blocks("yaml"))
def test_yaml_block_is_a_recipe(block: Block):
    problems = yaml_problems(block, machine=False)  # a skipped block is still a valid recipe
    assert not problems, "\n".join(problems)
    if block.skip:
        pytest.skip(f"{block.where}: {block.skip}")
    problems = yaml_problems(block)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", _blocks("bash"))
def test_shell_block_runs_as_written(block: Block):
    if block.skip:
        pytest.skip(f"{block.where}: {block.skip}")
    problems = shell_problems(block)
    assert not problems, "\n".join(problems)


# ---- running them ---------------------------------------------------------------------------------------

PRELUDE = r"""set -eo pipefail
trap 'echo "docs test: failed: $BASH_COMMAND" >&2' ERR
docs_server() {  # PORT COMMAND: start COMMAND in a process group of its own, wait until PORT answers, stop it
  local port=$1 log pid i
  log=$(mktemp)
  setsid bash -c "$2" >"$log" 2>&1 &
  pid=$!
  echo "$pid" >>"$DOCS_SERVER_PIDS"
  for ((i = 0; i < DOCS_SERVER_TIMEOUT; i++)); do
    if curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$port/"; then
      echo "docs test: '$2' answered on port $port after ${i}s"
      kill -TERM -- "-$pid" 2>/dev/null || true
      for ((i = 0; i < 30; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 1; done
      kill -KILL -- "-$pid" 2>/dev/null || true
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "docs test: '$2' exited before answering on port $port:" >&2; tail -n 30 "$log" >&2; return 1
    fi
    sleep 1
  done
  echo "docs test: '$2' did not answer on port $port in ${DOCS_SERVER_TIMEOUT}s:" >&2; tail -n 30 "$log" >&2
  return 1
}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def untracked() -> set[str]:
    """The checkout's files git neither tracks nor ignores."""
    listed = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    return set(filter(None, listed.split("\0")))


def _same(block: Block) -> tuple[str, tuple[str, ...]]:
    return block.text, block.overrides


# A block repeated on another page (the README's tour and getting started share some) runs once
FIRST_RUN: dict[tuple[str, tuple[str, ...]], str] = {}
for _param in _blocks("bash"):
    if _param.values[0] is not None:
        FIRST_RUN.setdefault(_same(_param.values[0]), _param.values[0].where)


@pytest.fixture(scope="module")
def page_homes():
    """One state dir for the pages' blocks, which run in page order (a page may use what an earlier block
    made, e.g. the lake a run filled), with the suite's built policies and the venv linked in."""
    from tests.conftest import share_builds
    from tests.policies import base_policy_names

    user_home = Path(os.environ.get("FACTORY_TEST_USER_HOME") or REPO / ".state").resolve()
    with tempfile.TemporaryDirectory(prefix="factory-docs-") as root:
        shared = Path(root) / "home"
        shared.mkdir()
        share_builds(user_home, shared, base_policy_names())
        (shared / "venv").symlink_to((REPO / ".state" / "venv").resolve(), target_is_directory=True)
        yield lambda page: shared


@pytest.mark.integration
@pytest.mark.timeout(BLOCK_TIMEOUT_S + 120)
@pytest.mark.parametrize("block", _blocks("bash"))
def test_shell_block_runs(block: Block, page_homes, tmp_path):
    if block.skip:
        pytest.skip(f"{block.where}: {block.skip}")
    if FIRST_RUN[_same(block)] != block.where:
        pytest.skip(f"{block.where}: the same commands as {FIRST_RUN[_same(block)]}, which runs them")
    problems = shell_problems(block)
    assert not problems, "\n".join(problems)
    home = page_homes(block.page)
    made = blocks.script(block, SERVERS, NOT_RUN_MAKE, free_port, state=str(home))
    (tmp_path / "block.sh").write_text(PRELUDE + made.text)
    env = {k: v for k, v in os.environ.items() if k not in ("FACTORY_TEST_USER_HOME", "VIRTUAL_ENV")}
    venv = REPO / ".state" / "venv"
    env.update(FACTORY_HOME=str(home), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               VIRTUAL_ENV=str(venv), HF_HUB_OFFLINE="1", DOCS_SERVER_PIDS=str(tmp_path / "servers"),
               DOCS_SERVER_TIMEOUT=str(SERVER_TIMEOUT_S))
    before = untracked()
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(tmp_path / "block.sh")], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"{block.where}: did not finish in {BLOCK_TIMEOUT_S} s; its output's end:\n{out[-4000:]}")
    finally:
        for pid in (tmp_path / "servers").read_text().split() if (tmp_path / "servers").exists() else []:
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for left in untracked() - before:  # what the block wrote into the checkout (`> recipe.schema.json`)
            (REPO / left).unlink(missing_ok=True)
    print(f"{block.where}: {time.monotonic() - t0:.0f} s\n{out[-3000:]}")
    assert proc.returncode == 0, f"{block.where}: exit {proc.returncode}; its output's end:\n{out[-4000:]}"
