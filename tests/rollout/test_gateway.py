"""Gateway token accounting: what the engine sees is exactly what the Sample records."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from factory.model.tiny import build_tokenizer
from factory.model.tokens import encode_chat
from factory.rollout.engine import Generation, SamplingParams
from factory.rollout.gateway import Gateway, GatewayError
from factory.core.types import NOT_SAMPLED


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = ["Calculate 23 + 26.", "49", "run_python output: 7", "The answer is 12."] * 20
    return build_tokenizer(texts, 290, tmp_path_factory.mktemp("tok"))


class ScriptedEngine:
    """Replies with fixed token ids and records every prompt it was sent (unit-test stand-in)."""

    def __init__(self, replies: list[list[int]], version: int = 3, finish: str = "stop"):
        self.replies = list(replies)
        self.seen: list[list[int]] = []
        self.version = version
        self.finish = finish

    async def generate(self, prompt_ids, sampling: SamplingParams, request_id: str) -> Generation:
        self.seen.append(list(prompt_ids))
        ids = self.replies.pop(0)
        return Generation(ids, [-0.1 * (i + 1) for i in range(len(ids))], [self.version] * len(ids), self.finish,
                          len(prompt_ids))


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_single_turn_records_prompt_and_sampled_tokens(tokenizer):
    end = tokenizer.eos_token_id
    reply = ids_of(tokenizer, "49") + [end]
    engine = ScriptedEngine([reply])
    gw = Gateway(tokenizer, [engine], SamplingParams(max_new_tokens=8))
    messages = [{"role": "user", "content": "Calculate 23 + 26."}]
    out = asyncio.run(gw.chat("s1", {"messages": messages}))
    assert out["choices"][0]["message"]["content"] == "49"
    assert engine.seen == [encode_chat(tokenizer, messages)]
    sample = gw.finish("s1", sample_id="s1", group_id="g", task_id="t", reward=1.0, env="single_turn")
    assert sample.prompt_ids == engine.seen[0]
    assert sample.completion_ids == reply
    assert sample.loss_mask == [1] * len(reply)
    assert sample.versions == [3] * len(reply)
    assert sample.logprobs == pytest.approx([-0.1 * (i + 1) for i in range(len(reply))])
    assert out["usage"] == {"prompt_tokens": len(engine.seen[0]), "completion_tokens": len(reply),
                            "total_tokens": len(engine.seen[0]) + len(reply)}


def test_multi_turn_is_token_in_token_out(tokenizer):
    end = tokenizer.eos_token_id
    first, second = ids_of(tokenizer, "23"), ids_of(tokenizer, "49") + [end]  # first reply hit the length limit
    engine = ScriptedEngine([first, second], finish="length")
    gw = Gateway(tokenizer, [engine], SamplingParams(max_new_tokens=8))
    convo = [{"role": "user", "content": "Calculate 23 + 26."}]
    r1 = asyncio.run(gw.chat("s", {"messages": convo}))
    convo += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
              {"role": "tool", "content": "run_python output: 7"}]
    asyncio.run(gw.chat("s", {"messages": convo}))
    sample = gw.finish("s", sample_id="s", group_id="g", task_id="t", reward=0.0, env="tool")

    # the second prompt is exactly the first prompt + what was sampled + the closing end token
    # + only the new message's tokens: nothing earlier was re-tokenized
    assert engine.seen[1][: len(engine.seen[0]) + len(first)] == engine.seen[0] + first
    assert sample.prompt_ids + sample.completion_ids == engine.seen[1] + second
    n_obs = len(engine.seen[1]) - len(engine.seen[0]) - len(first)
    assert sample.loss_mask == [1] * len(first) + [0] * n_obs + [1] * len(second)
    assert sample.versions == [3] * len(first) + [NOT_SAMPLED] * n_obs + [3] * len(second)
    assert sample.logprobs[len(first): len(first) + n_obs] == [0.0] * n_obs
    assert engine.seen[1][len(engine.seen[0]) + len(first)] == end  # unterminated reply closed by us
    assert sample.turns == 2


def test_routing_stays_aligned_with_completion_ids_across_turns(tokenizer):
    """Routing replay: each sampled token keeps its [layer][top_k] experts; tool tokens and the end token
    the gateway adds get [] (not sampled), so `routed_experts` lines up with `completion_ids`; the flag
    reaches the engine only when the defaults ask for it."""
    end = tokenizer.eos_token_id
    first, second = ids_of(tokenizer, "23"), ids_of(tokenizer, "49") + [end]

    class RoutingEngine(ScriptedEngine):
        asked: list[bool] = []

        async def generate(self, prompt_ids, sampling, request_id):
            self.asked.append(sampling.return_routing)
            gen = await super().generate(prompt_ids, sampling, request_id)
            # token i of this reply went through experts (i, i+1) in layer 0 and (i+2, i+3) in layer 1
            gen.routed_experts = [[[i, i + 1], [i + 2, i + 3]] for i in range(len(gen.token_ids))]
            return gen

    engine = RoutingEngine([first, second], finish="length")
    gw = Gateway(tokenizer, [engine], SamplingParams(max_new_tokens=8, return_routing=True))
    convo = [{"role": "user", "content": "Calculate 23 + 26."}]
    r1 = asyncio.run(gw.chat("s", {"messages": convo}))
    convo += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
              {"role": "tool", "content": "run_python output: 7"}]
    asyncio.run(gw.chat("s", {"messages": convo}))
    sample = gw.finish("s", sample_id="s", group_id="g", task_id="t", reward=0.0, env="tool")
    assert engine.asked == [True, True]
    assert len(sample.routed_experts) == len(sample.completion_ids)
    n_between = len(sample.completion_ids) - len(first) - len(second)  # the closing end token + the tool message
    expected = ([[[i, i + 1], [i + 2, i + 3]] for i in range(len(first))] + [[]] * n_between
                + [[[i, i + 1], [i + 2, i + 3]] for i in range(len(second))])
    assert sample.routed_experts == expected
    assert [bool(r) for r in sample.routed_experts] == [bool(m) for m in sample.loss_mask]

    plain = Gateway(tokenizer, [ScriptedEngine([first])], SamplingParams(max_new_tokens=8))
    asyncio.run(plain.chat("p", {"messages": convo[:1]}))
    assert plain.finish("p", sample_id="p", group_id="g", task_id="t", reward=0.0, env="x").routed_experts == []
    with pytest.raises(ValueError, match="routed_experts has 1 entries"):
        dataclasses.replace(sample, routed_experts=[[]])


def test_diverged_conversation_and_n_are_refused(tokenizer):
    engine = ScriptedEngine([ids_of(tokenizer, "1")])
    gw = Gateway(tokenizer, [engine], SamplingParams(max_new_tokens=8))
    asyncio.run(gw.chat("s", {"messages": [{"role": "user", "content": "Calculate 23 + 26."}]}))
    with pytest.raises(GatewayError, match="diverged"):
        asyncio.run(gw.chat("s", {"messages": [{"role": "user", "content": "something else"},
                                               {"role": "user", "content": "more"}]}))
    with pytest.raises(GatewayError, match="n must be 1"):
        asyncio.run(gw.chat("t", {"messages": [{"role": "user", "content": "x"}], "n": 2}))
    with pytest.raises(GatewayError, match="non-empty"):
        asyncio.run(gw.chat("u", {"messages": []}))


def test_openai_client_through_http(tokenizer):
    from openai import AsyncOpenAI

    end = tokenizer.eos_token_id
    engine = ScriptedEngine([ids_of(tokenizer, "49") + [end]])
    gw = Gateway(tokenizer, [engine], SamplingParams(max_new_tokens=8))

    async def go():
        await gw.serve()
        try:
            client = AsyncOpenAI(base_url=gw.base_url("h1"), api_key="x", max_retries=0)
            reply = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "Calculate 23 + 26."}], max_tokens=4)
            bad = None
            try:
                await client.chat.completions.create(model="policy", messages=[], max_tokens=4)
            except Exception as err:  # openai raises BadRequestError for HTTP 400
                bad = err
            await client.close()
            return reply, bad
        finally:
            await gw.close()

    reply, bad = asyncio.run(go())
    assert reply.choices[0].message.content == "49"
    assert getattr(bad, "status_code", None) == 400
    sample = gw.finish("h1", sample_id="h1", group_id="g", task_id="t", reward=1.0, env="e")
    assert sample.completion_ids == ids_of(tokenizer, "49") + [end]


def test_episode_runner_plays_a_group_in_process(tokenizer):
    from factory.envs.single_turn import SingleTurnEnvironment
    from factory.rollout.episodes import EpisodeRunner
    from factory.core.types import Task

    end = tokenizer.eos_token_id
    right, wrong = ids_of(tokenizer, "49") + [end], ids_of(tokenizer, "48") + [end]
    engine = ScriptedEngine([right, wrong, right, wrong])
    gw = Gateway(tokenizer, [engine], SamplingParams(max_new_tokens=8))
    task = Task("t1", "basic_arithmetic", "Calculate 23 + 26.", "49",
                metadata={"rg_entry": {"answer": "49", "metadata": {}}})
    runner = EpisodeRunner(gw, SingleTurnEnvironment(), {"temperature": 1.0, "max_tokens": 8}, group_size=4)

    async def go():
        try:
            return await runner.run_group(task, "g7")
        finally:
            await runner.close()

    group = asyncio.run(go())
    assert sorted(s.reward for s in group.samples) == [0.0, 0.0, 1.0, 1.0]
    assert {s.group_id for s in group.samples} == {"g7"} and len({s.sample_id for s in group.samples}) == 4
    assert all(s.prompt_ids == encode_chat(tokenizer, [{"role": "user", "content": task.question}])
               for s in group.samples)
    assert not gw.sessions  # every session was closed into a Sample


class RecordingEngine:
    """Replies by request id (so call order does not matter) and records each call (unit-test stand-in)."""

    def __init__(self, replies: list[list[int]]):
        self.replies = replies
        self.calls: dict[str, tuple] = {}

    async def generate(self, prompt_ids, sampling: SamplingParams, request_id: str) -> Generation:
        self.calls[request_id] = (list(prompt_ids), sampling)
        ids = self.replies[int(request_id.split("-")[1]) % len(self.replies)]
        return Generation(ids, [-0.5] * len(ids), [2] * len(ids), "stop", len(prompt_ids))


def test_direct_path_records_what_the_openai_path_records(tokenizer):
    """Single-turn episodes played in-process (no OpenAI client) send the engine the same ids, sampling
    and seeds, and make the same Samples and rewards, as through the gateway's OpenAI endpoint."""
    from factory.envs.single_turn import SingleTurnEnvironment
    from factory.recipe import EnvironmentSection
    from factory.rollout.episodes import EpisodeRunner
    from factory.core.types import Task

    end = tokenizer.eos_token_id
    replies = [ids_of(tokenizer, "49") + [end], ids_of(tokenizer, "The answer is 12.")]
    task = Task("t1", "basic_arithmetic", "Calculate 23 + 26.", "49",
                metadata={"rg_entry": {"answer": "49", "metadata": {}}})
    env = SingleTurnEnvironment(EnvironmentSection(system_prompt="You add."))

    def play(direct: bool):
        engine = RecordingEngine(replies)
        gw = Gateway(tokenizer, [engine], SamplingParams(max_new_tokens=8, top_k=5), seed=11)
        runner = EpisodeRunner(gw, env, {"temperature": 0.7, "max_tokens": 6}, group_size=4, direct=direct)
        assert runner.direct is direct

        async def go():
            try:
                group = await runner.run_group(task, "g3")
                evals = await runner.episodes([task, task], {"temperature": 0.0, "max_tokens": 4}, keep=True)
                return group, evals
            finally:
                await runner.close()

        group, evals = asyncio.run(go())
        assert not gw.sessions
        untimed = [dataclasses.replace(s, timings={}) for s in group.samples + [e[1] for e in evals]]
        return engine.calls, untimed, [e[0] for e in evals], gw.metrics()

    fast, slow = play(True), play(False)
    assert fast[0] == slow[0] and len(fast[0]) == 6  # ids, sampling (seeds included) and request ids
    assert {s.seed for _, s in fast[0].values()} != {None}
    assert fast[1] == slow[1] and len(fast[1]) == 6
    assert [s.reward for s in fast[1]] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert fast[2] == slow[2] and fast[3] == slow[3]
    # a subclass that overrides run_episode keeps its own episode; one that only rescores stays direct
    class OwnEpisode(SingleTurnEnvironment):
        async def run_episode(self, client, model, task, sampling):
            raise AssertionError("not reached")

    class OwnScore(SingleTurnEnvironment):
        async def score_reply(self, task, answer):
            return await super().score_reply(task, answer)

    gw = Gateway(tokenizer, [RecordingEngine(replies)], SamplingParams())
    assert not EpisodeRunner(gw, OwnEpisode(), {}, 1).direct and EpisodeRunner(gw, OwnScore(), {}, 1).direct
    # an environment with tools (no score_reply) keeps the OpenAI contract whatever the flag says
    from factory.envs.tool_agent import ToolAgentEnvironment
    assert not EpisodeRunner(Gateway(tokenizer, [RecordingEngine(replies)], SamplingParams()),
                             ToolAgentEnvironment(), {}, 1, direct=True).direct
