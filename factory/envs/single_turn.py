"""Single-turn question answering: one chat call, the reply is the answer, the verifier scores it."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from factory.envs.base import EpisodeResult, register_environment
from factory.rewards.verifiers import reasoning_gym_reward
from factory.types import Task


@register_environment("single_turn")
class SingleTurnEnvironment:
    name = "single_turn"

    def __init__(self, section=None):
        self.system_prompt = getattr(section, "system_prompt", None)
        latency = getattr(section, "latency", None)
        self.fast_s = getattr(latency, "fast_s", 0.0)
        self.slow_s = getattr(latency, "slow_s", 0.0)
        self.slow_fraction = getattr(latency, "slow_fraction", 0.0)
        self._rng = random.Random(0)

    def prompt_messages(self, task: Task) -> list[dict]:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": task.question}]

    async def _simulated_latency(self) -> float:
        """Heavy-tailed think/tool time for benchmarks: most episodes fast, a few much slower."""
        delay = self.slow_s if self._rng.random() < self.slow_fraction else self.fast_s
        if delay > 0:
            await asyncio.sleep(delay)
        return delay

    async def run_episode(self, client, model: str, task: Task, sampling: dict[str, Any]) -> EpisodeResult:
        reply = await client.chat.completions.create(
            model=model, messages=self.prompt_messages(task), **sampling
        )
        delay = await self._simulated_latency()
        answer = reply.choices[0].message.content
        return EpisodeResult(reward=reasoning_gym_reward(answer, task), info={"answer": answer, "delay_s": delay})
