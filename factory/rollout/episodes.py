"""Running environment episodes through the gateway: groups for training, single episodes for eval."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import httpx

from factory.envs.base import EpisodeResult
from factory.rollout.gateway import Gateway
from factory.core.types import Group, Sample, Task


@dataclass
class EvalResult:
    mean: float
    stderr: float
    n: int
    by_family: dict[str, float]

    def to_dict(self) -> dict:
        return {"mean": self.mean, "stderr": self.stderr, "n": self.n, "by_family": self.by_family}


def plays_directly(env) -> bool:
    """Whether the runner may play `env` in-process: it has `score_reply`, and no class below the one
    that defines it overrides `run_episode` (a subclass that changes the episode keeps its own)."""
    mro = type(env).__mro__

    def owner(name: str):
        return next((k for k in mro if name in vars(k)), None)

    scores, plays = owner("score_reply"), owner("run_episode")
    return scores is not None and (plays is None or plays is scores or not issubclass(plays, scores))


class EpisodeRunner:
    """Plays an environment's episodes against a gateway and turns them into Groups."""

    def __init__(self, gateway: Gateway, env, sampling: dict, group_size: int, direct: bool = True):
        """`direct`: play environments that have `score_reply` (one tool-less call) in-process, their
        prompt rendered once per task; the gateway records the same ids, logprobs and versions."""
        self.gateway = gateway
        self.env = env
        self.sampling = sampling
        self.group_size = group_size
        self.direct = direct and plays_directly(env)
        # Environments in this process reach the gateway through an in-process ASGI transport:
        # the same OpenAI API and app, without a socket and uvicorn's parsing per call (agents in
        # other processes, e.g. sandboxes, use the loopback URL the gateway also serves).
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app()),
                                      timeout=httpx.Timeout(600, connect=10))
        self.stats = {"episodes": 0, "episode_errors": 0, "episode_s": 0.0}

    def client_for(self, session_id: str):
        from openai import AsyncOpenAI

        # openai takes an httpx (not only httpx2) client at runtime; its annotation names httpx2's only
        return AsyncOpenAI(base_url=f"http://gateway/s/{session_id}/v1", api_key="factory",
                           http_client=self.http, max_retries=0)  # type: ignore[arg-type]

    def prompt(self, task: Task) -> tuple[list[dict], list[int]] | None:
        """A task's opening messages and their token ids, for the direct path (None: not direct)."""
        if not self.direct:
            return None
        messages = self.env.prompt_messages(task)
        return messages, self.gateway.render(messages)

    async def _play(self, session_id: str, task: Task, sampling: dict, prompt) -> EpisodeResult:
        if prompt is None:
            return await self.env.run_episode(self.client_for(session_id), self.gateway.model_name, task, sampling)
        messages, ids = prompt
        return await self.env.score_reply(task, await self.gateway.reply(session_id, messages, sampling, ids))

    async def episode(self, session_id: str, task: Task, sampling: dict | None = None, prompt=None):
        """Play one episode; `prompt`: `self.prompt(task)`, computed once for a group."""
        t0 = time.perf_counter()
        sampling = sampling if sampling is not None else self.sampling
        try:
            result = await self._play(session_id, task, sampling, prompt or self.prompt(task))
        except Exception:
            self.gateway.drop(session_id)
            self.stats["episode_errors"] += 1
            raise
        self.stats["episodes"] += 1
        self.stats["episode_s"] += time.perf_counter() - t0
        return result, time.perf_counter() - t0

    async def run_group(self, task: Task, group_id: str) -> Group:
        """G episodes of one task. If any episode raised, the group fails: the first episode's
        exception is raised, with its traceback (the env worker logs it; the buffer counts it)."""

        prompt = self.prompt(task)

        async def one(i: int):
            sid = f"{group_id}-{i}"
            result, seconds = await self.episode(sid, task, prompt=prompt)
            sample = self.gateway.finish(
                sid, sample_id=sid, group_id=group_id, task_id=task.task_id, reward=result.reward,
                env=self.env.name, info=result.info, timings={"episode_s": seconds},
            )
            if sample is None:
                raise RuntimeError(f"environment {self.env.name!r}: episode {sid} ended without calling the model "
                                   "(nothing was sampled to train on)")
            return sample

        outcomes = await asyncio.gather(*(one(i) for i in range(self.group_size)), return_exceptions=True)
        samples: list[Sample] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
            samples.append(outcome)
        return Group(group_id=group_id, task=task, samples=samples)

    async def evaluate(self, tasks: list[Task], sampling: dict, concurrency: int = 128, tag: str = "eval") -> EvalResult:
        """Mean reward of one episode per task (the held-out accuracy) and its standard error."""
        rewards = await self.rewards(tasks, sampling, concurrency, tag)
        return summarize(rewards, [t.family for t in tasks])

    async def rewards(self, tasks: list[Task], sampling: dict, concurrency: int = 128, tag: str = "eval") -> list[float]:
        """The reward of one episode per task, in the tasks' order."""
        return [reward for reward, _ in await self.episodes(tasks, sampling, concurrency, tag)]

    async def episodes(self, tasks: list[Task], sampling: dict, concurrency: int = 128, tag: str = "eval",
                       keep: bool = False) -> list[tuple[float, Sample | None]]:
        """One episode per task, in the tasks' order: (reward, its Sample when `keep`, else None).
        Sample ids are `{tag}-{index}`."""
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, task: Task) -> tuple[float, Sample | None]:
            async with sem:
                sid = f"{tag}-{i}"
                result, seconds = await self.episode(sid, task, sampling)
                if not keep:
                    self.gateway.drop(sid)
                    return result.reward, None
                return result.reward, self.gateway.finish(
                    sid, sample_id=sid, group_id=tag, task_id=task.task_id, reward=result.reward, env=self.env.name,
                    info=result.info, timings={"episode_s": seconds})

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))

    async def close(self) -> None:
        await self.http.aclose()


def summarize(rewards: list[float], families: list[str]) -> EvalResult:
    n = len(rewards)
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / max(1, n - 1)
    by: dict[str, list[float]] = {}
    for r, f in zip(rewards, families):
        by.setdefault(f, []).append(r)
    return EvalResult(mean, math.sqrt(var / n), n, {f: sum(v) / len(v) for f, v in by.items()})
