"""Groups cut short by a lost engine or a dead env worker go back to the head of the buffer's queue
under their ids, their slots released and no fate counted (pure logic: the buffer actor's class run
in this process, no Ray)."""

from __future__ import annotations

import asyncio

from factory.recipe import Recipe
from factory.runtime.actors import BufferActor
from factory.core.types import Task


def buffer_actor(groups_per_step: int = 2, max_staleness: int = 1, lease_s: float = float("inf")):
    recipe = Recipe.model_validate({"train": {"groups_per_step": groups_per_step},
                                    "async": {"max_staleness": max_staleness}})
    tasks = [Task(task_id=f"t{i}", family="basic_arithmetic", question=f"{i}+1", answer=str(i + 1)) for i in range(50)]
    cls = BufferActor.__ray_metadata__.modified_class  # the actor's own class, run here without Ray
    return cls("r", tasks, recipe.async_, recipe.train, recipe.algorithm, recipe.failures, lease_s=lease_s)


def test_requeued_groups_start_again_first_under_their_ids_with_no_fate():
    async def go():
        b = buffer_actor()
        first = [await b.acquire(owner="w0"), await b.acquire(owner="w1"), await b.acquire(owner="w0")]
        running = b.buffer.running
        assert await b.requeue(None, owner="w0") == 2  # the dead worker 0's two groups
        assert b.buffer.running == running - 2 and b.buffer.failed == 0
        again = [await b.acquire(owner="w1"), await b.acquire(owner="w1")]
        assert [t[:2] for t in again] == [first[0][:2], first[2][:2]]  # in their start order, ids and tasks unchanged
        assert b.metrics()["buffer/requeued_groups"] == 2
        # a group re-queued by its engine's loss, then finished by nobody: one fate once it runs again
        assert await b.requeue([first[1][0]]) == 1
        assert await b.requeue([first[1][0]]) == 0  # not running any more: nothing to re-queue
        gid, task, lease = await b.acquire(owner="w1")
        assert gid == first[1][0] and lease == 1  # its second hand-out
        return b

    asyncio.run(go())


def test_a_finish_after_its_group_was_requeued_is_ignored():
    async def go():
        b = buffer_actor()
        gid, _, _ = await b.acquire(owner="w0")
        await b.requeue(None, owner="w0")
        group_failed_late = await b.finish(None, 1.0, failure=None, group_id=gid)  # the old worker's last word
        assert group_failed_late == "requeued" and b.buffer.failed == 0
        assert (await b.acquire(owner="w1"))[0] == gid

    asyncio.run(go())


def test_a_dead_workers_waiting_acquire_gets_no_group():
    """The dead worker's call for a group that was still waiting for capacity when it died ends with
    nothing, instead of taking a group no one would ever run."""
    async def go():
        b = buffer_actor(groups_per_step=1, max_staleness=0)
        held = [await b.acquire(owner="w0") for _ in range(b.buffer.capacity())]
        waiting = asyncio.ensure_future(b.acquire(owner="w0"))  # no capacity: it waits
        await asyncio.sleep(0.01)
        assert not waiting.done()
        assert await b.requeue(None, owner="w0") == len(held)  # w0 died; its groups go back
        assert await waiting is None
        assert (await b.acquire(owner="w0.1"))[0] == held[0][0]  # its replacement runs them

    asyncio.run(go())


def test_many_tickets_and_reports_per_call_match_one_at_a_time():
    """`acquire_many` hands out the free capacity (up to `most`) in the order single `acquire`s would,
    and `finish_many` settles several groups in one call, in order, waking a waiting acquire."""
    from factory.core.types import Group, Sample

    def group(gid: str, task, rewards: list[float]) -> Group:
        samples = [Sample(f"{gid}-{i}", gid, task.task_id, [1], [2], [-0.1], [1], [0], reward=r)
                   for i, r in enumerate(rewards)]
        return Group(gid, task, samples)

    async def go():
        one, many = buffer_actor(groups_per_step=2, max_staleness=1), buffer_actor(groups_per_step=2, max_staleness=1)
        room = many.buffer.capacity()
        assert room > 3
        singles = [await one.acquire(owner="w0") for _ in range(room)]
        first = await many.acquire_many("w0", 3)
        rest = await many.acquire_many("w0", 100)
        assert first + rest == singles and len(first) == 3  # all the room, no more, same ids and tasks
        assert many.buffer.capacity() == 0
        waiting = asyncio.ensure_future(many.acquire_many("w0", 100))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        (g0, t0, _), (g1, t1, _), (g2, _, _) = first
        statuses = await many.finish_many([(group(g0, t0, [0.0, 1.0]), 1.0, None, g0),
                                           (group(g1, t1, [1.0, 1.0]), 1.0, None, g1),  # no variance
                                           (None, 1.0, None, g2)])  # its episode raised
        assert statuses == ["accepted", "filtered", "failed"]
        assert statuses == [await one.finish(group(g0, t0, [0.0, 1.0]), 1.0, None, g0),
                            await one.finish(group(g1, t1, [1.0, 1.0]), 1.0, None, g1),
                            await one.finish(None, 1.0, None, g2)]
        woken = await asyncio.wait_for(waiting, 5)  # the freed slots, at once
        assert woken and many.buffer.capacity() == 0
        assert [t[0] for t in woken] == [t[0] for t in [await one.acquire(owner="w0") for _ in woken]]

    asyncio.run(go())


def group_of(gid: str, task, rewards: list[float]):
    from factory.core.types import Group, Sample

    return Group(gid, task, [Sample(f"{gid}-{i}", gid, task.task_id, [1], [2], [-0.1], [1], [0], reward=r)
                             for i, r in enumerate(rewards)])


def test_a_lease_not_renewed_sends_its_group_back_and_its_late_report_changes_nothing():
    """A worker cut off by a partition longer than the lease: its group runs again (under its id, a new
    lease); the cut-off worker's report, arriving after the link comes back, is stale, and the group
    keeps one fate: the one reported under the current lease."""
    async def go():
        b = buffer_actor(lease_s=0.3)
        gid, task, lease = await b.acquire(owner="w0")
        kept, kept_task, kept_lease = await b.acquire(owner="w0")
        for _ in range(12):  # the worker renews one group only (the other's answer was lost, say)
            await asyncio.sleep(0.1)  # the expiry check runs about every lease_s / 4
            assert b.renew("w0", [(kept, kept_lease)]) == 1
        assert gid not in b.inflight and kept in b.inflight  # renewed: still running
        assert b.renew("w0", [(gid, lease)]) == 0  # too late: not its group any more
        assert b.metrics()["buffer/expired_leases"] >= 1
        again = await b.acquire(owner="w0")
        assert again == (gid, task, lease + 1)
        late = await b.finish(group_of(gid, task, [0.0, 1.0]), 1.0, None, gid, lease)  # the old hand-out's report
        assert late == "requeued" and b.buffer.accepted == 0
        assert await b.requeue([gid], None, [lease]) == 0  # nor can the old hand-out take it back
        now = await b.finish(group_of(gid, task, [0.0, 1.0]), 1.0, None, gid, lease + 1)
        assert now == "accepted"
        assert await b.finish(group_of(gid, task, [0.0, 1.0]), 1.0, None, gid, lease + 1) == "requeued"  # once
        await b.stop()

    asyncio.run(go())


def test_leases_are_renewed_only_by_their_owner_and_lease():
    async def go():
        b = buffer_actor(lease_s=60)
        gid, _, lease = await b.acquire(owner="w0")
        assert b.renew("w1", [(gid, lease)]) == 0 and b.renew("w0", [(gid, lease + 1)]) == 0
        assert b.renew("w0", [(gid, lease)]) == 1
        await b.stop()

    asyncio.run(go())


def test_a_retried_acquire_gets_the_tickets_its_lost_answer_held():
    """A partition lost the answer of an acquire call that ran: its retry (the same call number) gets the
    same tickets, so no group is handed out to nobody; the next call gets new ones."""
    async def go():
        b = buffer_actor(lease_s=60)
        first = await b.acquire_many("w0", 2, call=1)
        assert await b.acquire_many("w0", 2, call=1) == first  # the retry
        running = b.buffer.running
        second = await b.acquire_many("w0", 2, call=2)
        assert {t[0] for t in second}.isdisjoint(t[0] for t in first) and b.buffer.running == running + len(second)
        assert await b.finish(group_of(first[0][0], first[0][1], [0.0, 1.0]), 1.0, None, first[0][0], first[0][2])
        assert await b.acquire_many("w0", 2, call=2) == second  # a retry still gets what it was given
        await b.stop()

    asyncio.run(go())
