"""The rollout engine actor, and how an env worker calls it (`RemoteEngine`: calls batched, a lost
engine's calls held until its replacement)."""

from __future__ import annotations

import asyncio
import os
import time

import ray

from factory.paths import cache_dir
from factory.runtime.actor_base import Placed, node_log_path
from factory.runtime.transfer import DirBundle, local_dir, node_ip


class WeightGroupChanged(RuntimeError):
    """An engine's weight update was superseded: its weight group was formed anew under it (`EngineActor.update`)."""


@ray.remote(num_cpus=0)
class EngineActor(Placed):
    """A rollout engine on its node. `model`: a DirBundle (shipped by the run) or a path on this node;
    with `url` it attaches to that running server instead of starting one."""

    def __init__(self, kind: str, model: str | DirBundle, rollout, log_path: str | None = None, lora_rank: int = 0,
                 url: str | None = None, shape: dict | None = None):
        from factory.rollout.engines import EngineBuild, make_engine

        from factory.rollout.engines import ENGINES

        path = local_dir(model, "rollout engine model") if url is None else str(getattr(model, "name", model))
        build = EngineBuild(path, rollout, node_log_path(log_path), lora_rank, url, shape=shape)
        self.engine = make_engine(kind, build)
        self.threads = None if url else build.threads  # an attached server has its own
        self.kind = ENGINES[kind]  # what it can do (partial-rollout modes, sync modes, LoRA, attach)
        self.scratch = cache_dir() / "sync" / f"engine-{os.getpid()}"
        self.weight_group = 0  # which weight group this engine belongs to: one more at each init_broadcast
        self.updates_begun = 0

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    async def generate(self, prompt_ids, sampling, request_id):
        return await self.engine.generate(prompt_ids, sampling, request_id)

    async def generate_many(self, requests: list[tuple]) -> list:
        """Many `generate` calls in one Ray call: each result is a Generation or the exception it raised.
        Where calls failed because the engine behind its live server died (`EngineDead`, from one health
        probe after a failure), each failure is that: the engine is lost, not the episodes."""
        results = await asyncio.gather(*(self.engine.generate(*r) for r in requests), return_exceptions=True)
        failed = [i for i, r in enumerate(results) if isinstance(r, Exception) and not engine_lost(r)]
        probe = getattr(self.engine, "dead", None)
        dead = await probe() if failed and probe is not None else None
        if dead is not None:
            for i in failed:
                results[i] = dead
        return results

    async def weight_checksum(self, name: str, accumulate: str = "float32") -> float:
        """Sum (in `accumulate`) of one parameter as the engine holds it (vLLM; tests check an update is exact)."""
        return await self.engine.weight_checksum(name, accumulate)

    async def set_partial_rollout(self, mode: str) -> None:
        """Switch what happens to in-flight requests at an update (a shared engine serves many runs)."""
        if mode not in self.kind.partial_rollouts:
            raise ValueError(f"rollout.partial_rollout={mode}: rollout.engine={self.kind.name} supports "
                             f"{', '.join(self.kind.partial_rollouts)}")
        self.engine.partial = mode

    async def init_broadcast(self, host: str, port: int, rank: int, world_size: int, plan_json: str,
                             backend: str = "gloo") -> None:
        """Join the trainer's weight group from this node's own address."""
        self.weight_group += 1  # first: an update draining meanwhile must not take this group's broadcast
        await self.engine.init_broadcast(host, port, rank, world_size, plan_json, node_ip(), backend)

    async def load_bundle(self, bundle: DirBundle, kind: str) -> None:
        """Weights (`disk`: an HF model dir) or a LoRA adapter (`lora`) that came over the network:
        written to this node's scratch directory, then loaded from there."""
        path = str(bundle.write(self.scratch / kind))
        if kind == "lora":
            await self.engine.load_lora(path)
        else:
            await self.engine.load_from_disk(path)

    async def close_admission(self) -> None:
        """Stop admitting new requests (those inside carry on): from here on a request waits for the
        update under way and is sampled by the new weights. Only `wait` closes it early: in
        `abort_resume` and `inflight` a request that starts now is caught by the update with the rest
        (aborted and continued, or frozen) and carries on under the new weights, each token labelled
        with its version; closing early would let the running ones finish first and no sample would
        span the update, which is what those modes are for."""
        if self.engine.partial == "wait":
            self.engine.gate.close()

    async def update(self, version: int, mode: str, bundle: DirBundle | None = None) -> dict[str, float]:
        """A whole weight update in one call: drain, take the weights (`broadcast`: from the trainer's
        group; `disk` / `lora`: a bundle), reopen at `version`. Returns the seconds of each phase.

        A broadcast update whose weight group was formed anew while it drained (the run gave up on it:
        the engine hung or was lost under it, and the supervisor reconnected) takes no weights: the
        broadcast it was for went to the old group, and the new group's belongs to the update sent with
        it, which it would otherwise take (that update then waited out the group's timeout: seen once in
        the suite, an attached engine stopped under an update). It reopens the engine at the version it
        holds if no later update has begun, and fails (`WeightGroupChanged`), which the run ignores."""
        group, self.updates_begun = self.weight_group, self.updates_begun + 1
        mine = self.updates_begun
        t0 = time.perf_counter()
        await self.engine.begin_update()
        t1 = time.perf_counter()
        if mode == "broadcast" and self.weight_group != group:
            if self.updates_begun == mine:
                await self.engine.end_update(self.engine.version)
            raise WeightGroupChanged(f"the weight update to version {version} was superseded: the weight group "
                                     f"was formed anew while it drained")
        if mode == "broadcast":
            await self.engine.receive_broadcast()
        elif bundle is None:
            raise ValueError(f"a {mode} weight update needs a bundle")
        else:
            await self.load_bundle(bundle, mode)
        t2 = time.perf_counter()
        await self.engine.end_update(version)
        t3 = time.perf_counter()
        return {"drain_s": t1 - t0, "transfer_s": t2 - t1, "reopen_s": t3 - t2}

    async def health(self, timeout_s: float) -> tuple[bool, str] | None:
        """None when the engine's server answers within `timeout_s`; else (dead, why) (see `ServerClient.health`).
        An in-process engine (HF) is as alive as this actor."""
        probe = getattr(self.engine, "health", None)
        return None if probe is None else await probe(timeout_s)

    async def metrics(self) -> dict[str, float]:
        return {**self.engine.metrics(), **({"rollout/engine_threads": self.threads} if self.threads else {})}

    async def url(self) -> str | None:
        return getattr(self.engine, "url", None)


class RemoteEngine:
    """Lets the gateway await a Ray engine actor as if it were a local engine; a call that takes longer
    than `deadline_s` (`deadlines.engine_call_s`) is cancelled and fails its episode.

    Calls that arrive within `window_s` of the first travel as one Ray call (`generate_many`), each
    answered as soon as that call returns. Why: a Ray call costs a few ms of CPU on each side; one per
    prompt was most of the engine actor's CPU and a large share of the env worker's
    (bench/step_anatomy.py), on cores the engine and trainer need. The engine coalesces them into
    HTTP batches as before.

    An engine that is lost (its actor gone, its server unreachable) fails its waiting calls with
    `EngineLost` and holds new ones until the run's supervisor hands over a restarted engine
    (`replace`); `losses` counts the losses, so an env worker can tell a group cut short by one from
    a group its environment failed."""

    def __init__(self, actor, deadline_s: float | None = None, window_s: float = 0.002):
        from factory.rollout.engine import Batcher

        self.actor = actor
        self.deadline_s = deadline_s
        self._batcher = Batcher(self._call, window_s)
        self.available = asyncio.Event()
        self.available.set()
        self.losses = 0

    def replace(self, actor) -> None:
        self.actor = actor
        self.available.set()

    async def generate(self, prompt_ids, sampling, request_id):
        await self.available.wait()
        future = asyncio.get_running_loop().create_future()
        self._batcher.add(((prompt_ids, sampling, request_id), future))
        return await future

    async def _call(self, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        actor = self.actor
        ref = actor.generate_many.remote([request for request, _ in batch])
        try:
            results = await asyncio.wait_for(ref, self.deadline_s)
        except TimeoutError:
            ray.cancel(ref)
            from factory.support.failures import DeadlineExceeded

            results = [DeadlineExceeded(f"engine call {request[2]}: no generation within deadlines.engine_call_s="
                                        f"{self.deadline_s:g} s (is the engine stalled or overloaded?)")
                       for request, _ in batch]
        except Exception as err:  # noqa: BLE001  (the actor is gone or failed: every waiter learns of it)
            results = [err] * len(batch)
        if any(engine_lost(r) for r in results):
            if actor is self.actor:  # not yet replaced: hold new calls until it is
                self.available.clear()
            self.losses += 1
            results = [EngineLost(f"rollout engine lost: {type(r).__name__}: {r}") if engine_lost(r) else r
                       for r in results]
        for (_, future), result in zip(batch, results):
            if future.done():  # its episode was cancelled meanwhile
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


class EngineLost(RuntimeError):
    """A generation cut short because its engine died or stopped answering (its group is re-queued)."""


def engine_lost(result) -> bool:
    """Is this call's outcome the engine's loss (its actor gone; its server's connection refused, reset or
    closed mid-answer), as opposed to a request the engine refused or an answer?"""
    import httpx

    from factory.rollout.server import EngineDead

    if isinstance(result, (ray.exceptions.RayActorError, EngineLost, EngineDead)):
        return True
    if isinstance(result, ray.exceptions.RayTaskError):
        result = result.cause
    return isinstance(result, (httpx.TransportError, EngineLost, EngineDead))
