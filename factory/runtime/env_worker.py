"""The env worker actor: a gateway to the engines and the episodes run against it, its groups reported to the buffer."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import ray

from factory.recording.outage import first_line
from factory.runtime.actor_base import Placed, stderr_logger
from factory.runtime.engine_actor import RemoteEngine
from factory.runtime.transfer import DirBundle, local_dir
from factory.core.types import Task

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence



# an env worker's Ray calls to the buffer: finished groups gathered for this long travel as one call;
# up to this many admission tickets per call
REPORT_WINDOW_S = 0.002
ACQUIRE_MOST = 16


@ray.remote(num_cpus=0)
class EnvWorkerActor(Placed):
    """Hosts a gateway and runs environment episodes against it, feeding groups to the buffer.
    `model`: a DirBundle or a path on this node (the tokenizer is read from it). `routing`: ask the
    engines for each sampled token's experts (routing replay, `factory.model.routing.wants_replay`)."""

    def __init__(self, model: str | DirBundle, environment, rollout, engines: list, buffer, failures=None,
                 deadlines=None, owner: str = "w0", verifiers: Sequence[Mapping] = (), routing: bool = False):
        from factory.support.lean_imports import lean_transformers

        lean_transformers()
        from factory.envs.base import make_environment
        from factory.support.failures import FailureLog
        from factory.model.tokens import load_tokenizer
        from factory.recipe import DeadlinesSection, FailuresSection
        from factory.rollout.engine import SamplingParams
        from factory.rollout.engines import support_k
        from factory.rollout.episodes import EpisodeRunner
        from factory.rollout.gateway import Gateway
        from factory.rewards.verifiers import warm_up

        tokenizer = load_tokenizer(local_dir(model, "env worker tokenizer"))  # without torch: ~4 CPU-s a run
        defaults = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                                  top_p=rollout.top_p, top_k=rollout.top_k, min_new_tokens=rollout.min_new_tokens,
                                  support_k=support_k(rollout), return_routing=routing)
        deadlines = deadlines or DeadlinesSection()
        self.engines = [RemoteEngine(e, deadlines.engine_call_s) for e in engines]
        self.gateway = Gateway(tokenizer, self.engines, defaults, seed=rollout.seed)
        self.owner = owner  # this worker's token: the buffer knows its groups by it
        self.env = make_environment(environment)
        sampling = {"temperature": rollout.temperature, "max_tokens": rollout.max_new_tokens}
        self.runner = EpisodeRunner(self.gateway, self.env, sampling, rollout.group_size, environment.direct)
        self.buffer = buffer
        self.partition_s = deadlines.partition_s
        self.lease_every_s = min(5.0, deadlines.partition_s / 4)  # the buffer's leases last partition_s
        self.producing = False
        self.tasks: set[asyncio.Task] = set()
        self.running: dict[str, int] = {}  # group id -> its lease, while this worker runs it (renewed)
        self._renewing: asyncio.Task | None = None
        self.calls = 0  # acquire calls made
        from factory.rollout.engine import Batcher

        # groups that finish within a few ms of each other (one engine answer ends many episodes) reach
        # the buffer in one Ray call
        self.reports = Batcher(self._report, REPORT_WINDOW_S)
        self.failures = FailureLog(stderr_logger("factory.env_worker"), (failures or FailuresSection()).tracebacks)
        # made while the engines start: the first replies are scored without waiting on imports (reasoning-gym
        # ~1 CPU-s, on the pipeline fill's critical path otherwise)
        warm_up(verifiers)

    async def start(self) -> int:
        return await self.gateway.serve()

    async def _buffer_call(self, method, *args, what: str):
        """A call to the buffer, tried again while it cannot be reached (a partition) for up to
        `deadlines.partition_s` (factory/runtime/transient.py)."""
        from factory.runtime.transient import acall

        return await acall(method, *args, partition_s=self.partition_s, what=f"the buffer ({what})",
                           on_retry=self.failures.logger.warning)

    async def _group(self, group_id: str, task: Task, lease: int = 0) -> None:
        """Run one group and report it; whatever happens, the buffer learns its fate or takes it back (a
        report it never gets ends its lease, and the group runs again)."""
        self.running[group_id] = lease
        try:
            await self._run_and_report(group_id, task, lease)
        except Exception as err:  # noqa: BLE001  (the buffer unreachable past deadlines.partition_s, or gone)
            if self.producing:  # not the groups cut short when the run stops
                self.failures.logger.warning("group %s: its report did not reach the buffer (%s); its lease "
                                             "ends and it runs again", group_id, first_line(err))
        finally:
            self.running.pop(group_id, None)

    async def _run_and_report(self, group_id: str, task: Task, lease: int) -> None:
        from factory.support.failures import EpisodeFailure

        t0 = time.perf_counter()
        failure = None
        losses = self.engine_losses()
        try:
            group = await self.runner.run_group(task, group_id)
        except Exception as err:  # the environment's, its reward's or its sandbox's: logged, then counted
            if self.engine_losses() != losses and self.producing:  # an engine died under it: not its fault
                await self._buffer_call(self.buffer.requeue, [group_id], None, [lease], what="requeue")
                return
            group, failure = None, EpisodeFailure.of(self.env.name, task.task_id, err)
            if self.producing:  # not the groups cut short when the run stops
                self.failures.record(failure)
        reported = asyncio.get_running_loop().create_future()
        self.reports.add(((group, time.perf_counter() - t0, failure, group_id, lease), reported))
        await reported

    async def _renew(self) -> None:
        """Every few seconds: the buffer learns that this worker still runs its groups (their leases)."""
        while self.producing:
            await asyncio.sleep(self.lease_every_s)
            if self.running:
                try:
                    await self._buffer_call(self.buffer.renew, self.owner, list(self.running.items()), what="renew")
                except Exception as err:  # noqa: BLE001  (unreachable past the deadline: the leases end there)
                    self.failures.logger.warning("renewing the leases of %d groups failed: %s",
                                                 len(self.running), first_line(err))

    async def _report(self, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        try:
            statuses = await self._buffer_call(self.buffer.finish_many, [report for report, _ in batch], what="report")
        except Exception as err:  # noqa: BLE001  (each group's task raises it, as its own call would)
            statuses = [err] * len(batch)
        for (_, future), status in zip(batch, statuses):
            if future.done():
                continue
            if isinstance(status, BaseException):
                future.set_exception(status)
            else:
                future.set_result(status)

    async def produce(self) -> None:
        """Start groups whenever the buffer admits them (as many as it has room for, per call), until
        `stop_producing`."""
        from factory.runtime.transient import Unreachable

        self.producing = True
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.create_task(self._renew())
        while self.producing:
            self.calls += 1  # one number per call, kept across its retries (the buffer answers a retry alike)
            try:
                tickets = await self._buffer_call(self.buffer.acquire_many, self.owner, ACQUIRE_MOST, self.calls,
                                                  what="acquire")
            except Unreachable as err:  # the run's driver decides whether the buffer is gone; keep asking
                self.failures.logger.warning("%s", err)
                continue
            if tickets is None:
                break
            for ticket in tickets:
                t = asyncio.create_task(self._group(*ticket))
                self.tasks.add(t)
                t.add_done_callback(self.tasks.discard)

    async def stop_producing(self) -> None:
        self.producing = False
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def episodes(self, tasks: list[Task], temperature: float, max_tokens: int, tag: str,
                       keep: bool = False) -> list[tuple[float, Any]]:
        """One evaluation episode per task, in order: (reward, its Sample when `keep`)."""
        return await self.runner.episodes(tasks, {"temperature": temperature, "max_tokens": max_tokens}, tag=tag,
                                          keep=keep)

    def engine_losses(self) -> int:
        return sum(e.losses for e in self.engines)

    async def replace_engine(self, i: int, actor) -> None:
        """The run restarted engine `i`: calls held for it go to `actor` from now on."""
        self.engines[i].replace(actor)

    async def metrics(self) -> dict[str, float]:
        m = self.gateway.metrics()
        m.update({f"env/{k}": float(v) for k, v in self.runner.stats.items()})
        m["env/failed_groups"] = float(self.failures.total)
        return m

    async def close(self) -> None:
        await self.runner.close()
        await self.gateway.close()

    async def release(self) -> bool:
        """The run's end for a process kept for the next run (factory/runtime/warm.py), after `close`: its
        lease renewal and any group task still alive cancelled, its environment's sandbox closed, its handles
        on the run's engines and buffer dropped. It may always be kept."""
        self.producing = False
        left = [t for t in (self._renewing, *self.tasks) if t is not None and not t.done()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, *self.reports.cancel(), return_exceptions=True)
        sandbox = getattr(self.env, "sandbox", None)
        if sandbox is not None and hasattr(sandbox, "close"):
            sandbox.close()
        self.engines, self.buffer, self.gateway, self.runner, self.env = [], None, None, None, None  # type: ignore[assignment]
        return True

    async def rebuild(self, *args, **kwargs) -> None:
        """A new run's env worker in this released process, whose imports are done: made as `__init__`
        makes one, with its arguments."""
        self.__init__(*args, **kwargs)  # type: ignore[misc]  # the constructor's own work, on a live actor
