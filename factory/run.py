"""One RL run, top to bottom.

    base policy ─▶ engines (vLLM) ◀─ weights ── trainer
                      ▲                          ▲
    env workers ──▶ gateway            batches of B groups
         │                                       │
         └──────── groups ──▶ buffer (η gate) ───┘

Env workers keep generating whenever the buffer's staleness gate admits a group; the loop below
takes batches, trains, and publishes weights. η = `async.max_staleness` alone decides how far
generation may run ahead: 0 is synchronous, 1 one-step off-policy, k fully asynchronous.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from collections.abc import Callable

import ray

from factory.data.lengths import fit_prompts
from factory.data.tasks import ReasoningGymSource
from factory.data.heldout import suite_tasks
from factory.model.policy_cache import base_policy_path
from factory.training.base_policy import base_policy_plan, ensure_base_policy
from factory.recipe import Recipe
from factory.support.failures import RunFailure, SpreadWatch
from factory.recording.recorder import RunRecorder, latest_checkpoint, prune_checkpoints
from factory.runtime.cluster import local_ray
from factory.runtime.deadlines import get_within
from factory.runtime.evaluation import evaluate_workers
from factory.runtime.launch import (
    Actors, killed_on_error, restore, start_actors, start_engines, start_env_workers, stop_actors, supervise,
)
from factory.runtime.supervisor import ActorLost, EngineLostDuringSync, Supervisor
from factory.runtime.weights import WeightPublisher, connect_broadcast, engine_metrics, publish_weights
from factory.support.throughput import WindowedRate

log = logging.getLogger("factory.run")

__all__ = ["StepReport", "connect_broadcast", "engine_metrics", "publish_weights", "run", "start_engines"]


@dataclass
class StepReport:
    step: int
    metrics: dict[str, float]


def run(recipe: Recipe, run_dir: Path, on_step: Callable[[StepReport], None] | None = None,
        on_phase: Callable[[str], None] | None = None, resume_from: Path | None = None,
        engines: list | None = None, on_sft_step: Callable[[int, int, float], None] | None = None) -> dict:
    """Train `recipe` end to end; returns the results also written to `run_dir/results.json`.

    `engines`: already-started EngineActors serving a model of the same architecture (tests and
    benchmarks share one vLLM server this way); they are given this run's weights first and are
    left running at the end. Without it the run starts and stops its own.

    A trainer that dies is rebuilt here, and the run resumes from its latest checkpoint exactly as a
    relaunched run would (the lake and MLflow rewound to it), up to `train.max_trainer_restarts` times.
    """
    phase = on_phase or (lambda _: None)
    restarts, before = 0, None
    while True:
        # a resumed run's base policy exists: a checkpoint it re-records may need the run's lineage now
        record = RunRecorder(recipe, run_dir, resume_from=resume_from, base_policy=base_policy_path(recipe))
        try:
            results = _run(recipe, run_dir, record, on_step, phase, resume_from, engines, on_sft_step, before)
        except TrainerLost as lost:
            record.fail()
            restarts += 1
            if restarts > recipe.train.max_trainer_restarts:
                raise ActorLost(f"the trainer died ({lost}) after {recipe.train.max_trainer_restarts} restarts in "
                                "this run; the run stops at train.max_trainer_restarts") from lost
            before, resume_from = lost.before, latest_checkpoint(run_dir)
            where = f"its checkpoint {resume_from.name}" if resume_from else "the start (no checkpoint yet)"
            log.warning("the trainer died (%s); rebuilding it and resuming from %s (restart %d of at most %d)",
                        lost, where, restarts, recipe.train.max_trainer_restarts)
            phase(f"the trainer died: resuming from {where}")
            continue
        except BaseException:
            record.fail()
            raise
        results["trainer_restarts"] = restarts
        record.finish(results)
        return results


class TrainerLost(RuntimeError):
    """The trainer's actor (a rank of it) died; `before`: the run's starting evaluation, kept for the
    attempt that resumes."""

    def __init__(self, why: str, before: dict | None = None):
        super().__init__(why)
        self.before = before


def _run(recipe: Recipe, run_dir: Path, record: RunRecorder, on_step, phase, resume_from, engines,
         on_sft_step, before: dict | None = None) -> dict:
    t_start = time.time()
    spent = PhaseTimes()
    policy, source, heldout = _inputs(recipe, record, phase, on_sft_step)
    spent.mark("inputs")
    with local_ray() as own_ray, killed_on_error() as created:  # a failed run leaves no actor behind, on any cluster
        phase("starting engines, trainer, buffer, env workers")
        a = start_actors(recipe, run_dir, record, policy, source.train, engines, created)
        version = restore(a, recipe, resume_from)
        start_env_workers(a)
        results: dict = {"run_dir": str(run_dir), "recipe": recipe.name, "policy": str(policy), "nodes": a.nodes()}
        # what the trainer's auto settings became: answered after its warm-up (which chooses some of them
        # on CUDA), a dummy pass begun with the engines' start and so bound by the start-up's deadline
        results["trainer"] = get_within(a.trainer.settings.remote(), recipe.rollout.startup_timeout_s,
                                        "trainer warm-up", "rollout.startup_timeout_s")
        log.info("trainer: %s", trainer_settings_line(results["trainer"]))
        spent.mark("start")
        if before is not None:  # a rebuilt trainer's attempt: the run's start was evaluated already
            results["before"] = before
        elif recipe.eval.before:
            results["before"] = _evaluate(a, heldout, recipe, record, version, "before", phase)
            spent.mark("evaluation_before")

        phase("training")
        sup = supervise(a, recipe, run_dir, created)
        clock = _train(a, sup, recipe, record, run_dir, version, results.get("before"), phase, on_step)
        spent.mark("training")

        phase("stopping rollouts")
        results.update(_stop(a, sup.producing, record, recipe.train.steps))
        results["restarts"] = dict(sup.restarts)
        spent.mark("stop")
        if recipe.eval.after:
            results["after"] = _evaluate(a, heldout, recipe, record, recipe.train.steps, "after", phase)
            spent.mark("evaluation_after")
        stop_actors(a, recipe, created, keep=not own_ray)  # a Ray that ends with the run takes its actors along
        spent.mark("shutdown")
    results["phase_seconds"] = spent.seconds
    log.info("where the run's time went: %s", spent.line())
    return _summary(results, recipe, clock, time.time() - t_start)


class PhaseTimes:
    """Wall seconds of a run's phases, each `mark(name)` closing the phase begun at the previous mark:
    inputs (base policy, tasks, prompt fit), start (actors, restore, warm-up), evaluation_before, training,
    stop (rollouts drained, their groups' fates recorded), evaluation_after, shutdown."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._t = time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = round(now - self._t, 2)
        self._t = now

    def line(self) -> str:
        return ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())


def _inputs(recipe: Recipe, record: RunRecorder, phase, on_sft_step) -> tuple[Path, ReasoningGymSource, list]:
    """The base policy (trained first if it is new), the task source and the held-out tasks; prompts
    that do not fit the engines' context are refused or dropped here, before anything starts."""
    plan = base_policy_plan(recipe)  # a new warm start is minutes of SFT: the line says why and about how long
    log.info(plan)
    phase(plan)
    # a resumed run starts from the base policy too and loads the checkpoint's state into the trainer: the
    # KL reference and the LoRA base stay the original policy (not the checkpoint's merged weights)
    policy = ensure_base_policy(recipe, on_sft_step)
    record.base_policy = policy  # the run's lineage names it
    source = ReasoningGymSource.from_recipe(recipe.data)
    # prompts longer than the engines' context: one line before anything starts, or dropped or cut (data.overlong)
    record.log_dropped(fit_prompts(recipe, policy, source))
    heldout = suite_tasks(recipe, "heldout", source=source)  # a seeded sample, never a prefix
    return policy, source, heldout


def _train(a: Actors, sup: Supervisor, recipe: Recipe, record: RunRecorder, run_dir: Path, version: int,
           before: dict | None, phase, on_step) -> LoopClock:
    """The steps after `version` up to `train.steps`, generation running under the supervisor's watch;
    the engines serve the last step's weights at the end. A trainer that dies raises TrainerLost."""
    deadlines = recipe.deadlines  # every wait below ends: batch, weight sync, trainer step, evaluation
    sync = WeightPublisher(a.engines, a.trainer, recipe.rollout.weight_sync, deadlines.weight_sync_s,
                           overlap=recipe.rollout.overlap_sync, poll=sup.interrupt_sync)
    sup.sync = sync
    producing = [w.produce.remote() for w in a.workers]
    sup.start(producing)
    clock = LoopClock(generated=ray.get(a.buffer.metrics.remote())["buffer/finished_samples"])
    watch = _spread_watch(recipe, phase)
    last_checkpoint = time.monotonic()
    try:
        for step in range(version + 1, recipe.train.steps + 1):
            metrics = _step(a, sup, sync, clock, watch, record, step, deadlines)
            record.log_step(step, metrics)
            if on_step:
                on_step(StepReport(step, metrics))
            if _checkpoint_due(recipe.train, step, last_checkpoint):
                _checkpoint(a, record, run_dir, step, deadlines)
                last_checkpoint = time.monotonic()
        clock.synced(_publish(sync, sup, None))  # the engines serve the last step's weights from here on
    except ray.exceptions.RayActorError as err:
        if a.trainer_alive():
            raise
        raise TrainerLost(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", before) from err
    finally:
        sup.stop()
        sup.sync = sync.poll = None  # no cycle keeps the handles alive past the run
    clock.stop()
    return clock


def _step(a: Actors, sup: Supervisor, sync: WeightPublisher, clock: LoopClock, watch: SpreadWatch | None,
          record: RunRecorder, step: int, deadlines) -> dict[str, float]:
    """One step: a batch, scored and trained on, its weights published, its samples recorded; its metrics."""
    batch = clock.waiting(partial(_next_batch, a, step, deadlines, _polling(a, watch, sup.check)))
    batch, metrics = _score_and_train(a, batch, step, deadlines, sup)
    metrics.update(clock.synced(_publish(sync, sup, step)))  # returns once new requests wait for `step`
    ray.get(a.buffer.set_version.remote(step))
    _record_samples(a, record, batch, step)
    metrics.update(_observe(a, clock, len(batch.samples)))
    if watch:  # with the filter off, batches keep coming whether they hold a gradient or not
        watch.observe(metrics)
    metrics.update(sup.metrics())
    return metrics


def _checkpoint_due(train, step: int, last_checkpoint: float) -> bool:
    """Every `train.checkpoint_every` steps, at the last step, and `train.checkpoint_every_s` after the last one."""
    every_s = train.checkpoint_every_s
    return bool((train.checkpoint_every and step % train.checkpoint_every == 0) or step == train.steps
                or (every_s and time.monotonic() - last_checkpoint >= every_s))


# ---- the loop's parts ---------------------------------------------------------------------------


def _spread_watch(recipe: Recipe, phase) -> SpreadWatch | None:
    """The watch for training without reward spread, where a group of equal rewards gives no gradient: the
    zero-variance filter drops it, or its advantages are 0 (a per-group estimator, no teacher, no overlong
    shaping); None where such a group may still teach (the filter off and any of those)."""
    from factory.algo.advantages import BATCH_SCOPE

    algo = recipe.algorithm
    if not algo.filter_zero_variance and (algo.advantage in BATCH_SCOPE or algo.distill.teacher or algo.overlong_buffer):
        return None
    return SpreadWatch(recipe.deadlines.no_signal_warn_s, recipe.deadlines.no_signal_s, partial(_warn, phase))


def _polling(a: Actors, watch: SpreadWatch | None, check: Callable[[], bool]) -> Callable[[], bool]:
    """The poll of a batch wait: the supervisor's `check`, then the spread watch when it is due."""
    def poll() -> bool:
        restarted = check()
        if watch and watch.due():
            try:
                watch.observe(ray.get(a.buffer.metrics.remote(), timeout=10))
            except ray.exceptions.GetTimeoutError:  # a buffer that hangs ends the wait by deadlines.batch_s
                pass
        return restarted
    return poll


def _warn(phase, line: str) -> None:
    log.warning(line)
    phase(line)


def _next_batch(a: Actors, step: int, deadlines, poll=None):
    return get_within(a.buffer.get_batch.remote(), deadlines.batch_s, f"the batch of step {step}",
                      "deadlines.batch_s", lambda: _buffer_state(a.buffer), poll)


def _publish(sync: WeightPublisher, sup: Supervisor, step: int | None) -> dict[str, float]:
    """`sync.publish(step)` (`step` None: `sync.finish()`, the wait for the update under way). When an
    engine was lost under it, the supervisor's recovery gives every engine the trainer's current
    weights instead; when it failed with every engine still answering (the weight group broke), the
    supervisor forms the group anew and sends them (`Supervisor.resync`, bounded)."""
    t0 = time.perf_counter()
    try:
        return sync.publish(step) if step is not None else sync.finish()
    except EngineLostDuringSync:
        pass
    except (ray.exceptions.RayError, RunFailure) as err:
        sup.sync_failed(f"weight sync of version {step}" if step is not None else "the last weight sync", err)
    sup.check()
    return {"weightsync/blocked_s": time.perf_counter() - t0}


def _evaluate(a: Actors, tasks, recipe: Recipe, record: RunRecorder, step: int, tag: str, phase) -> dict:
    """Held-out accuracy of the policy the engines serve, its episodes recorded (lake) under `tag`."""
    phase(f"evaluating the {'starting' if tag == 'before' else 'trained'} policy on {len(tasks)} held-out tasks")
    result = evaluate_workers(a.workers, tasks, recipe, tag, keep_episodes=record.keeps_all_samples)
    record.log_evaluation(step, step, "heldout", result, result.pop("episodes", None), tag)
    return result


def _score_and_train(a: Actors, batch, step: int, deadlines, sup: Supervisor | None = None) -> tuple:
    """The scoring phase (if any) and one optimizer step: (the batch as trained, its metrics). A scorer
    that dies under its call is started again and scores the batch anew."""
    scored = {}
    if a.scorer is not None:
        t0 = time.perf_counter()
        while True:
            try:
                batch, scored = get_within(a.scorer.score.remote(batch), deadlines.train_step_s,
                                           f"scoring the batch of step {step}", "deadlines.train_step_s")
                break
            except ray.exceptions.RayActorError as err:
                if sup is None:
                    raise
                sup.restart_scorer(type(err).__name__)
        scored["perf/score_s"] = time.perf_counter() - t0
    metrics = get_within(a.trainer.train_step.remote(batch), deadlines.train_step_s, f"trainer step {step}",
                         "deadlines.train_step_s")
    return batch, {**metrics, **scored}


def _record_samples(a: Actors, record: RunRecorder, batch, step: int) -> None:
    """The batch the step trained on, and what this step's generation will never train (filtered,
    stale, failed), fetched and written off the loop by the recorder's thread."""
    record.log_batch(batch, step)
    if record.keeps_all_samples:
        record.log_discarded(step, partial(ray.get, a.buffer.take_discarded.remote()))


def _observe(a: Actors, clock: LoopClock, trained: int) -> dict[str, float]:
    """The buffer's and engines' metrics, and throughput per window and overall."""
    metrics = {**ray.get(a.buffer.metrics.remote()), **engine_metrics(a.engines)}
    metrics.update(clock.trained(trained, metrics["buffer/finished_samples"]))
    return metrics


def _checkpoint(a: Actors, record: RunRecorder, run_dir: Path, step: int, deadlines) -> None:
    """Buffer state + trainer checkpoint into run_dir, once the lake holds every row before it."""
    # the state and the discards so far in one call: nothing slips between the two
    state, discarded, failed = ray.get(a.buffer.checkpoint_state.remote())
    record.log_discarded(step, discarded, failed)
    ckpt = run_dir / "checkpoints" / f"step-{step:06d}"
    record.flush(checkpoint_step=step)  # the lake holds every row up to a checkpoint before the checkpoint exists
    bundle = get_within(a.trainer.checkpoint.remote({"buffer": state, "step": step}), deadlines.train_step_s,
                        f"checkpoint of step {step}", "deadlines.train_step_s")
    bundle.write(ckpt)  # from the trainer's node to the run dir
    record.log_checkpoint(step, step, ckpt)
    pruned = prune_checkpoints(run_dir, record.recipe.train.keep_checkpoints)  # after the new one is whole
    if pruned:
        log.info("checkpoint %s written; deleted %s (train.keep_checkpoints=%d)", ckpt.name,
                 ", ".join(p.name for p in pruned), record.recipe.train.keep_checkpoints)


def _stop(a: Actors, producing: list, record: RunRecorder, last_step: int) -> dict:
    """Stop generation; record what was never trained; the buffer's final counts and engine requests."""
    ray.get(a.buffer.stop.remote())
    ray.get([w.stop_producing.remote() for w in a.workers])
    ray.get(producing)
    if record.keeps_all_samples:  # what was still queued, and what finished while stopping
        record.log_discarded(last_step, *ray.get(a.buffer.take_discarded.remote(unused=True)))
    engines = ray.get([e.metrics.remote() for e in a.engines])  # after the last update (sync.finish)
    return {"buffer": ray.get(a.buffer.metrics.remote()),  # the final counts: every group's fate
            "engine_requests": [m.get("rollout/engine_requests", 0.0) for m in engines],
            "engine_updates": [m.get("weightsync/updates", 0.0) for m in engines],
            "engine_versions": [m.get("rollout/engine_version") for m in engines],
            "threads": {"trainer": ray.get(a.trainer.threads.remote()),  # as resolved (auto) on their nodes
                        "engines": [m.get("rollout/engine_threads") for m in engines]}}


def trainer_settings_line(settings: dict) -> str:
    """One line of the trainer's resolved settings (`Trainer.settings`), the reasons last."""
    shown = ", ".join(f"{k}={v}" for k, v in settings.items() if not k.endswith("_why"))
    why = "; ".join(f"{k.removesuffix('_why')}: {v}" for k, v in settings.items() if k.endswith("_why"))
    return f"{shown} ({why})" if why else shown


class LoopClock:
    """Where the loop's time goes: waiting for batches (the first wait is the pipeline fill), weight
    sync, and samples/s per window (`WindowedRate`: a running mean hides a slowdown) and overall."""

    def __init__(self, generated: float = 0.0):
        self.t0 = time.perf_counter()
        self.wait_s = self.sync_s = 0.0
        self.fill_s: float | None = None
        self.samples = 0
        self.window = WindowedRate()
        # generated counts from the buffer's total, which a resumed run restores from its checkpoint
        self.window.observe(0.0, trained=0, generated=generated)
        self.train_s = 0.0

    def waiting(self, wait: Callable):
        t0 = time.perf_counter()
        try:
            return wait()
        finally:
            self.wait_s += time.perf_counter() - t0
            if self.fill_s is None:  # the pipeline fill: nothing to train on until the first batch
                self.fill_s = self.wait_s

    def synced(self, sync: dict[str, float]) -> dict[str, float]:
        self.sync_s += sync["weightsync/blocked_s"]  # the driver's wait (overlapped syncs: closing admission)
        return sync

    def trained(self, samples: int, generated: float) -> dict[str, float]:
        self.samples += samples
        elapsed = time.perf_counter() - self.t0
        rates = self.window.observe(elapsed, trained=self.samples, generated=generated)
        return {"perf/trained_samples_per_s": rates["trained"], "perf/generated_samples_per_s": rates["generated"],
                "perf/trained_samples": self.samples, "perf/samples_per_s": self.samples / elapsed,
                "perf/trainer_idle_fraction": self.wait_s / elapsed, "perf/elapsed_s": elapsed}

    def stop(self) -> None:
        self.train_s = time.perf_counter() - self.t0


def _summary(results: dict, recipe: Recipe, clock: LoopClock, total_s: float) -> dict:
    """The run's results: timing, samples, and the before/after difference with its standard error."""
    fill_s = clock.fill_s or 0.0
    results.update({
        "steps": recipe.train.steps,
        "max_staleness": recipe.async_.max_staleness,
        "samples_trained": clock.samples,
        "train_seconds": clock.train_s,
        "trainer_idle_fraction": clock.wait_s / max(clock.train_s, 1e-9),
        "first_batch_wait_seconds": fill_s,
        "trainer_idle_fraction_after_first_batch": (clock.wait_s - fill_s) / max(clock.train_s - fill_s, 1e-9),
        "weight_sync_seconds": clock.sync_s,
        "total_seconds": total_s,
    })
    if "before" in results and "after" in results:
        b, after = results["before"], results["after"]
        results["delta"] = after["mean"] - b["mean"]
        results["delta_stderr"] = (after["stderr"] ** 2 + b["stderr"] ** 2) ** 0.5
        results["improved_beyond_2se"] = results["delta"] > 2 * results["delta_stderr"]
    return results


def _buffer_state(buffer) -> str:
    """What the buffer holds, for an error about a batch that never came."""
    try:
        m = ray.get(buffer.metrics.remote(), timeout=10)
    except Exception:  # noqa: BLE001  (the buffer itself may be what hangs)
        return "the buffer did not answer either"
    state = (f"buffer: {m['buffer/running']:.0f} groups running, {m['buffer/queued']:.0f} queued; finished so far "
             f"{m['buffer/consumed']:.0f} trained, {m['buffer/filtered']:.0f} filtered, {m['buffer/rejected_groups']:.0f} "
             f"rejected, {m['buffer/failed']:.0f} failed")
    if m["buffer/groups_since_spread"]:  # deadlines.batch_s may come before deadlines.no_signal_s
        state += (f"; no reward spread for {m['buffer/seconds_since_spread']:.0f} s ("
                  f"{m['buffer/groups_since_spread']:.0f} groups since the last one, mean reward "
                  f"{m['buffer/reward_since_spread']:.3f})")
    return state
