"""Single-turn question answering: one chat call, the reply is the answer, the verifier scores it
(code tasks: the reply's program runs against the task's unit tests in a sandbox)."""

from __future__ import annotations

import asyncio
import random
import zlib
from typing import Any

from factory.envs.base import EpisodeResult, register_environment, task_messages
from factory.envs.sandboxes import EnvSandbox
from factory.recipe import EnvironmentSection
from factory.rewards import score_answer
from factory.core.types import Task


@register_environment("single_turn")
class SingleTurnEnvironment:
    name = "single_turn"

    def __init__(self, section: EnvironmentSection | None = None):
        section = section or EnvironmentSection()  # the recipe's defaults: none of its own
        self.system_prompt = section.system_prompt
        self.latency = section.latency
        self._rng = random.Random(0)
        self.sandbox = EnvSandbox(section.sandbox)  # made on first code task

    def prompt_messages(self, task: Task) -> list[dict]:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + task_messages(task)

    async def _simulated_latency(self, task: Task) -> float:
        """Heavy-tailed think/tool time for benchmarks: most episodes fast, a few much slower — by a
        coin flip per episode, or (`per_task`) for a fixed share of the tasks."""
        lat = self.latency
        draw = (zlib.crc32(task.task_id.encode()) % 10_000) / 10_000 if lat.per_task else self._rng.random()
        delay = lat.slow_s if draw < lat.slow_fraction else lat.fast_s
        if delay > 0:
            await asyncio.sleep(delay)
        return delay

    async def run_episode(self, client, model: str, task: Task, sampling: dict[str, Any]) -> EpisodeResult:
        reply = await client.chat.completions.create(
            model=model, messages=self.prompt_messages(task), **sampling
        )
        return await self.score_reply(task, reply.choices[0].message.content)

    async def score_reply(self, task: Task, answer: str) -> EpisodeResult:
        """The episode's end once the one reply is in. Having it lets the runner play this environment
        without the OpenAI client (`environment.direct`): it sends `prompt_messages` itself."""
        delay = await self._simulated_latency(task)
        reward, info = await score_answer(answer, task, self.sandbox)
        return EpisodeResult(reward=reward, info={"answer": answer, "delay_s": delay, **info})
