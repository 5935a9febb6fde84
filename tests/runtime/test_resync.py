"""`Supervisor.resync`'s retry loop, as pure logic: forming the weight group anew (`_reconnect`) and
probing (`probe_now`) are stand-ins here; the real path (a weight group broken under a run) is
tests/integration/test_weight_sync.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from factory.recipe import load_recipe
from factory.runtime.supervisor import ActorLost, Supervisor



REPO = Path(__file__).resolve().parents[2]


class Publisher:
    def __init__(self):
        self.abandoned = 0

    def abandon(self):
        self.abandoned += 1


def supervisor(failures: list[BaseException | None], lost: bool = False) -> tuple[Supervisor, Publisher]:
    """A supervisor whose reconnects raise `failures` in turn (None: succeeds), probes finding `lost`."""
    recipe = load_recipe(REPO / "recipes" / "default.yaml", ["rollout.max_engine_restarts=3"])
    sync = Publisher()
    sup = Supervisor(SimpleNamespace(engines=[], workers=[]), recipe, start_engine=None, start_worker=None,
                     start_scorer=None, restartable=True, sync=sync)
    tries = iter(failures)

    def reconnect():
        failure = next(tries)
        if failure is not None:
            raise failure

    sup._reconnect = reconnect
    sup.probe_now = lambda: lost
    return sup, sync


def test_a_reconnect_that_fails_is_tried_again_each_try_counted():
    sup, sync = supervisor([RuntimeError("receive cut short"), RuntimeError("connection reset"), None])
    sup.resync("the weight update of version 4: broken pipe")
    assert sup.restarts["sync"] == 3 and sync.abandoned == 3 and len(sup.recover_s) == 1


def test_reconnects_failing_past_the_limit_stop_the_run_naming_the_setting_and_the_last_cause():
    sup, _ = supervisor([RuntimeError("connection reset")] * 4)
    with pytest.raises(ActorLost, match=r"the weight group lost \(forming it anew: RuntimeError: connection reset\) after 3 "
                                        r"restarts.*rollout.max_engine_restarts=3"):
        sup.resync("broken pipe")
    assert sup.restarts["sync"] == 4


def test_a_reconnect_failing_because_an_engine_was_lost_leaves_it_to_the_engine_recovery():
    sup, _ = supervisor([RuntimeError("engine 0 gone")], lost=True)
    sup.resync("broken pipe")
    assert sup.restarts["sync"] == 1


def test_a_dead_trainer_under_a_reconnect_is_not_retried():
    sup, _ = supervisor([ray.exceptions.RayActorError()])
    with pytest.raises(ray.exceptions.RayActorError):
        sup.resync("broken pipe")
    assert sup.restarts["sync"] == 1
