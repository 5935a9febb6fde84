"""A multi-turn tool-using agent: it may call `run_python` (executed in a sandbox) several times,
reads each result as a tool message, and finally answers.

The agent is an ordinary OpenAI tool-calling loop against the gateway:

    reply = chat(messages, tools=[run_python])
    while reply has tool calls and turns are left:
        messages += [reply, one tool message per call with what the program printed]
        reply = chat(messages, tools=[run_python])
    reward = score(reply.content)          # reasoning-gym verifier, or unit tests for code tasks

The gateway records the whole episode as one Sample: sampled tokens with loss mask 1, the tool
messages between turns with loss mask 0.
"""

from __future__ import annotations

import json
import re
from typing import Any

from factory.envs.base import EpisodeResult, register_environment, task_messages
from factory.envs.sandboxes import EnvSandbox
from factory.recipe import EnvironmentSection
from factory.rewards import score_answer
from factory.sandbox import Program, Result
from factory.core.types import Task

RUN_PYTHON = {
    "type": "function",
    "function": {
        "name": "run_python",
        "description": "Run a Python 3 program in a sandbox (no network, time and memory limits) and "
                       "return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program to run"}},
            "required": ["code"],
        },
    },
}

# The tiny model's template does not render tool schemas, so the prompt shows the call itself (its
# text also teaches the locally trained tokenizer the call's pieces).
DEFAULT_SYSTEM_PROMPT = ('Tool: <tool_call>{"name": "run_python", "arguments": {"code": "print(12 * 34)"}}'
                         '</tool_call> runs Python and shows what it prints. Then answer.')
OBSERVATION_CHARS = 400  # what a tool message shows of a program's output
_EXPRESSION = re.compile(r"^[\d\s+\-*/().]+$")


def observation(result: Result, limit: int = OBSERVATION_CHARS) -> str:
    """What the agent sees of a run: its stdout, and for a failed run the last line of stderr and why
    it stopped; at most `limit` characters (the end is kept: results come last)."""
    text = result.stdout.strip()
    if not result.ok:
        lines = result.stderr.strip().splitlines()
        tail = f"{lines[-1]} " if lines else ""
        text = f"{text}\n{tail}[{result.reason}]".strip()
    if not text:
        text = "(no output)"
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


@register_environment("tool_agent")
class ToolAgentEnvironment:
    uses_sandbox = True  # runs its tool calls in `environment.sandbox.image` (the Dagster graph shows it upstream)
    name = "tool_agent"
    tools = [RUN_PYTHON]

    def __init__(self, section: EnvironmentSection | None = None):
        section = section or EnvironmentSection()  # the recipe's defaults: none of its own
        self.system_prompt = section.system_prompt or DEFAULT_SYSTEM_PROMPT
        self.max_turns = section.max_turns
        self.sandbox = EnvSandbox(section.sandbox)

    def prompt_messages(self, task: Task) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}, *task_messages(task)]

    def demonstration(self, task: Task) -> list[dict] | None:
        """A whole synthetic episode for the SFT warm start: the expression of an arithmetic task is
        printed by run_python, and its output is the answer (exact for integer arithmetic, where
        Python prints what the verifier expects). None for tasks without such an expression."""
        entry = task.metadata.get("rg_entry") or {}
        expression = (entry.get("metadata") or {}).get("expression")
        if not isinstance(expression, str) or not _EXPRESSION.match(expression):
            return None
        call = {"type": "function", "function": {"name": "run_python",
                                                 "arguments": {"code": f"print({expression})"}}}
        return self.prompt_messages(task) + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": task.answer},
            {"role": "assistant", "content": task.answer},
        ]

    async def run_tool(self, name: str, arguments: str) -> tuple[str, str]:
        """(observation, reason) for one tool call; bad calls are reported to the agent, not raised."""
        if name != "run_python":
            return f"error: unknown tool {name!r}", "bad_call"
        try:
            code = json.loads(arguments).get("code")
        except (ValueError, AttributeError):
            code = None
        if not isinstance(code, str):
            return "error: arguments must be a JSON object with a 'code' string", "bad_call"
        result = await self.sandbox.run(Program.python(code))
        return observation(result), result.reason

    async def run_episode(self, client, model: str, task: Task, sampling: dict[str, Any]) -> EpisodeResult:
        messages = self.prompt_messages(task)
        answer, reasons = None, []
        for turn in range(self.max_turns):
            reply = await client.chat.completions.create(model=model, messages=messages, tools=self.tools,
                                                         **sampling)
            message = reply.choices[0].message
            if not message.tool_calls:
                answer = message.content
                break
            if turn == self.max_turns - 1:
                break  # out of turns with a call pending: no answer
            messages.append({"role": "assistant", "content": message.content, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in message.tool_calls]})
            for call in message.tool_calls:
                text, reason = await self.run_tool(call.function.name, call.function.arguments)
                reasons.append(reason)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        reward, info = await score_answer(answer, task, self.sandbox)
        return EpisodeResult(reward=reward, info={"answer": answer, "tool_calls": len(reasons),
                                                  "tool_reasons": reasons, **info})
