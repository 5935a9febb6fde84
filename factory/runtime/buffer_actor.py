"""The buffer actor: the staleness gate, the task sampler and the leases of the groups running."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING, Any

import ray

from factory.runtime.actor_base import Placed
from factory.core.types import Batch, Group, Task

if TYPE_CHECKING:

    from factory.recipe import AlgorithmSection, AsyncSection, FailuresSection, TrainSection


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
