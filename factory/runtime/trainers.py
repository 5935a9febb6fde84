"""The trainer's ranks, started and driven as one trainer.

With `train.ranks` = 1 the trainer is one `TrainerActor`. With N > 1 it is N of them, each placed
by `placement.trainer` (one per node with `{trainer: 1}` on each node, or several on one), forming
an FSDP2 group; `TrainerGroup` makes them look like one actor handle to the loop, so `run.py` and
the weight publisher drive either the same way.

A finished run's one-rank trainer process is kept for the next run of the same driver (`WarmTrainers`):
that run rebuilds its trainer in it instead of starting a process and importing torch and transformers.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import ray

from factory.runtime.actor_base import placed
from factory.runtime.trainer_actor import TrainerActor
from factory.runtime.transfer import DirBundle

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
def _combine(how: str, *results):
    """One result for the ranks' results of one call (Ray hands this task their values)."""
    if how == "metrics":  # each rank's step metrics: one step's
        from factory.training.parallel import step_metrics_merge

        return step_metrics_merge(list(results))
    if how == "bundles":  # each rank's part of a checkpoint (its shard files): one directory
        files: dict[str, bytes] = {}
        for part in results:
            files.update(part.files)
        return DirBundle(results[0].name, files)
    return results[0]  # rank 0's (the weight broadcast's host, the exported weights, ...)


COMBINE = {"train_step": "metrics", "checkpoint": "bundles"}


class _GroupMethod:
    def __init__(self, ranks: list, name: str, num_returns: int = 1):
        self.ranks, self.name, self.num_returns = ranks, name, num_returns

    def options(self, num_returns: int = 1) -> _GroupMethod:
        """As an actor method's `.options(num_returns=N)`: the combined result (a tuple) as N refs."""
        return _GroupMethod(self.ranks, self.name, num_returns)

    def remote(self, *args):
        # every rank must take part (gathers of sharded weights are collectives); arguments travel once
        refs = [a if isinstance(a, ray.ObjectRef) else ray.put(a) for a in args]
        results = [getattr(r, self.name).remote(*refs) for r in self.ranks]
        combine = _combine.options(num_returns=self.num_returns) if self.num_returns != 1 else _combine
        return combine.remote(COMBINE.get(self.name, "first"), *results)


class TrainerGroup:
    """N trainer ranks as one trainer handle: `group.method.remote(...)` calls the method on every
    rank and returns one ObjectRef — rank 0's result, the ranks' step metrics merged, or their
    checkpoint parts as one bundle. A failure on any rank fails it."""

    def __init__(self, ranks: list):
        self.ranks = ranks

    def __getattr__(self, name: str) -> _GroupMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return _GroupMethod(self.ranks, name)


def start_trainer(policy, recipe, shape: dict | None, resources: dict[str, float] | None,
                  warm: bool = False) -> tuple[Any, list]:
    """The recipe's trainer: (the handle the loop drives, the actors started). Ranks > 1 form their
    process group on rank 0's node address before building their shards. `warm`: one rank is built in
    a process a finished run kept (`WARM_TRAINERS`) where there is one for this placement."""
    n = recipe.train.ranks
    args = (policy, recipe.algorithm, recipe.train, recipe.rollout, shape)
    if n == 1:
        actor = WARM_TRAINERS.take(resources) if warm else None
        if actor is not None:
            actor.rebuild.remote(*args)  # not waited for, as a new actor's construction is not
            log.info("trainer: rebuilt in the process a finished run kept (no start, no imports)")
        else:
            actor = placed(TrainerActor, resources).remote(*args)
        actor.warm_up.remote()  # not waited for: it runs while the engines start
        return actor, [actor]
    ranks = [placed(TrainerActor, resources).remote(*args, rank=r, world_size=n) for r in range(n)]
    host, port = ray.get(ranks[0].rendezvous.remote())
    ray.get([r.join.remote(host, port) for r in ranks])
    for r in ranks:  # every rank: the passes are collectives
        r.warm_up.remote()
    return TrainerGroup(ranks), ranks


class WarmTrainers:
    """A one-rank trainer process kept between the runs of one driver process on one Ray cluster: a run that
    finishes hands its trainer back (`keep`), released of everything it held, and the next run rebuilds its
    trainer in that process (`TrainerActor.rebuild`) instead of starting a new one. Starting one costs
    ~4.6 s here (a Ray worker ~0.9 s, then torch and transformers' model classes imported) against ~1 s to
    rebuild; a driver that runs many runs (a benchmark, a notebook, the test suite's ~50 runs on its shared
    engine) pays the imports once. A rebuilt trainer holds nothing of the last run: its model, optimizer,
    weight group, threads and seed are made anew, so a seeded run trains bitwise alike either way.

    One process is kept at most, and only a CPU trainer placed by no resource: an idle process holding one
    (`placement.trainer: {trainer_rank: 1}`, a GPU) would keep it from the next run that asks for it. A run
    that fails kills its trainer as before, so a kept process only ever held finished runs. It ends with the
    driver's Ray (a driver's actors die with it). Off with FACTORY_WARM_TRAINERS=0."""

    def __init__(self) -> None:
        self._kept: tuple[str, Any] | None = None  # (the Ray job it belongs to, the actor)

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("FACTORY_WARM_TRAINERS", "1") != "0"

    def take(self, resources: dict[str, float] | None):
        """The kept trainer, for a trainer placed by no resource, if it belongs to this Ray job and answers."""
        if resources or self._kept is None:
            return None
        (job, actor), self._kept = self._kept, None
        if not self.enabled() or job != ray.get_runtime_context().get_job_id():
            return None  # another job's handle: that Ray is gone, and its actor with it
        try:
            ray.get(actor.pid.remote(), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            log.info("the kept trainer process no longer answers; starting a new one")
            return None
        return actor

    def keep(self, actor, resources: dict[str, float] | None) -> bool:
        """Keep a finished run's trainer (`TrainerActor.release` first); whether it was kept (else the
        caller ends it)."""
        if not self.enabled() or resources or self._kept is not None:
            return False
        try:
            if not ray.get(actor.release.remote(), timeout=60):
                return False
        except (ray.exceptions.RayError, TimeoutError):
            return False
        self._kept = (ray.get_runtime_context().get_job_id(), actor)
        return True

    def kept(self):
        """The kept trainer actor, or None."""
        return self._kept[1] if self._kept is not None else None

    def drop(self) -> None:
        """End the kept trainer process now, if any (the next run starts a new one)."""
        if self._kept is not None:
            (_, actor), self._kept = self._kept, None
            with contextlib.suppress(Exception):  # its Ray may be gone, and the actor with it
                ray.kill(actor)


WARM_TRAINERS = WarmTrainers()
