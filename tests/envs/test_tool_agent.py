"""The tool agent environment: run_python in a real sandbox, observations as tool messages, the whole
episode in one Sample, and SFT demonstrations tokenized exactly as the gateway tokenizes an episode."""

from __future__ import annotations

import asyncio
import os

import pytest

from factory.envs import ENVIRONMENTS
from factory.envs.tool_agent import DEFAULT_SYSTEM_PROMPT, ToolAgentEnvironment, observation
from factory.model.sft import sft_examples
from factory.model.tiny import build_tokenizer
from factory.recipe import load_recipe
from factory.rollout.engine import SamplingParams
from factory.rollout.episodes import EpisodeRunner
from factory.rollout.gateway import Gateway
from factory.sandbox import Result, SandboxUnavailable
from factory.core.types import NOT_SAMPLED, Task

from ..rollout.test_gateway import ScriptedEngine, ids_of

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def product_task(a: int, b: int) -> Task:
    expression = f"{a} * {b}"
    return Task(f"mul/{a}/{b}", "basic_arithmetic", f"Calculate {expression}.", str(a * b),
                metadata={"rg_entry": {"answer": str(a * b), "metadata": {"expression": expression}}})


def call_text(code: str) -> str:
    return '<tool_call>{"name": "run_python", "arguments": {"code": "' + code + '"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tasks = [product_task(a, b) for a, b in [(12, 34), (382, 777), (5, 905)]]
    texts = [DEFAULT_SYSTEM_PROMPT, "Calculate 382 * 777.", "296814", call_text("print(1)")] * 30
    texts += [t.question for t in tasks]
    return build_tokenizer(texts, 360, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def env():
    section = load_recipe(f"{REPO}/recipes/tool_agent.yaml", ["environment.sandbox.backend=bubblewrap"]).environment
    environment = ToolAgentEnvironment(section)
    try:
        asyncio.run(environment.sandbox.pool())
    except SandboxUnavailable as err:
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(f"bubblewrap sandbox unavailable in CI: {err}")
        pytest.skip(f"bubblewrap sandbox unavailable here: {err}")
    yield environment
    environment.sandbox.close()


def play(tokenizer, env, task, replies: list[list[int]], max_new_tokens: int = 64):
    """One episode of `env` on `task` against an engine that replies `replies`; (sample, engine, info)."""
    engine = ScriptedEngine(replies)
    gw = Gateway(tokenizer, [engine], SamplingParams(max_new_tokens=max_new_tokens))
    runner = EpisodeRunner(gw, env, {"temperature": 1.0, "max_tokens": max_new_tokens}, group_size=2)

    async def go():
        try:
            result, _ = await runner.episode("e1", task)
            return result
        finally:
            await runner.close()

    result = asyncio.run(go())
    sample = gw.finish("e1", sample_id="e1", group_id="g", task_id=task.task_id, reward=result.reward,
                       env=env.name, info=result.info)
    return sample, engine, result


def test_registered_and_recipe_valid():
    assert ENVIRONMENTS["tool_agent"] is ToolAgentEnvironment
    recipe = load_recipe(f"{REPO}/recipes/tool_agent.yaml")
    assert recipe.environment.name == "tool_agent" and recipe.environment.max_turns >= 2
    assert recipe.environment.system_prompt == DEFAULT_SYSTEM_PROMPT  # the fingerprinted prompt is the default


def test_observation_shows_output_or_the_failure():
    assert observation(Result(0, "408\n", "", "ok", 0.1)) == "408"
    assert observation(Result(0, "", "", "ok", 0.1)) == "(no output)"
    failed = Result(1, "", "Traceback ...\nNameError: name 'x' is not defined\n", "exit_nonzero", 0.1)
    assert observation(failed) == "NameError: name 'x' is not defined [exit_nonzero]"
    assert observation(Result(None, "", "", "timeout", 5.0)) == "[timeout]"
    long = observation(Result(0, "x" * 1000 + "END", "", "ok", 0.1), limit=50)
    assert len(long) == 50 and long.endswith("END")


def test_episode_runs_the_tool_and_records_one_sample(tokenizer, env):
    task = product_task(382, 777)
    end = tokenizer.eos_token_id
    call = ids_of(tokenizer, call_text("print(382 * 777)")) + [end]
    answer = ids_of(tokenizer, "296814") + [end]
    sample, engine, result = play(tokenizer, env, task, [call, answer])

    assert result.reward == 1.0 and result.info["answer"] == "296814" and result.info["tool_reasons"] == ["ok"]
    first, second = engine.seen
    tool_ids = second[len(first) + len(call):]
    assert tokenizer.decode(tool_ids) == "<|tool|>296814<|end|><|assistant|>"  # the sandbox's output
    assert sample.prompt_ids + sample.completion_ids == second + answer
    assert sample.loss_mask == [1] * len(call) + [0] * len(tool_ids) + [1] * len(answer)
    assert [v for v, m in zip(sample.versions, sample.loss_mask) if not m] == [NOT_SAMPLED] * len(tool_ids)
    assert sample.turns == 2


def test_failing_program_is_observed_and_turns_are_bounded(tokenizer, env):
    task = product_task(12, 34)
    end = tokenizer.eos_token_id
    bad = ids_of(tokenizer, call_text("print(undefined)")) + [end]
    sample, engine, result = play(tokenizer, env, task, [bad, bad, bad])
    # max_turns = 3: two calls run, the third turn calls again and the episode ends unanswered
    assert result.reward == 0.0 and result.info["answer"] is None
    assert result.info["tool_reasons"] == ["exit_nonzero", "exit_nonzero"]
    assert "NameError" in tokenizer.decode(engine.seen[1][len(engine.seen[0]) + len(bad):])
    assert sample.turns == 3


def test_direct_answer_without_a_tool(tokenizer, env):
    end = tokenizer.eos_token_id
    sample, engine, result = play(tokenizer, env, product_task(12, 34), [ids_of(tokenizer, "408") + [end]])
    assert result.reward == 1.0 and result.info["tool_calls"] == 0 and sample.turns == 1


def test_demonstration_tokens_are_what_the_gateway_sends(tokenizer, env):
    """SFT on a demonstration trains each assistant turn on exactly the prompt ids the engine will see."""
    task = product_task(382, 777)
    episode = env.demonstration(task)
    assert [m["role"] for m in episode] == ["system", "user", "assistant", "tool", "assistant"]
    examples = sft_examples(tokenizer, env, [task])
    assert len(examples) == 2
    (p1, r1), (p2, r2) = examples
    assert tokenizer.decode(r1) == call_text("print(382 * 777)") + "<|end|>"
    assert tokenizer.decode(r2) == "296814<|end|>"
    sample, engine, result = play(tokenizer, env, task, [r1, r2])
    assert engine.seen == [p1, p2] and result.reward == 1.0
    assert sample.prompt_ids + sample.completion_ids == p2 + r2


def test_no_demonstration_without_a_plain_expression(tokenizer, env):
    odd = Task("t", "basic_arithmetic", "Calculate it.", "1",
               metadata={"rg_entry": {"metadata": {"expression": "__import__('os')"}}})
    assert env.demonstration(odd) is None
    assert env.demonstration(Task("u", "x", "q", "a")) is None
    # without a demonstration, SFT falls back to (prompt, answer)
    ((prompt, answer),) = sft_examples(tokenizer, env, [odd])
    assert tokenizer.decode(answer) == "1<|end|>"
