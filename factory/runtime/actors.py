"""Ray actors: thin wrappers that put engines, env workers, the buffer and the trainer in processes.

No RL logic lives here; every method forwards to a plain component.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from factory.recording.outage import first_line
from factory.paths import cache_dir
from factory.runtime.transfer import DirBundle, local_dir, node_ip
from factory.core.types import Batch, Group, Task

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from factory.recipe import AlgorithmSection, AsyncSection, FailuresSection, TrainSection
    from factory.training.trainer import Trainer
    from factory.model.weightsync import BucketPlan, WeightBroadcaster


def placed(actor_class, resources: dict[str, float] | None = None, **options):
    """`actor_class.options(...)` asking for `resources` (the recipe's `placement.<role>`): CPU and GPU
    become num_cpus / num_gpus, every other name a custom Ray resource (or `node:<ip>`)."""
    resources = dict(resources or {})
    if "CPU" in resources:
        options["num_cpus"] = resources.pop("CPU")
    if "GPU" in resources:
        options["num_gpus"] = resources.pop("GPU")
    if resources:
        options["resources"] = resources
    return actor_class.options(**options) if options else actor_class


@contextlib.contextmanager
def killed_on_error():
    """Yields a list; the actors appended to it are killed if the block raises. Actors otherwise live
    while a handle does, and a raised error's traceback holds the handles (seen: a failed run's env
    workers kept generating into the next run, on a Ray the run had not started). Callables appended
    to its `before_kill` run first (best effort), e.g. to save what the actors hold."""
    created = _Created()
    try:
        yield created
    except BaseException:
        for last_words in created.before_kill:
            try:
                last_words()
            except Exception as err:  # noqa: BLE001  (the run's own error matters more)
                logging.getLogger(__name__).warning("before killing the run's actors: %s", err)
        for actor in created:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001  (already gone; the run's own error matters)
                pass
        raise


class _Created(list):
    def __init__(self) -> None:
        super().__init__()
        self.before_kill: list = []


class Placed:
    """What every actor tells about where it runs."""

    def node_ip(self) -> str:
        return node_ip()

    def pid(self) -> int:
        return os.getpid()


def _stderr_logger(name: str) -> logging.Logger:
    """A logger writing to this process's stderr, which Ray forwards to the driver's terminal."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.INFO)
    return logger


def _log_path(path: str | None) -> Path | None:
    """The log file asked for, or one in this node's cache when its directory is not on this node."""
    if path is None:
        return None
    p = Path(path)
    return p if p.parent.is_dir() else cache_dir() / "logs" / p.name


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
        build = EngineBuild(path, rollout, _log_path(log_path), lora_rank, url, shape=shape)
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

    async def weight_checksum(self, name: str) -> float:
        """Sum (in float32) of one parameter as the engine holds it (vLLM; tests check an update is exact)."""
        return await self.engine.weight_checksum(name)

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


@ray.remote(num_cpus=0)
class BufferActor(Placed):
    """The staleness gate plus the task sampler: hands out admission tickets and batches."""

    def __init__(self, run_id: str, tasks: list[Task], async_: AsyncSection, train: TrainSection,
                 algorithm: AlgorithmSection, failures: FailuresSection, keep_discarded: bool = False,
                 lease_s: float = float("inf")):
        from factory.core.buffer import StalenessBuffer
        from factory.data.tasks import TaskSampler
        from factory.support.failures import FailureGate
        from factory.core.scheduling import DurationPredictor, LongestFirst

        self.run_id = run_id
        self.buffer = StalenessBuffer(train.groups_per_step, async_.max_staleness, async_.max_inflight_groups,
                                      algorithm.filter_zero_variance, async_.overprovision, keep_discarded,
                                      async_.expect_filtering)
        self.failed_groups: list[tuple[str, Any]] = []  # (group id, EpisodeFailure) until take_discarded
        self.sampler = TaskSampler(tasks, train.seed)
        self.tasks_by_id = {t.task_id: t for t in tasks}
        self.predictor = DurationPredictor()
        self.scheduler = (LongestFirst(self.sampler.next, self.predictor, async_.lookahead)
                          if async_.schedule == "longest_first" else None)
        self.next_group = 0
        self.inflight: dict[str, Task] = {}  # started, not finished: group id -> task (in start order)
        self.owners: dict[str, str] = {}  # group id -> the env worker (incarnation) running it
        # group id -> (its lease: the how-manieth hand-out of it, when the lease ends): a report or requeue
        # that names another lease is a stale one (the group was re-queued meanwhile) and changes nothing
        self.leases: dict[str, tuple[int, float]] = {}
        self.handouts: dict[str, int] = {}  # group id -> times handed out (the next lease's number)
        self.lease_s = lease_s
        self.expired = 0
        self._expiry: asyncio.Task | None = None
        self.last_answer: dict[str, tuple[int, list]] = {}  # owner -> (its last acquire call's number, tickets)
        self.retired: set[str] = set()  # env workers declared dead: a call of theirs still waiting gets nothing
        self.requeued = 0
        self.restart: collections.deque[tuple[str, Task]] = collections.deque()  # a resumed run's in-flight groups
        self.changed = asyncio.Condition()
        self.stopped = False
        self.gate = FailureGate(failures.max_in_a_row, failures.max_share, failures.min_groups)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def acquire(self, owner: str = "w0") -> tuple[str, Task, int] | None:
        """Wait for capacity; returns (group id, task, lease) or None once stopped. `owner`: the env worker's
        token (one per incarnation); a dead worker's call that was still waiting gets None, not a group
        nobody would run (seen: bench/chaos.py lost one that way). `lease`: the group's report names it;
        the lease ends `lease_s` after the hand-out or the owner's last `renew` of it, and then the group
        goes back to the queue (its worker cannot be reached, or lost the call's answer)."""
        tickets = await self.acquire_many(owner, 1)
        return None if tickets is None else tickets[0]

    async def acquire_many(self, owner: str = "w0", most: int = 1,
                           call: int | None = None) -> list[tuple[str, Task, int]] | None:
        """`acquire`, but up to `most` tickets in one call: all the capacity free when it returns (a
        batch taken or a group discarded frees several slots at once; one Ray call per slot cost
        the env worker and this actor ~1 ms of CPU each). `call`: the caller's number for this call; the
        same number again (a retry whose first answer a partition lost) gets the same tickets, not more."""
        self._watch_leases()
        async with self.changed:
            await self.changed.wait_for(lambda: self.stopped or owner in self.retired or self.buffer.capacity() > 0
                                        or self._answered(owner, call) is not None)
            again = self._answered(owner, call)
            if again is not None:
                return again
            if self.stopped or owner in self.retired:
                return None
            tickets: list[tuple[str, Task, int]] = []
            while len(tickets) < max(most, 1) and self.buffer.capacity() > 0:
                self.buffer.start()
                if self.restart:  # groups in flight at the checkpoint go first, under their own ids
                    group_id, task = self.restart.popleft()
                else:
                    group_id, task = f"{self.run_id}-g{self.next_group:07d}", (self.scheduler or self.sampler).next()
                    self.next_group += 1
                self.inflight[group_id] = task
                self.owners[group_id] = owner
                lease = self.handouts.get(group_id, 0)
                self.handouts[group_id] = lease + 1
                self.leases[group_id] = (lease, time.monotonic() + self.lease_s)
                tickets.append((group_id, task, lease))
            if call is not None:
                self.last_answer[owner] = (call, tickets)
            return tickets

    def _answered(self, owner: str, call: int | None) -> list[tuple[str, Task, int]] | None:
        """The tickets call `call` of `owner` was given already, those still running under their lease."""
        last = self.last_answer.get(owner)
        if call is None or last is None or last[0] != call:
            return None
        return [t for t in last[1] if self._current(t[0], t[2])]

    def renew(self, owner: str, leases: list[tuple[str, int]]) -> int:
        """The env worker `owner` still runs these (group id, lease): each lease ends `lease_s` from now.
        Returns how many were still its own."""
        until, renewed = time.monotonic() + self.lease_s, 0
        for group_id, lease in leases:
            held = self.leases.get(group_id)
            if held is not None and held[0] == lease and self.owners.get(group_id) == owner:
                self.leases[group_id] = (lease, until)
                renewed += 1
        return renewed

    def _current(self, group_id: str, lease: int | None) -> bool:
        """Whether a report or requeue of `group_id` under `lease` (None: any) is about its running hand-out."""
        held = self.leases.get(group_id)
        return group_id in self.inflight and (lease is None or held is None or held[0] == lease)

    def _watch_leases(self) -> None:
        if self._expiry is None and self.lease_s != float("inf"):
            self._expiry = asyncio.get_running_loop().create_task(self._expire_leases())

    async def _expire_leases(self) -> None:
        """Re-queue each running group whose lease ended: its worker has not renewed it for `lease_s`
        (a partition longer than that, or a hand-out whose answer never reached the worker)."""
        while not self.stopped:
            await asyncio.sleep(min(1.0, self.lease_s / 4))
            now = time.monotonic()
            ended = [g for g, (_, until) in self.leases.items() if until < now and g in self.inflight]
            if ended:
                self.expired += await self.requeue(ended)

    async def requeue(self, group_ids: list[str] | None = None, owner: str | None = None,
                      leases: list[int] | None = None) -> int:
        """Put running groups back at the head of the queue under their own ids, their slots released and
        no fate recorded: the groups `group_ids` (cut short by a lost engine; `leases`: under these leases
        only, so a worker's late call cannot take back a group handed out again), or every group the env
        worker `owner` ran (it died; it gets no group from now on). Returns how many."""
        if owner is not None:
            self.retired.add(owner)
        ids = group_ids if group_ids is not None else [g for g, o in self.owners.items() if o == owner]
        named = leases if leases is not None and group_ids is not None else [None] * len(ids)
        back = [(g, self.inflight.pop(g)) for g, lease in zip(ids, named) if self._current(g, lease)]
        for g, _ in back:
            self.owners.pop(g, None)
            self.leases.pop(g, None)
            self.buffer.release()
        self.restart.extendleft(reversed(back))
        self.requeued += len(back)
        await self._notify()
        return len(back)

    async def finish(self, group: Group | None, seconds: float | None = None, failure=None,
                     group_id: str | None = None, lease: int | None = None) -> str:
        """`failure`: the EpisodeFailure of the group `group_id` that raised (group None). `lease`: the
        hand-out reported on (None: whichever runs); a report on an earlier one is "requeued" and ignored."""
        status = self._finish(group, seconds, failure, group_id, lease)
        await self._notify()
        return status

    async def finish_many(self, reports: list[tuple]) -> list[str]:
        """Several `finish` calls' arguments in one Ray call (groups that finished together), in order."""
        statuses = [self._finish(*report) for report in reports]
        await self._notify()
        return statuses

    def _finish(self, group: Group | None, seconds: float | None, failure, group_id: str | None,
                lease: int | None = None) -> str:
        key = group.group_id if group is not None else group_id
        if key is not None:
            # re-queued meanwhile (its worker was declared dead, its lease ended), maybe handed out again:
            # this report is stale, and the group keeps one fate
            if not self._current(key, lease):
                return "requeued"
            self.inflight.pop(key, None)
            self.owners.pop(key, None)
            self.leases.pop(key, None)
        if group is not None and seconds is not None:
            self.predictor.observe(group.task, seconds)
        status = self.buffer.finish(group)
        if group is None and failure is not None and self.buffer.keep_discarded:
            self.failed_groups.append((group_id or "unknown", failure))
        if not self.stopped:  # groups cut short by the run's end are not the environment's fault
            self.gate.record(failure if group is None else None)
        return status

    async def get_batch(self) -> Batch | None:
        """The next batch; None once stopped. Raises EnvironmentFailure once failed groups pass the
        recipe's `failures` limits."""
        from factory.support.failures import EnvironmentFailure

        async with self.changed:
            await self.changed.wait_for(lambda: self.stopped or self.gate.tripped or self.buffer.ready())
            if self.gate.tripped:
                raise EnvironmentFailure(self.gate.message())
            batch = None if self.stopped else self.buffer.take_batch()
            if batch is not None:  # in group-id order, not finish order: one batch, one order, run after run
                batch.groups.sort(key=lambda g: g.group_id)
            return batch

    async def set_version(self, version: int) -> None:
        self.buffer.set_version(version)
        await self._notify()

    async def stop(self) -> None:
        self.stopped = True
        await self._notify()

    def take_discarded(self, unused: bool = False) -> tuple[list, list]:
        """What will never be trained, since the last call: ([(status, sample, reason)], [(group id,
        EpisodeFailure)]). `unused`: the queue too (the run has ended)."""
        if unused:
            self.buffer.drain_unused()
        failed, self.failed_groups = self.failed_groups, []
        return self.buffer.take_discarded(), failed

    def state_dict(self) -> dict[str, Any]:
        """Everything that decides what happens next: the buffer (queued groups included), the sampler's
        position, the groups in flight (re-started first on resume, under their ids), the scheduler's
        drawn-but-unstarted tasks and its duration predictor."""
        pending = [t.task_id for t in self.scheduler.pending] if self.scheduler else []
        inflight = [[gid, task.task_id] for gid, task in [*self.restart, *self.inflight.items()]]
        return {"buffer": self.buffer.state_dict(), "sampler": self.sampler.state_dict(), "next_group": self.next_group,
                "scheduler_pending": pending, "inflight": inflight, "predictor": self.predictor.state_dict()}

    def checkpoint_state(self) -> tuple[dict[str, Any], list, list]:
        """`state_dict` and `take_discarded` at one instant (a plain method runs between the actor's
        coroutines): each sample a resumed run will not regenerate is recorded before the checkpoint."""
        return (self.state_dict(), *self.take_discarded())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.sampler.load_state_dict(state["sampler"])
        self.next_group = state["next_group"]
        if "predictor" in state:
            self.predictor.load_state_dict(state["predictor"])
        self.restart = collections.deque((gid, self.tasks_by_id[tid]) for gid, tid in state.get("inflight", [])
                                         if tid in self.tasks_by_id)
        if self.scheduler:  # tasks drawn but not started before the checkpoint go first
            self.scheduler.window.extend((self.tasks_by_id[i], 0) for i in state.get("scheduler_pending", [])
                                         if i in self.tasks_by_id)

    def metrics(self) -> dict[str, float]:
        return {**self.buffer.metrics(), "buffer/failed_in_a_row": float(self.gate.in_a_row),
                "buffer/requeued_groups": float(self.requeued), "buffer/expired_leases": float(self.expired)}


# an env worker's Ray calls to the buffer: finished groups gathered for this long travel as one call;
# up to this many admission tickets per call
REPORT_WINDOW_S = 0.002
ACQUIRE_MOST = 16


@ray.remote(num_cpus=0)
class EnvWorkerActor(Placed):
    """Hosts a gateway and runs environment episodes against it, feeding groups to the buffer.
    `model`: a DirBundle or a path on this node (the tokenizer is read from it)."""

    def __init__(self, model: str | DirBundle, environment, rollout, engines: list, buffer, failures=None,
                 deadlines=None, owner: str = "w0", verifiers: Sequence[Mapping] = ()):
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
                                  support_k=support_k(rollout))
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
        self.failures = FailureLog(_stderr_logger("factory.env_worker"), (failures or FailuresSection()).tracebacks)
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


def _trainer(*args, **kwargs) -> Trainer:
    from factory.training.trainer import Trainer

    return Trainer(*args, **kwargs)


@ray.remote(num_cpus=0)
class TrainerActor(Placed):
    """The trainer on its node: one rank of `world_size` (`TrainerGroup` drives several as one). Rank
    0 owns the weight broadcast into the engines; every rank takes part in each call (the gathers of
    sharded weights are collectives), and the others' results are dropped. `model`: a DirBundle or a
    path on this node. Nothing it writes is read by path elsewhere: weights, adapters and checkpoints
    leave it as DirBundles."""

    def __init__(self, model: str | DirBundle, algorithm, train, rollout, shape: dict | None = None,
                 rank: int = 0, world_size: int = 1):

        self.args = (local_dir(model, "trainer model"), algorithm, train, rollout, shape)
        self.rank, self.world_size = rank, world_size
        self._store = None
        self.trainer: Trainer = _trainer(*self.args) if world_size == 1 else None  # type: ignore[assignment]  # set by join
        self.warm_up_s = 0.0
        self.bucket_bytes = rollout.bucket_mb << 20
        self.broadcaster: WeightBroadcaster | None = None
        self.plan: BucketPlan | None = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the trainer ranks' store, listening on this node's address; (address, port)."""
        from factory.model.weightsync import open_rendezvous

        self._store, port = open_rendezvous(node_ip(), self.world_size, 600.0)
        return node_ip(), port

    def join(self, host: str, port: int) -> None:
        """Form the ranks' process group (gloo on CPU, NCCL on CUDA), then build this rank's trainer."""
        from factory.support.devices import resolve_device
        from factory.training.parallel import init_trainer_group

        backend = "nccl" if resolve_device(self.args[2].device) == "cuda" else "gloo"
        init_trainer_group(self.rank, self.world_size, host, port, backend, node_ip(), store=self._store)
        self.trainer = _trainer(*self.args, rank=self.rank, world_size=self.world_size)

    def warm_up(self) -> float:
        """`train.warm_up`: the first pass's one-time costs now (`Trainer.warm_up`); `start_trainer` sends
        it without waiting, so it runs while the engines start, and the actor's later calls queue behind it."""
        if self.args[2].warm_up:
            try:
                self.warm_up_s = self.trainer.warm_up()
            except Exception as err:  # noqa: BLE001  (nobody waits for this call: say it, train cold)
                from factory.recording.outage import first_line

                logging.getLogger(__name__).warning("trainer warm-up failed (%s: %s); step 1 pays the first "
                                                    "pass's costs", type(err).__name__, first_line(err))
        return self.warm_up_s

    def threads(self) -> int:
        return self.trainer.threads

    def plan_json(self) -> str:
        from factory.model.weightsync import BucketPlan

        self.plan = BucketPlan.for_state(self.trainer.weight_shapes(), self.trainer.serving_dtype, self.bucket_bytes)
        return self.plan.to_json()

    def sync_backend(self, wanted: str) -> str:
        """The weight-sync collective: auto = nccl when this trainer computes on CUDA, else gloo."""
        if wanted != "auto":
            return wanted
        return "nccl" if self.trainer.device.type == "cuda" else "gloo"

    def open_broadcast(self, world_size: int, backend: str) -> tuple[str, int] | None:
        """Rank 0: start the rendezvous on this node's own address; returns (address, port) for the receivers."""
        from factory.model.weightsync import WeightBroadcaster

        if self.rank:
            return None
        self.broadcaster = WeightBroadcaster(node_ip(), world_size, backend)
        return self.broadcaster.host, self.broadcaster.port

    def join_broadcast(self) -> None:
        if self.rank:
            return
        if self.broadcaster is None:
            raise RuntimeError("join_broadcast before open_broadcast")
        self.broadcaster.connect()

    def broadcast(self) -> int:
        sent = self.stage_broadcast()
        if self.broadcaster is not None:
            self.broadcaster.wait()
        return sent

    def stage_broadcast(self) -> int:
        """Copy the weights into the staging buckets and send them from a background thread: returns at
        once (the bytes it sends), so the next train step overlaps the engines' drain and receive.
        The other ranks take part in gathering the sharded weights, bucket by bucket."""
        if self.rank:
            for _ in self.trainer.weight_items():
                pass
            return 0
        if self.broadcaster is None or self.plan is None:
            raise RuntimeError("broadcast before open_broadcast and plan_json")
        return self.broadcaster.stage(self.plan, self.trainer.weight_items())

    def export_weights(self, kind: str) -> tuple[DirBundle, int]:
        """`disk`: the policy as an HF model dir; `lora`: the adapter alone. As a bundle, and its bytes."""
        with tempfile.TemporaryDirectory(prefix="factory-export-") as tmp:
            if kind == "lora":
                self.trainer.save_adapter(tmp)
            else:
                self.trainer.save_hf(tmp)
            bundle = DirBundle.of(tmp, f"weights-{kind}")
        return bundle, bundle.nbytes

    def train_step(self, batch: Batch) -> dict[str, float]:
        return self.trainer.train_step(batch)

    def logprobs(self, samples, bf16: bool = False) -> list[list[float]]:
        return self.trainer.logprobs(samples, bf16)

    def weight_checksum(self, name: str, dtype: str) -> float:
        """Sum (in float32) of one weight rounded to `dtype`: what an engine serving that dtype must hold."""
        from factory.model.weightsync import DTYPES

        weight = next(t for n, t in self.trainer.weight_items() if n == name)  # every rank stops at the same name
        return float(weight.to(DTYPES[dtype]).float().sum())

    def checkpoint(self, extra: dict) -> DirBundle:
        """A checkpoint (see Trainer.save_checkpoint) as a bundle — this rank's part of it when there
        are several (`TrainerGroup` merges them); the driver writes it into the run dir."""
        with tempfile.TemporaryDirectory(prefix="factory-ckpt-") as tmp:
            self.trainer.save_checkpoint(Path(tmp) / "ckpt", extra)
            return DirBundle.of(Path(tmp) / "ckpt", "checkpoint")

    def load_checkpoint(self, checkpoint: str | DirBundle) -> dict:
        return self.trainer.load_checkpoint(local_dir(checkpoint, "checkpoint to resume from"))

    def version(self) -> int:
        return self.trainer.version

    def busy_seconds(self) -> float:
        return self.trainer.busy_s


@ray.remote(num_cpus=0)
class ScorerActor(Placed):
    """The scoring phase's model (e.g. a distillation teacher) in its own process. `teacher`: the teacher
    model as a DirBundle (shipped by the run) or a path on this node."""

    def __init__(self, distill, rollout, teacher: str | DirBundle):
        from factory.training.scoring import make_scorer

        local = local_dir(teacher, "algorithm.distill.teacher")
        scorer = make_scorer(distill.model_copy(update={"teacher": local}), rollout)
        if scorer is None:
            raise ValueError("ScorerActor: no teacher to score with (algorithm.distill.teacher)")
        self.scorer = scorer

    def score(self, batch: Batch):
        from factory.training.scoring import score_batch

        return score_batch(self.scorer, batch)
