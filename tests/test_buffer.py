"""StalenessBuffer: hand-worked admission examples and randomized invariants."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from factory.core.buffer import StalenessBuffer
from factory.core.types import NOT_SAMPLED, Group, Sample, Task

_ids = itertools.count()


def make_sample(reward: float, version: int, group_id: str = "g", num_tokens: int = 3) -> Sample:
    """A sample whose sampled tokens all come from `version`."""
    return Sample(
        sample_id=f"s{next(_ids)}",
        group_id=group_id,
        task_id="t",
        prompt_ids=[1, 2],
        completion_ids=[7] * num_tokens,
        logprobs=[-0.5] * num_tokens,
        loss_mask=[1] * num_tokens,
        versions=[version] * num_tokens,
        reward=reward,
    )


def make_group(rewards: list[float], versions: list[int] | int = 0) -> Group:
    """A group with one sample per reward; `versions` is one per sample or shared."""
    if isinstance(versions, int):
        versions = [versions] * len(rewards)
    group_id = f"g{next(_ids)}"
    task = Task(task_id="t", family="basic_arithmetic", question="1+1", answer="2")
    samples = [make_sample(r, v, group_id) for r, v in zip(rewards, versions)]
    return Group(group_id=group_id, task=task, samples=samples)


def start_n(buffer: StalenessBuffer, n: int) -> None:
    for _ in range(n):
        assert buffer.start()


# ---- hand-worked examples ------------------------------------------------------------------


def test_synchronous_capacity_opens_only_after_weights_are_published():
    buffer = StalenessBuffer(groups_per_step=2, max_staleness=0, max_inflight=100)
    assert buffer.capacity() == 2  # (0 + 0 + 1)·2 − 0
    start_n(buffer, 2)
    assert buffer.capacity() == 0  # 2 − (0 + 2)
    assert not buffer.start()
    assert buffer.finish(make_group([0.0, 1.0])) == "accepted"
    assert buffer.finish(make_group([1.0, 0.0])) == "accepted"
    assert buffer.capacity() == 0  # 2 − (2 + 0)
    batch = buffer.take_batch()
    assert batch is not None and batch.version == 0 and len(batch.groups) == 2
    assert buffer.capacity() == 0  # accepted still counts consumed groups
    buffer.set_version(1)
    assert buffer.capacity() == 2  # (0 + 1 + 1)·2 − 2


def test_one_step_off_policy_lets_the_next_step_generate_during_training():
    buffer = StalenessBuffer(groups_per_step=2, max_staleness=1, max_inflight=100)
    assert buffer.capacity() == 4  # (1 + 0 + 1)·2
    start_n(buffer, 4)
    assert buffer.capacity() == 0
    for _ in range(2):
        buffer.finish(make_group([0.0, 1.0]))
    assert buffer.take_batch() is not None
    assert buffer.capacity() == 0  # 4 − (2 + 2): step 1's groups already running
    buffer.set_version(1)
    assert buffer.capacity() == 2  # 6 − (2 + 2)


def test_max_inflight_bounds_capacity():
    buffer = StalenessBuffer(groups_per_step=4, max_staleness=3, max_inflight=3)
    assert buffer.capacity() == 3  # min(3 − 0, 16 − 0)
    start_n(buffer, 3)
    assert buffer.capacity() == 0
    assert not buffer.start()
    buffer.finish(make_group([0.0, 1.0]))
    assert buffer.capacity() == 1  # min(3 − 2, 16 − (1 + 2))


def test_zero_variance_group_is_filtered_and_capacity_reopens():
    buffer = StalenessBuffer(groups_per_step=1, max_staleness=0, max_inflight=10)
    start_n(buffer, 1)
    assert buffer.capacity() == 0
    assert buffer.finish(make_group([1.0, 1.0, 1.0])) == "filtered"
    assert buffer.capacity() == 1
    assert buffer.accepted == 0 and buffer.queued == 0 and buffer.filtered == 1


def test_zero_variance_group_is_kept_when_the_filter_is_off():
    buffer = StalenessBuffer(groups_per_step=1, max_staleness=0, max_inflight=10, filter_zero_variance=False)
    start_n(buffer, 1)
    assert buffer.finish(make_group([0.0, 0.0])) == "accepted"
    assert buffer.capacity() == 0


def test_failed_episode_frees_its_slot():
    buffer = StalenessBuffer(groups_per_step=1, max_staleness=0, max_inflight=10)
    start_n(buffer, 1)
    assert buffer.finish(None) == "failed"
    assert buffer.capacity() == 1 and buffer.failed == 1


def test_finish_without_start_is_an_error():
    buffer = StalenessBuffer(groups_per_step=1, max_staleness=0, max_inflight=10)
    with pytest.raises(RuntimeError):
        buffer.finish(make_group([0.0, 1.0]))


def test_sample_with_staleness_eta_plus_one_is_rejected():
    buffer = StalenessBuffer(groups_per_step=1, max_staleness=1, max_inflight=10)
    buffer.set_version(3)
    start_n(buffer, 1)
    # staleness 3 − 1 = 2 = η + 1 for the first sample; 1 and 0 for the others.
    group = make_group([0.0, 1.0, 0.5], versions=[1, 2, 3])
    assert buffer.finish(group) == "accepted"
    assert buffer.rejected_samples == 1
    batch = buffer.take_batch()
    assert batch is not None
    assert batch.staleness() == [1, 0]
    assert len(group.samples) == 3  # the caller's group is not modified


def test_group_left_with_one_fresh_sample_is_rejected():
    buffer = StalenessBuffer(groups_per_step=1, max_staleness=0, max_inflight=10)
    buffer.set_version(2)
    start_n(buffer, 1)
    assert buffer.finish(make_group([0.0, 1.0], versions=[1, 2])) == "rejected"
    assert buffer.rejected_samples == 1 and buffer.rejected_groups == 1
    assert buffer.accepted == 0 and buffer.capacity() == 3  # (0 + 2 + 1)·1 − 0


def test_group_whose_fresh_samples_have_equal_rewards_is_rejected():
    buffer = StalenessBuffer(groups_per_step=1, max_staleness=0, max_inflight=10)
    start_n(buffer, 1)
    buffer.set_version(1)
    assert buffer.finish(make_group([0.0, 1.0, 1.0], versions=[0, 1, 1])) == "rejected"


def test_oldest_token_decides_a_samples_version():
    buffer = StalenessBuffer(groups_per_step=1, max_staleness=1, max_inflight=10)
    buffer.set_version(2)
    start_n(buffer, 1)
    mixed = make_sample(0.0, 2)
    mixed.versions = [0, 2, 2]  # first chunk from version 0, resumed under version 2
    group = make_group([1.0, 0.5], versions=2)
    group.samples.append(mixed)
    assert buffer.finish(group) == "accepted"
    assert buffer.rejected_samples == 1


def test_sample_without_sampled_tokens_is_dropped():
    buffer = StalenessBuffer(groups_per_step=1, max_staleness=5, max_inflight=10)
    start_n(buffer, 1)
    group = make_group([0.0, 1.0, 0.5])
    group.samples[2].loss_mask = [0, 0, 0]
    group.samples[2].versions = [NOT_SAMPLED] * 3
    assert buffer.finish(group) == "accepted"
    assert buffer.rejected_samples == 1
    assert len(buffer.take_batch().samples) == 2


def test_set_version_purges_queued_groups_and_reopens_capacity():
    buffer = StalenessBuffer(groups_per_step=2, max_staleness=1, max_inflight=10)
    start_n(buffer, 1)
    assert buffer.finish(make_group([0.0, 1.0], versions=0)) == "accepted"
    assert buffer.capacity() == 3
    buffer.set_version(1)  # staleness 1 ≤ η: kept
    assert buffer.queued == 1
    buffer.set_version(2)  # staleness 2 > η: purged, its slot returns
    assert buffer.queued == 0 and buffer.accepted == 0 and buffer.purged_groups == 1
    assert buffer.rejected_samples == 2
    assert buffer.capacity() == 8  # (1 + 2 + 1)·2 − 0


def test_take_batch_purges_and_puts_back_when_short():
    buffer = StalenessBuffer(groups_per_step=2, max_staleness=1, max_inflight=10)
    buffer.set_version(2)
    start_n(buffer, 2)
    buffer.finish(make_group([0.0, 1.0], versions=1))
    buffer.finish(make_group([0.0, 1.0], versions=2))
    assert buffer.ready()
    buffer._version = 3  # simulate a version change that skipped the purge in set_version
    assert buffer.take_batch() is None
    assert buffer.queued == 1 and buffer.accepted == 1 and buffer.consumed == 0


def test_take_batch_returns_oldest_groups_first():
    buffer = StalenessBuffer(groups_per_step=2, max_staleness=2, max_inflight=10)
    start_n(buffer, 3)
    groups = [make_group([0.0, float(i + 1)]) for i in range(3)]
    for g in groups:
        buffer.finish(g)
    batch = buffer.take_batch()
    assert [g.group_id for g in batch.groups] == [groups[0].group_id, groups[1].group_id]
    assert buffer.take_batch() is None and buffer.queued == 1


def test_version_must_not_decrease():
    buffer = StalenessBuffer(groups_per_step=1, max_staleness=0, max_inflight=1)
    buffer.set_version(2)
    buffer.set_version(2)
    with pytest.raises(ValueError):
        buffer.set_version(1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(groups_per_step=0, max_staleness=0, max_inflight=1),
        dict(groups_per_step=1, max_staleness=-1, max_inflight=1),
        dict(groups_per_step=1, max_staleness=0, max_inflight=0),
    ],
)
def test_invalid_construction(kwargs):
    with pytest.raises(ValueError):
        StalenessBuffer(**kwargs)


def test_metrics_names_are_stable():
    buffer = StalenessBuffer(groups_per_step=2, max_staleness=1, max_inflight=3)
    metrics = buffer.metrics()
    for name in [
        "buffer/queued", "buffer/running", "buffer/accepted", "buffer/filtered",
        "buffer/rejected_samples", "buffer/failed", "buffer/capacity", "staleness/version",
    ]:
        assert isinstance(metrics[name], float)
    assert metrics["buffer/capacity"] == 3.0


def test_discarded_samples_carry_their_fate_and_the_queue_drains_as_unused():
    buffer = StalenessBuffer(groups_per_step=4, max_staleness=0, max_inflight=10, keep_discarded=True)
    start_n(buffer, 4)
    same = make_group([1.0, 1.0])
    buffer.finish(same)  # filtered
    half_stale = make_group([0.0, 1.0, 1.0], versions=[0, 0, 0])
    buffer.finish(half_stale)  # accepted at version 0
    buffer.set_version(1)  # now all of half_stale is too old: purged
    mixed = make_group([0.0, 1.0, 0.5], versions=[1, 1, 0])
    buffer.finish(mixed)  # its version-0 sample is stale; the rest is queued
    buffer.finish(make_group([0.0, 1.0], versions=1))
    fates = [(status, s.sample_id) for status, s, _ in buffer.take_discarded()]
    assert fates == ([("filtered", s.sample_id) for s in same.samples]
                     + [("rejected", s.sample_id) for s in half_stale.samples]
                     + [("rejected", mixed.samples[2].sample_id)])
    assert buffer.take_discarded() == []  # handed out once
    buffer.drain_unused()
    unused = buffer.take_discarded()
    assert {status for status, _, _ in unused} == {"unused"} and len(unused) == 4
    assert buffer.queued == 0 and buffer.accepted == buffer.consumed == 0
    quiet = StalenessBuffer(groups_per_step=2, max_staleness=0, max_inflight=10)
    start_n(quiet, 1)
    quiet.finish(make_group([1.0, 1.0]))
    assert quiet.take_discarded() == []  # nothing is kept unless asked (no lake: no memory growth)


def test_state_dict_round_trip_keeps_the_queue():
    import json

    buffer = StalenessBuffer(groups_per_step=2, max_staleness=1, max_inflight=10)
    start_n(buffer, 4)
    for _ in range(3):
        buffer.finish(make_group([0.0, 1.0]))
    buffer.finish(make_group([1.0, 1.0]))
    buffer.take_batch()
    buffer.set_version(1)
    start_n(buffer, 1)
    queued = [g.to_dict() for g in buffer._queue]
    state = json.loads(json.dumps(buffer.state_dict()))  # a checkpoint's state.json

    resumed = StalenessBuffer(groups_per_step=2, max_staleness=1, max_inflight=10)
    resumed.load_state_dict(state)
    assert resumed.version == 1
    # the queued group survives, whole; the running one is the caller's to re-start
    assert (resumed.consumed, resumed.accepted, resumed.running, resumed.queued) == (2, 3, 0, 1)
    assert [g.to_dict() for g in resumed._queue] == queued
    assert resumed.filtered == 1 and resumed.metrics()["buffer/finished_samples"] == 8
    assert resumed.capacity() == 3  # (1 + 1 + 1)·2 − 3


def test_a_checkpoint_without_a_queue_regenerates_it():
    old = {"version": 1, "consumed": 2, "filtered": 1}  # state.json of a checkpoint before queues were saved
    buffer = StalenessBuffer(groups_per_step=2, max_staleness=1, max_inflight=10)
    buffer.load_state_dict(old)
    assert (buffer.accepted, buffer.queued, buffer.capacity()) == (2, 0, 4)


def test_expect_filtering_starts_what_fills_the_batch_at_the_measured_acceptance():
    """B = 4, η = 1: the budget is 8 groups. With half the finished groups filtered, a running group
    counts as 0.5, so 16 may run; with none filtered it is the plain rule; off at η = 0."""
    def with_history(let_through: list[bool], **kw) -> StalenessBuffer:
        buffer = StalenessBuffer(groups_per_step=4, max_inflight=100, **kw)
        for informative in let_through:
            assert buffer.start()
            buffer.finish(make_group([0.0, 1.0] if informative else [1.0, 1.0]))
        return buffer

    plain = with_history([True, False] * 4, max_staleness=1)
    expecting = with_history([True, False] * 4, max_staleness=1, expect_filtering=True)
    assert plain.accepted == expecting.accepted == 4  # 4 accepted of 8 finished: 4 of the 8 budget left
    assert expecting.acceptance() == 0.5 and plain.capacity() == 4
    assert expecting.capacity() == 8  # ceil((8 - 4) / 0.5) - 0 running
    start_n(expecting, 3)
    assert expecting.capacity() == 5 and expecting.metrics()["buffer/acceptance"] == 0.5
    # every group let through: the plain rule
    assert with_history([True] * 3, max_staleness=1, expect_filtering=True).capacity() == 5
    # almost every group filtered: at most 1 / ACCEPTANCE_FLOOR = 8 times the open budget
    assert with_history([True] + [False] * 40, max_staleness=1, expect_filtering=True).capacity() == 7 * 8
    # synchronous: off
    assert with_history([True, False] * 2, max_staleness=0, expect_filtering=True).capacity() == 2  # 4 - 2
    # a resumed buffer measures from where it left off
    back = StalenessBuffer(groups_per_step=4, max_staleness=1, max_inflight=100, expect_filtering=True)
    back.load_state_dict(expecting.state_dict())
    assert back.acceptance() == 0.5


# ---- randomized invariants -----------------------------------------------------------------

buffer_configs = st.fixed_dictionaries(
    dict(
        groups_per_step=st.integers(1, 4),
        max_staleness=st.integers(0, 3),
        max_inflight=st.integers(1, 12),
        filter_zero_variance=st.booleans(),
        expect_filtering=st.booleans(),
    )
)


class LoopDriver:
    """Plays the rollout loop against a buffer, mirroring what it should count, and checks it.

    Sample versions are drawn from [version − η − 2, version], so some are too stale.
    set_version(v + 1) is only called once batch v has been taken, as in the real loop.
    """

    def __init__(self, config: dict) -> None:
        self.buffer = StalenessBuffer(**config, keep_discarded=True)
        self.batches_taken = 0
        self.running = 0
        self.finished: set[str] = set()  # every sample of every finished group
        self.trained: set[str] = set()
        self.discarded: dict[str, str] = {}  # sample id -> status

    def start(self, count: int) -> None:
        for _ in range(count):
            had_capacity = self.buffer.capacity() > 0
            assert self.buffer.start() == had_capacity
            self.running += had_capacity

    def finish(self, data, count: int) -> None:
        for _ in range(min(count, self.running)):
            self._finish_one(data)

    def _finish_one(self, data) -> None:
        b = self.buffer
        before = (b.accepted, b.filtered, b.rejected_groups, b.failed)
        if data.draw(st.integers(0, 9)) == 0:
            group = None
        else:
            size = data.draw(st.integers(1, 5))
            rewards = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=size, max_size=size))
            low = max(0, b.version - b.max_staleness - 2)
            one_version = st.integers(low, b.version).map(lambda v: [v] * size)  # the usual case
            mixed = st.lists(st.integers(low, b.version), min_size=size, max_size=size)
            group = make_group(rewards, data.draw(st.one_of(one_version, mixed)))
        outcome = b.finish(group)
        if group is not None:
            self.finished |= {s.sample_id for s in group.samples}
        self.running -= 1
        after = (b.accepted, b.filtered, b.rejected_groups, b.failed)
        expected_change = {
            "accepted": (1, 0, 0, 0), "filtered": (0, 1, 0, 0),
            "rejected": (0, 0, 1, 0), "failed": (0, 0, 0, 1),
        }[outcome]
        assert tuple(a - c for a, c in zip(after, before)) == expected_change

    def take_batch(self) -> None:
        b = self.buffer
        batch = b.take_batch()
        if batch is None:
            assert b.queued < b.groups_per_step
            return
        self.batches_taken += 1
        assert not self.trained & {s.sample_id for s in batch.samples}
        self.trained |= {s.sample_id for s in batch.samples}
        assert batch.version == b.version
        assert len(batch.groups) == b.groups_per_step
        assert all(0 <= s <= b.max_staleness for s in batch.staleness())
        for group in batch.groups:
            assert len(group.samples) >= 2
            if b.filter_zero_variance:
                assert len(set(group.rewards)) > 1

    def publish_weights(self) -> None:
        if self.batches_taken > self.buffer.version:  # weights v + 1 exist once batch v trained
            self.buffer.set_version(self.buffer.version + 1)

    def check(self) -> None:
        b = self.buffer
        for status, sample, reason in b.take_discarded():
            assert sample.sample_id not in self.discarded and status in ("filtered", "rejected") and reason
            self.discarded[sample.sample_id] = status
        # every generated sample has exactly one fate: trained, still queued, or discarded
        queued = {s.sample_id for g in b._queue for s in g.samples}
        fates = [self.trained, queued, set(self.discarded)]
        assert set().union(*fates) == self.finished
        assert sum(map(len, fates)) == len(self.finished)
        assert b.metrics()["buffer/finished_samples"] == len(self.finished)
        assert b.running == self.running
        assert 0 <= b.running <= b.max_inflight
        assert b.capacity() >= 0
        assert b.accepted == b.consumed + b.queued
        assert b.consumed == self.batches_taken * b.groups_per_step
        if not b.expect_filtering:  # (with it, groups beyond the budget run: their staleness is what is checked)
            assert b.accepted + b.running <= (b.max_staleness + b.version + 1) * b.groups_per_step
        assert all(b.staleness(s) <= b.max_staleness for g in b._queue for s in g.samples)


class BufferMachine(RuleBasedStateMachine):
    """Random interleavings of start / finish / take_batch / publish (no preconditions, so
    Hypothesis never discards a run; a call that does not apply is a no-op)."""

    @initialize(config=buffer_configs)
    def create(self, config):
        self.driver = LoopDriver(config)

    @rule(count=st.integers(1, 6))
    def start(self, count):
        self.driver.start(count)

    @rule(data=st.data(), count=st.integers(1, 6))
    def finish(self, data, count):
        self.driver.finish(data, count)

    @rule()
    def take_batch(self):
        self.driver.take_batch()

    @rule()
    def publish_weights(self):
        self.driver.publish_weights()

    @invariant()
    def accounting_is_consistent(self):
        self.driver.check()


BufferMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBufferMachine = BufferMachine.TestCase


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=buffer_configs,
    operations=st.lists(
        st.tuples(st.sampled_from(["start", "finish", "take_batch", "publish_weights"]), st.integers(1, 6)),
        min_size=40, max_size=120,
    ),
    data=st.data(),
)
def test_long_runs_keep_every_invariant(config, operations, data):
    """Long call sequences (the stateful machine tends to explore short ones) reach later
    versions, where stale samples and purges of queued groups actually happen."""
    driver = LoopDriver(config)
    for name, count in operations:
        if name == "start":
            driver.start(count)
        elif name == "finish":
            driver.finish(data, count)
        else:
            getattr(driver, name)()
        driver.check()
    event(f"reached version >= 2: {driver.buffer.version >= 2}")
    event(f"purged a queued group: {driver.buffer.purged_groups > 0}")


@settings(max_examples=60, deadline=None)
@given(
    groups_per_step=st.integers(1, 4),
    max_staleness=st.integers(0, 3),
    max_inflight=st.integers(1, 20),
    version=st.integers(0, 6),
    consumed_batches=st.integers(0, 6),
    filtered=st.integers(0, 50),
)
def test_resume_restores_a_consistent_buffer(
    groups_per_step, max_staleness, max_inflight, version, consumed_batches, filtered
):
    state = {"version": version, "consumed": consumed_batches * groups_per_step, "filtered": filtered}
    buffer = StalenessBuffer(groups_per_step, max_staleness, max_inflight)
    buffer.load_state_dict(state)
    assert buffer.running == 0 and buffer.queued == 0
    assert buffer.accepted == buffer.consumed
    assert buffer.state_dict()["version"] == version
    assert buffer.capacity() >= 0


# ---- time without a reward spread ----------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def since(buffer: StalenessBuffer) -> dict[str, float]:
    return {k.removeprefix("buffer/").removesuffix("_since_spread"): v for k, v in buffer.metrics().items()
            if k.endswith("_since_spread")}


def test_the_buffer_counts_groups_and_time_since_the_last_group_with_a_reward_spread():
    clock = FakeClock()
    buffer = StalenessBuffer(groups_per_step=4, max_staleness=0, max_inflight=100, clock=clock)
    clock.now += 30  # the evaluation before training: the buffer's clock has not started
    assert since(buffer) == {"groups": 0, "samples": 0, "reward": 0, "filtered": 0, "rejected": 0, "seconds": 0}
    start_n(buffer, 4)  # training starts: the first group's start starts the clock
    clock.now += 5
    buffer.finish(make_group([0.0, 0.0, 0.0]))  # filtered
    buffer.finish(make_group([1.0, 1.0, 1.0]))  # filtered
    assert buffer.finish(None) == "failed"  # the failure gate's: not counted here
    clock.now += 2
    assert since(buffer) == {"groups": 2, "samples": 6, "reward": 0.5, "filtered": 2, "rejected": 0, "seconds": 7}
    buffer.set_version(1)
    assert buffer.finish(make_group([0.0, 1.0], versions=0)) == "rejected"  # a spread, but stale: no signal
    assert since(buffer)["groups"] == 3 and since(buffer)["rejected"] == 1 and since(buffer)["seconds"] == 7
    start_n(buffer, 1)
    clock.now += 1
    assert buffer.finish(make_group([0.0, 1.0], versions=1)) == "accepted"  # let through: the count starts again
    clock.now += 3
    assert since(buffer) == {"groups": 0, "samples": 0, "reward": 0, "filtered": 0, "rejected": 0, "seconds": 3}


def test_without_the_filter_groups_of_equal_rewards_are_trained_and_still_count_as_no_spread():
    clock = FakeClock()
    buffer = StalenessBuffer(groups_per_step=2, max_staleness=0, max_inflight=100, filter_zero_variance=False,
                             clock=clock)
    start_n(buffer, 2)
    assert buffer.finish(make_group([0.0, 0.0])) == "accepted"
    assert buffer.finish(make_group([0.5, 0.5])) == "accepted"
    clock.now += 9
    assert since(buffer) == {"groups": 2, "samples": 4, "reward": 0.25, "filtered": 0, "rejected": 0, "seconds": 9}
    buffer.take_batch()
    buffer.set_version(1)
    start_n(buffer, 1)
    # a spread among the fresh samples only counts: this group's stale one is dropped, the rest are equal
    assert buffer.finish(make_group([1.0, 0.0, 0.0], versions=[0, 1, 1])) == "accepted"
    assert since(buffer)["groups"] == 3
    start_n(buffer, 1)
    assert buffer.finish(make_group([1.0, 0.0], versions=1)) == "accepted"
    assert since(buffer)["groups"] == 0
