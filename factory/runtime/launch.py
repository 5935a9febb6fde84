"""Building, starting and restarting the run's actors (engines, trainer, scorer, buffer, env workers),
and ending them with the run; the loop that drives them is factory/run.py."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from factory.core.registries import ENGINES
from factory.model.routing import wants_replay
from factory.recipe import Recipe
from factory.recording.outage import first_line
from factory.recording.recorder import RunRecorder
from factory.rewards import verifier_specs
from factory.runtime.actor_base import placed
from factory.runtime.buffer_actor import BufferActor
from factory.runtime.cluster import check_placement
from factory.runtime.engine_actor import EngineActor
from factory.runtime.env_worker import EnvWorkerActor
from factory.runtime.supervisor import Supervisor
from factory.runtime.trainer_actor import ScorerActor
from factory.runtime.trainers import start_trainer
from factory.runtime.warm import ENV_WORKERS, TRAINERS
from factory.runtime.transfer import DirBundle, node_ip
from factory.runtime.weights import connect_broadcast, publish_weights
from factory.support.threads import shape_of

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


@dataclass
class Actors:
    """The run's actors. `own_engines`: started by this run (else given, and left running). Ray actor
    handles are typed Any: their methods (`handle.method.remote(...)`) are looked up at run time."""

    engines: list
    trainer: Any
    scorer: Any | None
    buffer: Any
    workers: list
    own_engines: bool
    policy: object  # the base policy's DirBundle in the object store (env workers read the tokenizer from it)
    verifiers: list = field(default_factory=list)  # the train tasks' verifier specs: env workers warm them up

    def trainer_ranks(self) -> list:
        return getattr(self.trainer, "ranks", [self.trainer])  # a TrainerGroup's, or the one trainer

    def nodes(self) -> dict:
        """Which node each role landed on."""
        ranks = self.trainer_ranks()
        return {"driver": node_ip(), "trainer": ray.get(self.trainer.node_ip.remote()),
                "trainer_ranks": ray.get([r.node_ip.remote() for r in ranks]),
                "buffer": ray.get(self.buffer.node_ip.remote()),
                "engines": ray.get([e.node_ip.remote() for e in self.engines]),
                "env_workers": ray.get([w.node_ip.remote() for w in self.workers])}

    def trainer_alive(self) -> bool:
        try:
            ray.get([r.pid.remote() for r in self.trainer_ranks()], timeout=60)
            return True
        except ray.exceptions.RayActorError:
            return False


class Launch:
    """Makes the run's actors, each placed by `recipe.placement` and added to `created` (killed if the
    run fails). `policy`: the base policy's DirBundle in the object store."""

    def __init__(self, recipe: Recipe, run_dir: Path, policy, created: _Created, routing: bool = False):
        self.recipe, self.run_dir, self.policy, self.created = recipe, run_dir, policy, created
        self.routing = routing  # the env workers ask the engines for each sampled token's experts
        self.startup_s = recipe.rollout.startup_timeout_s + 60

    def _made(self, actor):
        self.created.append(actor)
        return actor

    def engine(self, i: int, tag: str = ""):
        """Engine `i` (not yet started), placed by `placement.engine`; a restart or a retried start (`tag`)
        logs to a file of its own."""
        recipe = self.recipe
        lora_rank = recipe.train.lora.rank if recipe.train.lora.enabled else 0
        log_name = f"engine-{i}.{tag}.log" if tag else f"engine-{i}.log"
        return self._made(placed(EngineActor, recipe.placement.engine).remote(
            recipe.rollout.engine, self.policy, recipe.rollout, str(self.run_dir / log_name), lora_rank,
            engine_urls(recipe)[i], shape_of(recipe)))

    def restarted_engine(self, i: int, attempt: int):
        """Engine `i` made and started again (the supervisor's restart `attempt`)."""
        tag = f"restart-{attempt}"
        return start_engines([self.engine(i, tag)], lambda _, retry: self.engine(i, retry), self.startup_s, tag)[0]

    def env_worker(self, a: Actors, owner: str, start: bool = False):
        """An env worker under the token `owner` (rebuilt in the process a finished run kept, if there is one:
        factory/runtime/warm.py); `start`: its gateway serving (a restart's)."""
        recipe = self.recipe
        args = (a.policy, recipe.environment, recipe.rollout, a.engines, a.buffer, recipe.failures, recipe.deadlines,
                owner, a.verifiers, self.routing)
        new = ENV_WORKERS.take(recipe.placement.env_worker)
        if new is not None:
            new.rebuild.remote(*args)  # not waited for, as a new actor's construction is not
        else:
            new = placed(EnvWorkerActor, recipe.placement.env_worker).remote(*args)
        self._made(new)
        if start:
            ray.get(new.start.remote(), timeout=self.startup_s)
        return new

    def scorer(self):
        distill = self.recipe.algorithm.distill
        assert distill.teacher is not None  # only asked for with a teacher
        return self._made(placed(ScorerActor, self.recipe.placement.scorer).remote(
            distill, self.recipe.rollout, DirBundle.of(distill.teacher, "teacher")))

    def buffer(self, train_tasks, record: RunRecorder):
        recipe = self.recipe
        buffer = self._made(placed(BufferActor, recipe.placement.buffer).remote(
            recipe.name, train_tasks, recipe.async_, recipe.train, recipe.algorithm, recipe.failures,
            record.keeps_all_samples, recipe.deadlines.partition_s))
        if record.keeps_all_samples:  # a failing run still records what it generated (failed groups too)
            self.created.before_kill.append(lambda: record.log_discarded(
                record.step, *ray.get(buffer.take_discarded.remote(unused=True), timeout=30)))
        return buffer


def start_actors(recipe: Recipe, run_dir: Path, record: RunRecorder, policy: Path, train_tasks, engines,
                 created) -> Actors:
    """Place and start the engines, trainer, scorer and buffer, and make the env workers (killed if the
    run fails: `created`). `engines`: already-started ones given to the run, or None."""
    check_placement(recipe.placement, engines=recipe.rollout.num_engines if engines is None else 0,
                    env_workers=recipe.environment.workers, scorer=bool(recipe.algorithm.distill.teacher),
                    trainer_ranks=recipe.train.ranks)
    # every role gets the policy over the network: no node may assume another's disk
    routing = wants_replay(recipe, policy)
    if routing and not ENGINES[recipe.rollout.engine].routed_experts:  # a model.path MoE (a built one fails the recipe)
        raise ValueError(f"{policy} is a mixture-of-experts policy and rollout.engine={recipe.rollout.engine} cannot "
                         "report the experts it routed each token to; set algorithm.routing_replay: off or use vllm")
    make = Launch(recipe, run_dir, ray.put(DirBundle.of(policy, "policy", exclude=("trainer.pt",))), created, routing)
    own_engines = engines is None
    if own_engines:
        engines = [make.engine(i) for i in range(len(engine_urls(recipe)))]
    trainer, trainer_ranks = start_trainer(make.policy, recipe, shape_of(recipe), recipe.placement.trainer, warm=True)
    created.extend(trainer_ranks)
    # the scoring phase: a teacher grading every trained token (on-policy distillation), if any
    scorer = make.scorer() if recipe.algorithm.distill.teacher else None
    a = Actors(engines, trainer, scorer, make.buffer(train_tasks, record), [], own_engines, make.policy,
               verifier_specs(train_tasks))
    # the env workers' processes are made now, beside the trainer's and the engines' (their gateways
    # serve from `start_env_workers`, once the engines hold this run's weights)
    a.workers = [make.env_worker(a, f"w{i}") for i in range(recipe.environment.workers)]
    if own_engines:
        made = list(engines)
        start_engines(engines, make.engine, make.startup_s)
        # the env workers were made with the engines that failed to start: give them the new ones (else
        # their calls go to killed actors and the run makes no progress; seen in the chaos bench)
        replaced = [i for i, (old, new) in enumerate(zip(made, engines)) if old is not new]
        ray.get([w.replace_engine.remote(i, engines[i]) for w in a.workers for i in replaced])
    else:
        ray.get([e.start.remote() for e in engines])
        ray.get([e.set_partial_rollout.remote(recipe.rollout.partial_rollout) for e in engines])
    return a


ENGINE_START_TRIES = 2


def start_engines(engines: list, remake: Callable[[int, str], Any], timeout_s: float, tag: str = "",
                  tries: int = ENGINE_START_TRIES) -> list:
    """Start `engines` (EngineActors this run made) together. One whose start fails (its server exited, never
    became ready within `rollout.startup_timeout_s`, or its actor died) is killed and replaced by
    `remake(i, tag)`, which is started in its place, up to `tries` starts per engine: a server that hangs
    or crashes while starting (seen: one stopped mid-start by a fault) is a fault the run outlives, not
    its end. The last failure is raised. `engines` is updated in place and returned."""
    refs = {i: e.start.remote() for i, e in enumerate(engines)}
    failed = dict.fromkeys(refs, 0)
    while refs:
        i, ref = next(iter(refs.items()))
        try:
            ray.get(ref, timeout=timeout_s)
            del refs[i]
            continue
        except (ray.exceptions.RayError, TimeoutError) as err:
            failed[i] += 1
            if failed[i] >= tries:
                raise
            why = first_line(getattr(err, "cause", None) or err)  # a task's error: what the actor raised
        log.warning("rollout engine %d did not start (%s); starting a new one in its place (try %d of %d)",
                    i, why, failed[i] + 1, tries)
        try:
            ray.kill(engines[i])  # its server's process group ends with it (the reaper)
        except Exception:  # noqa: BLE001  (already gone)
            pass
        engines[i] = remake(i, "-".join(filter(None, [tag, f"start-{failed[i] + 1}"])))
        refs[i] = engines[i].start.remote()
    return engines


def engine_urls(recipe: Recipe) -> Sequence[str | None]:
    return recipe.rollout.urls or [None] * recipe.rollout.num_engines


def restore(a: Actors, recipe: Recipe, resume_from: Path | None) -> int:
    """Load the checkpoint (if resuming), connect weight sync and give the engines this run's weights;
    returns the version training continues from."""
    version = 0
    if resume_from is not None:
        state = ray.get(a.trainer.load_checkpoint.remote(DirBundle.of(resume_from)))
        ray.get(a.buffer.load_state_dict.remote(state["buffer"]))
        version = state["version"]
    if recipe.rollout.weight_sync == "broadcast":
        connect_broadcast(a.engines, a.trainer, recipe.rollout.sync_backend)
    if version or not a.own_engines or recipe.rollout.urls:  # engines we did not start may hold other weights
        publish_weights(a.engines, a.trainer, version, recipe.rollout.weight_sync, recipe.deadlines.weight_sync_s)
        ray.get(a.buffer.set_version.remote(version))
    return version


def start_env_workers(a: Actors) -> None:
    """The env workers' gateways serve (they produce once training starts)."""
    ray.get([w.start.remote() for w in a.workers])


def supervise(a: Actors, recipe: Recipe, run_dir: Path, created) -> Supervisor:
    """The run's supervisor, with how to start each kind of actor again (killed with the run: `created`)."""
    make = Launch(recipe, run_dir, a.policy, created)
    return Supervisor(a, recipe, start_engine=make.restarted_engine,
                      start_worker=lambda owner: make.env_worker(a, owner, start=True),
                      start_scorer=make.scorer if a.scorer is not None else None,
                      restartable=a.own_engines and not recipe.rollout.urls)


def stop_actors(a: Actors, recipe: Recipe, created, keep: bool = True) -> None:
    """The run's end: env workers closed, its own engines stopped, every actor it made killed but (with
    `keep`) a one-rank trainer and an env worker, kept for the driver's next run (factory/runtime/warm.py)."""
    ray.get([w.close.remote() for w in a.workers])
    if a.own_engines:
        ray.get([e.stop.remote() for e in a.engines])
    kept = []
    if keep:
        ranks = a.trainer_ranks()
        if len(ranks) == 1 and TRAINERS.keep(ranks[0], recipe.placement.trainer):
            kept.append(ranks[0])
        if a.workers and ENV_WORKERS.keep(a.workers[0], recipe.placement.env_worker):
            kept.append(a.workers[0])
    for actor in created:  # the run's own actors end with it (not when Python collects their handles)
        if not any(actor is k for k in kept):
            ray.kill(actor)
