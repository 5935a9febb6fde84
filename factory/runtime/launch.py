"""Building, starting and restarting the run's actors (engines, trainer, scorer, buffer, env workers),
and ending them with the run; the loop that drives them is factory/run.py."""

from __future__ import annotations

import contextlib
import logging

import ray

log = logging.getLogger(__name__)


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
                log.warning("before killing the run's actors: %s", err)
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
