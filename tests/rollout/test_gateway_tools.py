"""Gateway tool calling: calls parsed out of sampled text, tool results as non-sampled tokens, and the
token ids the engine saw on every turn equal to what the Sample records (no re-tokenization drift)."""

from __future__ import annotations

import asyncio
import json

import pytest

from factory.model.tiny import build_tokenizer
from factory.rollout.engine import SamplingParams
from factory.rollout.gateway import Gateway, GatewayError, parse_tool_calls, tool_names
from factory.core.types import NOT_SAMPLED

from .test_gateway import ScriptedEngine, ids_of

TOOLS = [{"type": "function", "function": {"name": "run_python", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "run_python", "arguments": {"code": "print(12 * 34)"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = ["Calculate 12 * 34.", "408", CALL, "The answer is 408."] * 20
    return build_tokenizer(texts, 320, tmp_path_factory.mktemp("tok"))


def byte_ids(tokenizer, text: str) -> list[int]:
    """`text` one character per token: a segmentation the sampler may produce but the tokenizer never would."""
    return [i for ch in text for i in ids_of(tokenizer, ch)]


def test_parse_tool_calls():
    names = {"run_python"}
    assert parse_tool_calls(CALL, names) == (None, [("run_python", {"code": "print(12 * 34)"})])
    assert parse_tool_calls("Let me check. " + CALL + " trailing", names)[0] == "Let me check. "
    two = CALL + '<tool_call>{"name": "run_python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    assert [a for _, a in parse_tool_calls(two, names)[1]] == [{"code": "print(12 * 34)"}, {"code": "print(1)"}]
    for text in ['<tool_call>{"name": "run_python", "arguments": {"code": </tool_call>',  # bad JSON
                 '<tool_call>{"name": "shell", "arguments": {}}</tool_call>',  # a tool not offered
                 '<tool_call>{"name": "run_python", "arguments": [1]}</tool_call>',  # arguments not an object
                 '<tool_call>{"name": "run_python", "arguments": {}}',  # never closed (length cut-off)
                 CALL + '<tool_call>nope</tool_call>',  # all or nothing
                 '<tool_call>{"name": {"code": "1"}, "arguments": {}}</tool_call>',  # a name that is no string
                 '<tool_call>{"name": ["run_python"], "arguments": {}}</tool_call>',  # (a 500 before: unhashable)
                 "408"]:
        assert parse_tool_calls(text, names) == (text, [])


def test_tool_options_are_validated():
    assert tool_names({"tools": TOOLS}) == {"run_python"}
    assert tool_names({"tools": TOOLS, "tool_choice": "none"}) == set()
    assert tool_names({}) == set()
    with pytest.raises(GatewayError, match="tool_choice 'required' is not supported"):
        tool_names({"tools": TOOLS, "tool_choice": "required"})
    with pytest.raises(GatewayError, match=r"tools\[0\]: expected"):
        tool_names({"tools": [{"type": "function", "function": {}}]})
    with pytest.raises(GatewayError, match="tools must be a list"):
        tool_names({"tools": "run_python"})


def test_tool_episode_records_what_the_engine_saw_on_every_turn(tokenizer):
    end = tokenizer.eos_token_id
    call_ids = byte_ids(tokenizer, CALL) + [end]
    assert ids_of(tokenizer, CALL) != call_ids[:-1]  # re-tokenizing the sampled text would change the ids
    answer_ids = ids_of(tokenizer, "408") + [end]
    engine = ScriptedEngine([call_ids, answer_ids])
    gw = Gateway(tokenizer, [engine], SamplingParams(max_new_tokens=128))
    convo = [{"role": "user", "content": "Calculate 12 * 34."}]

    first = asyncio.run(gw.chat("s", {"messages": convo, "tools": TOOLS}))
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert choice["message"]["content"] is None and call["type"] == "function"
    assert call["function"]["name"] == "run_python"
    assert json.loads(call["function"]["arguments"]) == {"code": "print(12 * 34)"}

    # the agent echoes the call back in an equivalent form (other spacing, a content field) and adds the result
    echoed = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": "run_python", "arguments": '{"code":"print(12 * 34)"}'}}]}
    convo += [echoed, {"role": "tool", "tool_call_id": call["id"], "content": "408"}]
    second = asyncio.run(gw.chat("s", {"messages": convo, "tools": TOOLS}))
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "408"}
    assert second["choices"][0]["finish_reason"] == "stop"
    sample = gw.finish("s", sample_id="s", group_id="g", task_id="t", reward=1.0, env="tool_agent")

    everything = sample.prompt_ids + sample.completion_ids
    first_seen, second_seen = engine.seen
    assert sample.prompt_ids == first_seen
    # turn 2 saw turn 1's prompt, the sampled ids as sampled, then only the tool message's tokens
    assert second_seen[: len(first_seen) + len(call_ids)] == first_seen + call_ids
    assert everything == second_seen + answer_ids
    tool_ids = second_seen[len(first_seen) + len(call_ids):]
    assert tokenizer.decode(tool_ids) == "<|tool|>408<|end|><|assistant|>"
    assert sample.loss_mask == [1] * len(call_ids) + [0] * len(tool_ids) + [1] * len(answer_ids)
    assert sample.versions == [3] * len(call_ids) + [NOT_SAMPLED] * len(tool_ids) + [3] * len(answer_ids)
    assert sample.turns == 2


def test_tool_calls_are_plain_text_without_tools_and_forks_are_refused(tokenizer):
    end = tokenizer.eos_token_id
    engine = ScriptedEngine([ids_of(tokenizer, CALL) + [end], ids_of(tokenizer, "1") + [end]])
    gw = Gateway(tokenizer, [engine], SamplingParams(max_new_tokens=128))
    convo = [{"role": "user", "content": "Calculate 12 * 34."}]
    out = asyncio.run(gw.chat("p", {"messages": convo}))  # no tools offered: nothing is parsed
    assert out["choices"][0]["message"] == {"role": "assistant", "content": CALL}
    assert out["choices"][0]["finish_reason"] == "stop"

    gw2 = Gateway(tokenizer, [ScriptedEngine([ids_of(tokenizer, CALL) + [end]])], SamplingParams(max_new_tokens=128))
    first = asyncio.run(gw2.chat("q", {"messages": convo, "tools": TOOLS}))
    call = first["choices"][0]["message"]["tool_calls"][0]
    changed = {"role": "assistant", "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": "run_python", "arguments": '{"code": "print(1)"}'}}]}
    with pytest.raises(GatewayError, match="diverged"):
        asyncio.run(gw2.chat("q", {"messages": convo + [changed, {"role": "tool", "content": "1"}], "tools": TOOLS}))
