"""Keeping a run going while its actors die: rollout engines, env workers and the scorer.

A thread probes every engine (`rollout.health`: the server's health route, within a timeout) and
every env worker (its actor answering). What it finds dead or hung it only notes; the training loop
recovers at its next wait (`check`, polled about once a second while it waits for a batch or a
weight sync), so nothing changes under a step in progress:

- an engine the run started is killed (a stopped process too: its actor's death takes its server's
  process group with it) and started again where `placement.engine` allows, the weight group is
  formed anew and every engine is given the trainer's current weights at its version; the env
  workers then send the calls they held for it to the new one. Groups that were running on it come
  back to the buffer's queue under their ids (the env worker re-queues a group an engine loss cut
  short), so each group still has one fate in the lake;
- an engine the run attached to (`rollout.urls`, or engines handed to `run`) is waited for, never
  restarted, then reconnected and given the weights;
- a dead env worker is started again and its running groups are re-queued;
- a dead scorer is started again and its batch scored anew (`restart_scorer`, by the loop);
- a weight update that fails while every engine answers (its weight group broke) is retried: the
  group is formed anew and every engine given the current weights (`resync`, by the loop).

Each kind of restart is bounded (`rollout.max_engine_restarts`, `failures.max_worker_restarts`);
one more loss stops the run with one line naming the actor, why, and the setting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from factory.support.failures import RunFailure
from factory.recording.outage import first_line
from factory.runtime.transient import backoff, transient
from factory.runtime.weights import connect_broadcast, publish_weights

log = logging.getLogger("factory.supervisor")
_ROLE = {"engine": "rollout engine", "worker": "env worker"}


class ActorLost(RunFailure):
    """An actor of the run died more often than its restart limit allows."""


class EngineLostDuringSync(Exception):
    """Raised into a weight sync's wait: an engine it waits on was found lost (the loop recovers)."""


class Supervisor:
    """Watches the run's actors `a` (launch.Actors; its lists are updated in place on a restart).

    `start_engine(i, attempt)`, `start_worker(owner token)`, `start_scorer()`: start a replacement and return
    its handle once it serves. `sync`: the run's WeightPublisher (its pending update is abandoned when
    an engine is lost). `restartable`: whether the engines are the run's own (else waited for)."""

    def __init__(self, a, recipe, *, start_engine: Callable[[int, int], Any], start_worker: Callable[[str], Any],
                 start_scorer: Callable[[], Any] | None, restartable: bool, sync=None):
        self.a, self.recipe = a, recipe
        self.health = recipe.rollout.health
        self.start_engine, self.start_worker, self.start_scorer = start_engine, start_worker, start_scorer
        self.restartable = restartable
        self.sync = sync
        self.producing: list = []
        self.restarts = {"engine": 0, "worker": 0, "scorer": 0, "sync": 0}
        self.recover_s: list[float] = []
        self._lost_engines: dict[int, str] = {}
        self._lost_workers: dict[int, str] = {}
        self._replacing: set[int] = set()  # env workers being replaced (not probed meanwhile)
        self._owners = [f"w{i}" for i in range(len(a.workers))]  # each worker incarnation's token for the buffer
        self._lock = threading.Lock()
        n = len(a.engines)
        self._misses = [0] * n
        self._generation = [0] * n  # bumped on each replacement: a probe of the old one is ignored
        self._not_before = [time.monotonic() + self.health.first_wait_s] * n
        self._unreachable: dict[tuple[str, int], float] = {}  # (role, i) -> since when its actor has not answered
        self.homes: dict[tuple[str, int], str] = {}  # (role, i) -> its node's address, as started
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the watching thread ---------------------------------------------------------------------

    def start(self, producing: list) -> None:
        """Start probing; `producing`: the env workers' `produce` refs (replaced with a worker)."""
        self.producing = producing
        self._note_homes()
        self._thread = threading.Thread(target=self._watch, name="factory-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.health.timeout_s * (len(self.a.engines) + 2) + 10)

    def _watch(self) -> None:
        while not self._stop.wait(self.health.interval_s):
            try:
                self._probe_engines()
                self._probe_workers()
            except Exception as err:  # noqa: BLE001  (a probe's own fault must not end the watching)
                log.warning("supervisor probe failed: %s", err)

    def _probe_engines(self) -> None:
        now = time.monotonic()
        timeout = self.health.timeout_s
        for i, engine in enumerate(list(self.a.engines)):
            with self._lock:
                if i in self._lost_engines or now < self._not_before[i]:
                    continue
                generation = self._generation[i]
            try:
                result = ray.get(engine.health.remote(timeout), timeout=timeout + 5)
                self._reached("engine", i)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as err:
                # its actor itself not answering (the server's own hang is answered by the actor): a
                # partition, or a node's network restart, until deadlines.partition_s says lost
                result = self._unanswered("engine", i, err)
                if result is None:
                    continue
            with self._lock:
                if generation != self._generation[i] or self._stop.is_set():
                    continue
                if result is None:
                    self._misses[i] = 0
                    continue
                dead, why = result
                self._misses[i] += 1
                if dead or self._misses[i] >= self.health.misses:
                    self._lost_engines[i] = why if dead else f"hung: {why} ({self._misses[i]} probes in a row)"
                    log.warning("rollout engine %d lost: %s", i, self._lost_engines[i])

    def _probe_workers(self) -> None:
        for i, worker in enumerate(list(self.a.workers)):
            try:
                ray.get(worker.pid.remote(), timeout=self.health.timeout_s + 5)
                self._reached("worker", i)
            except ray.exceptions.GetTimeoutError:
                pass  # busy: its episodes' own deadlines cover a worker that hangs
            except ray.exceptions.RayActorError as err:
                found = self._unanswered("worker", i, err)
                if found is None:
                    continue
                with self._lock:
                    if (worker is self.a.workers[i] and i not in self._replacing and i not in self._lost_workers
                            and not self._stop.is_set()):
                        self._lost_workers[i] = found[1]
                        log.warning("env worker %d lost: %s", i, self._lost_workers[i])

    def _reached(self, role: str, i: int) -> None:
        since = self._unreachable.pop((role, i), None)
        if since is not None:
            log.warning("%s %d answers again after %.0f s unreachable", _ROLE[role], i, time.monotonic() - since)

    def _unanswered(self, role: str, i: int, err: BaseException) -> tuple[bool, str] | None:
        """A probe of actor `i` of `role` failed: None while that may pass (unreachable for less than
        deadlines.partition_s), else (dead, why)."""
        if not isinstance(err, ray.exceptions.GetTimeoutError) and not transient(err):
            self._unreachable.pop((role, i), None)
            return True, f"its actor died ({type(err).__name__})"
        now, limit = time.monotonic(), self.recipe.deadlines.partition_s
        since = self._unreachable.setdefault((role, i), now)
        if since == now:
            log.warning("%s %d does not answer (%s); waiting up to deadlines.partition_s=%g s for it", _ROLE[role],
                        i, type(err).__name__, limit)
        if now - since < limit:
            return None
        del self._unreachable[(role, i)]
        return True, f"its actor did not answer for {now - since:.0f} s (deadlines.partition_s={limit:g})"

    def _note_homes(self) -> None:
        """The node of each engine and env worker (named when a node is lost for good)."""
        for i, engine in enumerate(self.a.engines):
            self._note_home("engine", i, engine)
        for i, worker in enumerate(self.a.workers):
            self._note_home("worker", i, worker)

    def _note_home(self, role: str, i: int, actor) -> None:
        try:
            self.homes[(role, i)] = ray.get(actor.node_ip.remote(), timeout=60)
        except Exception:  # noqa: BLE001  (only names nodes in a message)
            self.homes.pop((role, i), None)

    def _room_for(self, role: str, i: int) -> None:
        """Wait up to deadlines.partition_s for a live node that offers what `placement.<role>` asks (the node
        that held actor `i` may be gone for good); then raise `ActorLost` naming that node, the roles it held
        and the resources no live node offers."""
        setting = {"engine": "engine", "worker": "env_worker"}[role]
        wanted = dict(getattr(self.recipe.placement, setting))
        if not wanted:
            return
        limit = self.recipe.deadlines.partition_s
        deadline = time.monotonic() + limit
        asks = "{" + ", ".join(f"'{name}': {amount:g}" for name, amount in sorted(wanted.items())) + "}"
        said = False
        while not any(_offers(node, wanted) for node in ray.nodes() if node.get("Alive")):
            if time.monotonic() > deadline:
                node = self.homes.get((role, i), "?")
                held = ", ".join(f"{_ROLE[r]} {j}" for (r, j), ip in sorted(self.homes.items()) if ip == node)
                raise ActorLost(f"node {node} lost for good (it held {held or f'{_ROLE[role]} {i}'}): no live node offers "
                                f"{asks} (placement.{setting}) within deadlines.partition_s={limit:g} s; start a node "
                                f"that does (`ray start --resources ...`) and resume the run from its last checkpoint")
            if not said:
                log.warning("%s %d: waiting up to deadlines.partition_s=%g s for a live node that offers %s "
                            "(placement.%s)", _ROLE[role], i, limit, asks, setting)
                said = True
            time.sleep(2)

    # ---- recovery, on the loop's thread ----------------------------------------------------------

    def check(self) -> bool:
        """Recover what the probes found lost, and a weight update under way that failed; True if
        anything was (the loop's waits start afresh)."""
        failed = self.sync.failure() if self.sync is not None else None
        if failed is not None and not self.sync_failed("the weight update under way", failed):
            return True
        with self._lock:
            engines, self._lost_engines = self._lost_engines, {}
            workers, self._lost_workers = self._lost_workers, {}
            for i in engines:  # not probed while being replaced (a probe of the old one would find it dead)
                self._generation[i] += 1
                self._not_before[i] = float("inf")
            self._replacing = set(workers)
        if not engines and not workers:
            return False
        t0 = time.perf_counter()
        for i, why in sorted(workers.items()):  # first: an engine's replacement is then handed to live workers
            self._recover_worker(i, why)
        with self._lock:
            self._replacing = set()
        if engines:
            self._recover_engines(engines)
        self.recover_s.append(time.perf_counter() - t0)
        return True

    def interrupt_sync(self) -> bool:
        """The weight sync's poll: raises once an engine is found lost (its update may never end)."""
        with self._lock:
            if self._lost_engines:
                raise EngineLostDuringSync(", ".join(f"engine {i}: {why}" for i, why in self._lost_engines.items()))
        return False

    def probe_now(self) -> bool:
        """One probe of every engine and worker at once (after a weight sync failed: was it a loss?)."""
        with self._lock:
            self._not_before = [0.0] * len(self._not_before)
            self._misses = [max(m, self.health.misses - 1) for m in self._misses]  # one miss decides now
        self._probe_engines()
        self._probe_workers()
        with self._lock:
            return bool(self._lost_engines or self._lost_workers)

    def _count(self, kind: str, limit: int, setting: str, who: str, why: str) -> int:
        self.restarts[kind] += 1
        n = self.restarts[kind]
        if n > limit:
            raise ActorLost(f"{who} lost ({why}) after {limit} restarts in this run; the run stops at "
                            f"{setting}={limit} (raise it, or see the actor's log in the run dir)")
        return n

    def _recover_engines(self, lost: dict[int, str]) -> None:
        rollout = self.recipe.rollout
        if self.sync is not None:
            self.sync.abandon()  # its update may wait on the lost engine forever
        for i, why in sorted(lost.items()):
            n = self._count("engine", rollout.max_engine_restarts, "rollout.max_engine_restarts",
                            f"rollout engine {i}", why)
            if self.restartable:
                log.warning("rollout engine %d: %s; restarting it (restart %d of at most %d)", i, why, n,
                            rollout.max_engine_restarts)
                self._room_for("engine", i)
                try:
                    ray.kill(self.a.engines[i])  # its server's process group ends with it (the reaper)
                except Exception:  # noqa: BLE001  (already gone)
                    pass
                self.a.engines[i] = self.start_engine(i, n)
                self._note_home("engine", i, self.a.engines[i])
            else:
                log.warning("rollout engine %d (not started by this run): %s; waiting for it to answer", i, why)
                self._wait_for(i)
        self._reconnect()
        for ref in [w.replace_engine.remote(i, self.a.engines[i]) for w in self.a.workers for i in lost]:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:  # a worker died meanwhile: its replacement gets the engines
                pass
        with self._lock:
            for i in lost:
                self._generation[i] += 1
                self._misses[i] = 0
                self._not_before[i] = time.monotonic() + self.health.first_wait_s

    def sync_failed(self, what: str, err: BaseException) -> bool:
        """A weight update failed (`what`): True if a probe finds an engine (or worker) lost, which `check`
        then recovers (that gives every engine the weights); else the group is formed anew (`resync`)."""
        if self.probe_now():
            log.warning("%s failed (%s): an engine was lost", what, type(err).__name__)
            return True
        # an engine unreachable for a while (a partition) is not the group's fault: no retry is counted
        self.resync(f"{what}: {first_line(getattr(err, 'cause', None) or err)}", count=not transient(err))
        return False

    def resync(self, why: str, count: bool = True) -> None:
        """A weight update failed while every engine still answers (its weight group broke: a connection
        reset, a receive cut short): form the group anew and give every engine the trainer's current
        weights at its version, as after a restart. Each try counts against `rollout.max_engine_restarts`;
        a try that fails too is tried again, unless a probe then finds an engine (or worker) lost, which
        `check` recovers (giving every engine the weights), or an actor died (the trainer: the loop's)."""
        t0 = time.perf_counter()
        waits = backoff()
        while True:
            if count:
                n = self._count("sync", self.recipe.rollout.max_engine_restarts, "rollout.max_engine_restarts",
                                "the weight group", why)
                log.warning("weight sync failed while the engines answer (%s); forming the weight group anew and "
                            "sending the current weights (retry %d)", why, n)
            else:
                log.warning("weight sync failed: an engine is unreachable (%s); forming the weight group anew and "
                            "sending the current weights once it answers (within deadlines.partition_s)", why)
            if self.sync is not None:
                self.sync.abandon()
            if not count and not self._answering(t0, waits):  # lost meanwhile: the loop's next `check` recovers it
                break
            try:
                self._reconnect()
                break
            except Exception as err:
                if self.probe_now():  # noted lost: the loop's next `check` recovers it
                    log.warning("forming the weight group anew failed (%s): an engine was lost", type(err).__name__)
                    break
                # an engine (or the trainer) unreachable, not lost: a partition, waited out (`_answering`)
                count = not (transient(err) or self._unreachable)
                if not count and time.perf_counter() - t0 < self.recipe.deadlines.partition_s:
                    continue
                if isinstance(err, ray.exceptions.RayActorError):  # an actor no probe watches died: the trainer
                    raise
                count = True
                why = f"forming it anew: {first_line(getattr(err, 'cause', None) or err)}"
        self.recover_s.append(time.perf_counter() - t0)

    def _answering(self, t0: float, waits) -> bool:
        """Wait, probing, until every engine and env worker answers again (True), or one is found lost
        (False; `check` recovers it), for up to deadlines.partition_s from `t0` (perf_counter). A weight
        group formed while an engine cannot be reached would wait out its rendezvous (120 s) instead."""
        while time.perf_counter() - t0 < self.recipe.deadlines.partition_s:
            if self.probe_now():
                return False
            if not self._unreachable:
                return True
            time.sleep(next(waits))
        return not self.probe_now()

    def _wait_for(self, i: int) -> None:
        deadline = time.monotonic() + self.recipe.deadlines.batch_s
        while time.monotonic() < deadline:
            try:
                if ray.get(self.a.engines[i].health.remote(self.health.timeout_s), timeout=self.health.timeout_s + 5) is None:
                    return
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                pass
            time.sleep(self.health.interval_s / 2)
        raise ActorLost(f"rollout engine {i} (attached, not started by this run) did not answer again within "
                        f"deadlines.batch_s={self.recipe.deadlines.batch_s:g} s; restart its server")

    def _reconnect(self) -> None:
        """A new weight group with every engine (a lost member breaks a collective), then the trainer's
        current weights into all of them, at its version."""
        rollout, a = self.recipe.rollout, self.a
        version = ray.get(a.trainer.version.remote())
        if rollout.weight_sync == "broadcast":
            connect_broadcast(a.engines, a.trainer, rollout.sync_backend)
        publish_weights(a.engines, a.trainer, version, rollout.weight_sync, self.recipe.deadlines.weight_sync_s)

    def _recover_worker(self, i: int, why: str) -> None:
        n = self._count("worker", self.recipe.failures.max_worker_restarts, "failures.max_worker_restarts",
                        f"env worker {i}", why)
        log.warning("env worker %d: %s; restarting it (restart %d)", i, why, n)
        self._room_for("worker", i)
        dead, self._owners[i] = self._owners[i], f"w{i}.{n}"
        self.a.workers[i] = self.start_worker(self._owners[i])
        self._note_home("worker", i, self.a.workers[i])
        requeued = ray.get(self.a.buffer.requeue.remote(None, dead))
        log.warning("env worker %d restarted; %d running groups re-queued", i, requeued)
        if self.producing:
            self.producing[i] = self.a.workers[i].produce.remote()

    def restart_scorer(self, why: str) -> None:
        """The scorer died under a call: start another (the loop then scores the batch again)."""
        if self.start_scorer is None:
            raise RuntimeError("restart_scorer without a scorer")
        n = self._count("scorer", self.recipe.failures.max_worker_restarts, "failures.max_worker_restarts",
                        "the scorer", why)
        log.warning("scorer: %s; restarting it (restart %d)", why, n)
        self.a.scorer = self.start_scorer()

    def metrics(self) -> dict[str, float]:
        return {"rollout/engine_restarts": float(self.restarts["engine"]),
                "weightsync/retries": float(self.restarts["sync"]),
                "env/worker_restarts": float(self.restarts["worker"] + self.restarts["scorer"]),
                "perf/recover_s": float(sum(self.recover_s))}


def _offers(node: dict, wanted: dict[str, float]) -> bool:
    """Whether Ray node `node` (an entry of `ray.nodes()`) was started with at least `wanted` in all."""
    have = node.get("Resources", {})
    return all(have.get(name, 0.0) + 1e-9 >= amount for name, amount in wanted.items())
