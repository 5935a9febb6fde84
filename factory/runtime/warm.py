"""Actor processes kept between the runs of one driver process on one Ray cluster (`TRAINERS`, `ENV_WORKERS`).

A run's trainer and env worker each start as a new Ray worker process (~0.9 s here) that then imports what
the role needs: torch and transformers' model classes for the trainer (~3.7 s on 2 cores, against ~1 s to
build the tiny model's trainer itself), tokenizers and the verifiers for an env worker (~2 s). A driver that
runs many runs one after another on one Ray (a benchmark, a notebook calling `factory.run.run`, the test
suite's runs on its shared engine) pays that once: a run that finishes hands each such process back
(`keep`), released of everything it held for the run (`release` on the actor), and the next run builds its
role in it (`rebuild`, with the arguments a new actor's constructor would take) instead of starting one.

What is kept, and what is not:
- One process per role at most, and only one placed by no resource (`placement.<role>` empty): an idle
  process holding a resource (`{trainer_rank: 1}`, `{rollout: 1}`, a GPU) would keep it from the next
  run that asks for it.
- An actor says in `release` whether it may be kept: a one-rank CPU trainer may; a CUDA trainer may not
  (its context and allocator would stay with it, and that path has not run here).
- A run that fails kills its actors as before, so a kept process only ever served finished runs; a run
  that starts its own Ray (`factory run`, a Dagster run) keeps nothing, since its actors end with it.
- A rebuilt actor holds nothing of the last run: model, optimizer, weight group, threads and seed, or
  gateway, episodes, leases and sandbox, are made anew; a seeded run trains bitwise alike either way
  (tests/integration/test_reproducibility.py).

Kept processes end with the driver's Ray (a driver's actors die with it); `drop()` ends them sooner, and
`FACTORY_WARM_PROCESSES=0` turns keeping off.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import ray

log = logging.getLogger(__name__)

ENV_SWITCH = "FACTORY_WARM_PROCESSES"


class WarmProcesses:
    """The kept process of one role (at most one): `take` it for a new run, `keep` a finished run's."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._kept: tuple[str, Any] | None = None  # (the Ray job it belongs to, the actor)

    @staticmethod
    def enabled() -> bool:
        return os.environ.get(ENV_SWITCH, "1") != "0"

    def take(self, resources: dict[str, float] | None):
        """The kept actor, for a role placed by no resource, if it belongs to this Ray job and answers; else
        None (start a new one). The caller sends it `rebuild(...)` before anything else."""
        if resources or self._kept is None:
            return None
        if not self.enabled() or self._kept[0] != ray.get_runtime_context().get_job_id():
            self.drop()  # kept for another job (that Ray is gone, and its actor with it), or keeping is off
            return None
        actor, self._kept = self._kept[1], None
        try:
            ray.get(actor.pid.remote(), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            log.info("the kept %s process no longer answers; starting a new one", self.role)
            return None
        return actor

    def keep(self, actor, resources: dict[str, float] | None) -> bool:
        """Keep a finished run's actor for the next run, once its `release()` said it may be kept; whether it
        was kept (else the caller ends it)."""
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
        """The kept actor, or None."""
        return self._kept[1] if self._kept is not None else None

    def drop(self) -> None:
        """End the kept process now, if any (the next run starts a new one)."""
        if self._kept is not None:
            (_, actor), self._kept = self._kept, None
            with contextlib.suppress(Exception):  # its Ray may be gone, and the actor with it
                ray.kill(actor)


TRAINERS = WarmProcesses("trainer")
ENV_WORKERS = WarmProcesses("env worker")


def drop_all() -> None:
    """End every kept process now."""
    for kept in (TRAINERS, ENV_WORKERS):
        kept.drop()
