"""The staleness gate between rollouts and the trainer, in units of groups.

A group is the G completions of one prompt. The buffer decides when a new group may start
(AReaL-style admission), which finished groups enter the queue (dynamic-sampling filter and
per-sample staleness rejection) and hands the trainer batches of B groups.

Pure Python: no Ray, no torch. Not thread-safe; drive it from one event loop.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from factory.core.types import NOT_SAMPLED, Batch, Group, Sample

ACCEPTED = "accepted"
FILTERED = "filtered"
REJECTED = "rejected"
FAILED = "failed"
UNUSED = "unused"  # queued, never trained: the run ended first

ACCEPTANCE_WINDOW = 64  # finished groups p̂ is measured over (expect_filtering)
ACCEPTANCE_FLOOR = 0.125  # p̂ never counts below this: at most 8x the open budget starts (and max_inflight caps it)
MIN_GROUP_SIZE = 2  # fewer than two samples leaves no baseline to compare a reward against


class StalenessBuffer:
    """Staleness-gated admission of groups with a queue the trainer takes batches from.

    Notation: B = `groups_per_step` (groups per optimizer step), η = `max_staleness`,
    v = `version` (the policy version the engines serve: the number of optimizer steps whose
    weights have been published), `running` = groups started but not finished, `accepted` =
    groups ever accepted into the queue (consumed or not) minus those later purged as stale.

    Admission. A new group may start while `capacity() > 0`, where

        capacity = max(0, min(max_inflight − running, (η + v + 1)·B + O − (accepted + running)))

    where O = `overprovision` (0 by default; the rest of this docstring assumes it). With O > 0,
    O groups beyond the budget run alongside, so a step takes the first B groups to finish
    rather than waiting for the slowest; a late one whose samples went stale meanwhile is
    rejected by the per-sample rule below (the price of not waiting).

    Every group that is running or was accepted will be trained on by some step; the rule caps
    that total at the groups steps 0 … v+η can consume, so no group is started more than η
    versions ahead of the weights that will train on it:

    - η = 0 (synchronous): at v = 0 exactly B groups may start. Once they are accepted and taken
      as batch 0, capacity stays 0 until the weights of step 1 are published (`set_version(1)`);
      generation for version v+1 never overlaps training at v.
    - η = 1 (one-step off-policy): 2B groups may be started or accepted ahead, so generation
      for step v+1 runs while the trainer works on step v, with samples at most one version old.
    - η = k: up to (k+1)·B groups ahead; samples may be up to k versions old.

    Per-sample staleness. A sample's staleness is v − (the version of its oldest sampled token).
    Samples with staleness > η are dropped when a group finishes, again whenever the version
    advances, and once more before a batch is returned, so a batch never holds a sample with
    staleness > η. A sample with no sampled token has no behaviour version and nothing to train
    on; it is dropped the same way. A group left with fewer than 2 samples is rejected (at
    finish) or purged (later); purging lowers `accepted`, which reopens capacity.

    Dynamic-sampling filter (`filter_zero_variance`). A group whose rewards are all equal gives
    every sample advantage r − mean(r) = 0 and so no gradient; it is "filtered": not queued, not
    counted as accepted, so its slot is refilled by a new group.

    Accounting invariants: accepted = consumed + queued, and
    accepted + running ≤ (η + v + 1)·B + O.

    Expected filtering (`expect_filtering`, η ≥ 1 with the filter on). The rule above counts every
    running group as if it will be accepted. When most groups are filtered (an easy task set, a
    policy that already solves it), a step's slots refill round after round, each round a whole
    generation's latency with a few groups in it, and the engine idles between rounds. With
    `expect_filtering` a running group counts as p̂, the share of the last ACCEPTANCE_WINDOW finished
    groups that the filter let through (failed ones count as not let through; floor
    ACCEPTANCE_FLOOR); a new group may start while
        running < ⌈((η + v + 1)·B + O − accepted) / p̂⌉   (and running < max_inflight),
    which is the rule above when p̂ = 1. A group accepted beyond the budget is trained by a later
    step if it is still fresh enough, else dropped as stale (the price, as with O). Off at η = 0:
    a synchronous step trains exactly the groups it started for it (reproducible runs).

    Reward spread (`since_spread`): a group "has a spread" when it is queued for training with rewards that
    are not all equal (the only groups whose advantages are not all 0). Since the last such group the
    buffer counts the finished groups (failed ones are the failure gate's), their samples, their mean
    reward and the seconds (from the first group's start when none had a spread yet); the run warns and
    stops on it (`factory.support.failures.SpreadWatch`). Not checkpointed: a resumed run counts afresh.

    Discards (`keep_discarded`): every sample that will never be trained is kept, with its fate
    (`filtered`, `rejected`, or `unused` for what `drain_unused` empties from the queue at the end) and
    the reason, until `take_discarded` hands them to the recorder: the lake holds every generated
    sample, not only the trained ones.
    """

    def __init__(
        self,
        groups_per_step: int,
        max_staleness: int,
        max_inflight: int,
        filter_zero_variance: bool = True,
        overprovision: int = 0,
        keep_discarded: bool = False,
        expect_filtering: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if groups_per_step <= 0:
            raise ValueError(f"groups_per_step must be > 0, got {groups_per_step}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if max_inflight <= 0:
            raise ValueError(f"max_inflight must be > 0, got {max_inflight}")
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.max_inflight = max_inflight
        self.filter_zero_variance = filter_zero_variance
        if overprovision < 0:
            raise ValueError(f"overprovision must be >= 0, got {overprovision}")
        self.overprovision = overprovision
        self.keep_discarded = keep_discarded
        self.expect_filtering = expect_filtering and filter_zero_variance and max_staleness > 0
        self._let_through: deque[bool] = deque(maxlen=ACCEPTANCE_WINDOW)  # per finished group: not filtered/failed
        self._discarded: list[tuple[str, Sample, str]] = []  # (status, sample, reason)

        self._version = 0
        self._queue: deque[Group] = deque()
        # Read-only counters (public for metrics and tests; change them only through methods).
        self.running = 0  # started, not yet finished
        self.accepted = 0  # accepted into the queue, minus those purged as stale
        self.consumed = 0  # groups handed to the trainer in batches
        self.filtered = 0  # zero-variance groups dropped at finish
        self.rejected_groups = 0  # groups left with < 2 fresh samples at finish
        self.rejected_samples = 0  # samples dropped as stale (at finish or later)
        self.purged_groups = 0  # queued groups dropped after the version advanced
        self.failed = 0  # episodes that finished without a group
        # reward over every finished sample, filtered groups included: the batch's reward mean is
        # biased toward 0.5 by the zero-variance filter, so it is not the policy's accuracy
        self._reward_sum = 0.0
        self._reward_n = 0
        self.clock = clock
        self.since_spread = SinceSpread()

    # ---- version -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The policy version the engines currently serve."""
        return self._version

    def set_version(self, version: int) -> None:
        """Record newly published weights and drop queued samples that became too stale."""
        if version < self._version:
            raise ValueError(f"version must not decrease: {self._version} -> {version}")
        self._version = version
        self._purge_queue()

    # ---- admission -----------------------------------------------------------------------

    def capacity(self) -> int:
        """How many more groups may start now: the formula in the class docstring."""
        inflight_room = self.max_inflight - self.running
        budget = (self.max_staleness + self._version + 1) * self.groups_per_step + self.overprovision
        if self.expect_filtering:
            staleness_room = math.ceil(max(0, budget - self.accepted) / self.acceptance()) - self.running
        else:
            staleness_room = budget - (self.accepted + self.running)
        return max(0, min(inflight_room, staleness_room))

    def acceptance(self) -> float:
        """p̂: the share of recently finished groups the filter let through (1.0 before any finished)."""
        if not self._let_through:
            return 1.0
        return max(ACCEPTANCE_FLOOR, sum(self._let_through) / len(self._let_through))

    def start(self) -> bool:
        """Reserve a slot for one new group; False means wait (no capacity)."""
        if self.capacity() <= 0:
            return False
        self.running += 1
        if self.since_spread.at is None:  # the first group: the time without a spread counts from here
            self.since_spread.at = self.clock()
        return True

    def release(self) -> None:
        """Give back a started group's slot without a fate: the group is re-queued and starts again."""
        if self.running <= 0:
            raise RuntimeError("release() called with no running group")
        self.running -= 1

    def finish(self, group: Group | None) -> str:
        """Release a started group's slot and decide its fate.

        Returns "failed" (None: the episode produced no group), "filtered" (all rewards equal),
        "rejected" (fewer than 2 samples with staleness ≤ η, or equal rewards among them) or
        "accepted" (queued, with its stale samples removed).
        """
        if self.running <= 0:
            raise RuntimeError("finish() called with no running group (more finishes than starts)")
        self.running -= 1
        self._let_through.append(group is not None and not self._no_reward_variance(group.samples))
        if group is None:
            self.failed += 1
            return FAILED
        self._reward_sum += sum(group.rewards)
        self._reward_n += len(group.samples)
        if self._no_reward_variance(group.samples):
            self.filtered += 1
            self._discard(FILTERED, group.samples, "zero reward variance")
            self.since_spread.add(group, FILTERED)
            return FILTERED
        fresh = self._fresh_or_none(group)
        if fresh is None:
            self.rejected_groups += 1
            self.since_spread.add(group, REJECTED)
            return REJECTED
        self._queue.append(fresh)
        self.accepted += 1
        if _spread(fresh.samples):
            self.since_spread = SinceSpread(at=self.clock())
        else:  # the filter is off: trained, with advantage 0
            self.since_spread.add(group, ACCEPTED)
        return ACCEPTED

    # ---- consumption ---------------------------------------------------------------------

    def ready(self) -> bool:
        """At least B groups are queued."""
        return len(self._queue) >= self.groups_per_step

    def take_batch(self) -> Batch | None:
        """Pop the B oldest queued groups as a batch at the current version, or None.

        Staleness is re-checked first, so every returned sample has staleness ≤ η; if purging
        leaves fewer than B groups, they stay queued and the result is None.
        """
        self._purge_queue()
        if not self.ready():
            return None
        groups = [self._queue.popleft() for _ in range(self.groups_per_step)]
        self.consumed += len(groups)
        return Batch(version=self._version, groups=groups)

    @property
    def queued(self) -> int:
        return len(self._queue)

    # ---- staleness and filtering ---------------------------------------------------------

    def staleness(self, sample: Sample) -> int | None:
        """v − oldest sampled version; None when the sample has no sampled token."""
        oldest = sample.oldest_version
        if oldest == NOT_SAMPLED:
            return None
        return self._version - oldest

    def _is_fresh(self, sample: Sample) -> bool:
        staleness = self.staleness(sample)
        return staleness is not None and staleness <= self.max_staleness

    def _no_reward_variance(self, samples: list[Sample]) -> bool:
        return self.filter_zero_variance and not _spread(samples)

    def _fresh_or_none(self, group: Group) -> Group | None:
        """The group without its stale samples, or None if what remains cannot be trained on.

        Counts the dropped samples. A copy is returned so the caller's group is left intact.
        """
        fresh = [s for s in group.samples if self._is_fresh(s)]
        self.rejected_samples += len(group.samples) - len(fresh)
        self._discard(REJECTED, [s for s in group.samples if not self._is_fresh(s)],
                      f"stale: more than max_staleness={self.max_staleness} versions old at version {self._version}")
        if len(fresh) < MIN_GROUP_SIZE or self._no_reward_variance(fresh):
            self._discard(REJECTED, fresh, "its group had fewer than 2 fresh samples, or no reward variance among them")
            return None
        if len(fresh) == len(group.samples):
            return group
        return dataclasses.replace(group, samples=fresh)

    def _purge_queue(self) -> None:
        """Re-apply the staleness rule to every queued group at the current version."""
        kept: deque[Group] = deque()
        for group in self._queue:
            fresh = self._fresh_or_none(group)
            if fresh is None:
                self.purged_groups += 1
                self.accepted -= 1  # its slot returns to the admission budget
            else:
                kept.append(fresh)
        self._queue = kept

    # ---- discards -------------------------------------------------------------------------

    def _discard(self, status: str, samples: list[Sample], reason: str) -> None:
        if self.keep_discarded:
            self._discarded.extend((status, s, reason) for s in samples)

    def take_discarded(self) -> list[tuple[str, Sample, str]]:
        """The samples discarded since the last call: (status, sample, reason), oldest first."""
        taken, self._discarded = self._discarded, []
        return taken

    def drain_unused(self) -> None:
        """At the run's end: empty the queue, its samples discarded as `unused`."""
        while self._queue:
            group = self._queue.popleft()
            self.accepted -= 1
            self._discard(UNUSED, group.samples, "queued when the run ended")

    # ---- observability and checkpoints ---------------------------------------------------

    def metrics(self) -> dict[str, float]:
        return {
            "buffer/queued": float(len(self._queue)),
            "buffer/running": float(self.running),
            "buffer/accepted": float(self.accepted),
            "buffer/consumed": float(self.consumed),
            "buffer/filtered": float(self.filtered),
            "buffer/rejected_samples": float(self.rejected_samples),
            "buffer/rejected_groups": float(self.rejected_groups),
            "buffer/purged_groups": float(self.purged_groups),
            "buffer/failed": float(self.failed),
            "rollout/reward_all_finished": self._reward_sum / max(1, self._reward_n),
            "buffer/finished_samples": float(self._reward_n),  # every sample generated (filtered ones too)
            "buffer/capacity": float(self.capacity()),
            "buffer/acceptance": self.acceptance(),
            "staleness/version": float(self._version),
            **self.since_spread.metrics(self.clock()),
        }

    _COUNTERS = (
        "consumed", "filtered", "rejected_groups", "rejected_samples", "purged_groups", "failed",
    )

    def state_dict(self) -> dict[str, Any]:
        """Version, counters and the queued groups (whole, as JSON-able dicts): a resumed run trains
        on exactly what this one would have. Running groups are the caller's to re-start."""
        state: dict[str, Any] = {"version": self._version, "reward_sum": self._reward_sum, "reward_n": self._reward_n,
                                 "queue": [g.to_dict() for g in self._queue], "let_through": list(self._let_through)}
        state.update({name: getattr(self, name) for name in self._COUNTERS})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`; nothing is running, so accepted := consumed + the restored queue. (A
        checkpoint from before queues were saved has none: its queued groups are regenerated.)"""
        self._version = int(state["version"])
        for name in self._COUNTERS:
            setattr(self, name, int(state.get(name, 0)))
        self._reward_sum = float(state.get("reward_sum", 0.0))
        self._reward_n = int(state.get("reward_n", 0))
        self._queue = deque(Group.from_dict(g) for g in state.get("queue", []))
        self._let_through = deque((bool(x) for x in state.get("let_through", [])), maxlen=ACCEPTANCE_WINDOW)
        self.running = 0
        self.accepted = self.consumed + len(self._queue)


def _spread(samples) -> bool:
    """Rewards not all equal: the only groups whose advantages are not all 0."""
    return len({s.reward for s in samples}) > 1


@dataclasses.dataclass
class SinceSpread:
    """The groups finished since the last one queued with a reward spread (see `StalenessBuffer`)."""

    at: float | None = None  # when that group finished (or the first group started); None before any started
    groups: int = 0
    samples: int = 0
    reward_sum: float = 0.0
    filtered: int = 0  # dropped by the zero-variance filter
    rejected: int = 0  # rejected as stale

    def add(self, group: Group, fate: str) -> None:
        self.groups += 1
        self.samples += len(group.samples)
        self.reward_sum += sum(group.rewards)
        self.filtered += fate == FILTERED
        self.rejected += fate == REJECTED

    def metrics(self, now: float) -> dict[str, float]:
        return {
            "buffer/groups_since_spread": float(self.groups),
            "buffer/samples_since_spread": float(self.samples),
            "buffer/reward_since_spread": self.reward_sum / max(1, self.samples),
            "buffer/filtered_since_spread": float(self.filtered),
            "buffer/rejected_since_spread": float(self.rejected),
            "buffer/seconds_since_spread": 0.0 if self.at is None else max(0.0, now - self.at),
        }
