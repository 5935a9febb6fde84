"""The trainer's ranks, started and driven as one trainer.

With `train.ranks` = 1 the trainer is one `TrainerActor`. With N > 1 it is N of them, each placed
by `placement.trainer` (one per node with `{trainer: 1}` on each node, or several on one), forming
an FSDP2 group; `TrainerGroup` makes them look like one actor handle to the loop, so `run.py` and
the weight publisher drive either the same way.

A finished run's one-rank trainer process is kept for the next run of the same driver
(`factory.runtime.warm.TRAINERS`): that run rebuilds its trainer in it instead of starting a process.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from factory.runtime.actor_base import placed
from factory.runtime.trainer_actor import TrainerActor
from factory.runtime.transfer import DirBundle
from factory.runtime.warm import TRAINERS

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
    a process a finished run kept (`factory.runtime.warm.TRAINERS`) where there is one."""
    n = recipe.train.ranks
    args = (policy, recipe.algorithm, recipe.train, recipe.rollout, shape)
    if n == 1:
        actor = TRAINERS.take(resources) if warm else None
        if actor is not None:
            actor.rebuild.remote(*args)  # not waited for, as a new actor's construction is not
            log.info("trainer: rebuilt in the process a finished run kept (factory/runtime/warm.py)")
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
