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

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from collections.abc import Callable

import ray

from factory.data.tasks import ReasoningGymSource
from factory.evaluate import suite_tasks
from factory.model.sft import ensure_base_policy
from factory.recipe import Recipe
from factory.recording import RunRecorder
from factory.runtime.actors import (
    BufferActor, EngineActor, EnvWorkerActor, ScorerActor, TrainerActor, killed_on_error, placed,
)
from factory.runtime.cluster import check_placement, local_ray
from factory.runtime.deadlines import get_within
from factory.runtime.evaluation import evaluate_workers
from factory.runtime.transfer import DirBundle, node_ip
from factory.runtime.weights import connect_broadcast, engine_metrics, publish_weights
from factory.throughput import WindowedRate

__all__ = ["StepReport", "connect_broadcast", "engine_metrics", "publish_weights", "run"]


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
    """
    record = RunRecorder(recipe, run_dir, resume_from=resume_from)
    try:
        results = _run(recipe, run_dir, record, on_step, on_phase or (lambda _: None), resume_from, engines,
                       on_sft_step)
    except BaseException:
        record.fail()
        raise
    record.finish(results)
    return results


def _run(recipe: Recipe, run_dir: Path, record: RunRecorder, on_step, phase, resume_from, engines,
         on_sft_step) -> dict:
    t_start = time.time()

    phase("base policy (build + SFT warm start, cached)")
    # a resumed run starts from the base policy too and loads the checkpoint's state into the trainer: the
    # KL reference and the LoRA base stay the original policy (not the checkpoint's merged weights)
    policy = ensure_base_policy(recipe, on_sft_step)
    source = ReasoningGymSource.from_recipe(recipe.data)
    heldout = suite_tasks(recipe, "heldout", source=source)  # a seeded sample, never a prefix

    with local_ray(), killed_on_error() as created:  # a failed run leaves no actor behind, on any cluster
        phase("starting engines, trainer, buffer, env workers")
        where = recipe.placement
        check_placement(where, engines=recipe.rollout.num_engines if engines is None else 0,
                        env_workers=recipe.environment.workers, scorer=bool(recipe.algorithm.distill.teacher))
        # every role gets the policy over the network: no node may assume another's disk
        policy_ref = ray.put(DirBundle.of(policy, "policy", exclude=("trainer.pt",)))
        own_engines = engines is None
        if own_engines:
            lora_rank = recipe.train.lora.rank if recipe.train.lora.enabled else 0
            urls = recipe.rollout.urls or [None] * recipe.rollout.num_engines
            engines = [placed(EngineActor, where.engine).remote(recipe.rollout.engine, policy_ref, recipe.rollout,
                                                                str(run_dir / f"engine-{i}.log"), lora_rank, url)
                       for i, url in enumerate(urls)]
            created.extend(engines)
        trainer = placed(TrainerActor, where.trainer).remote(policy_ref, recipe.algorithm, recipe.train, recipe.rollout)
        # the scoring phase: a teacher grading every trained token (on-policy distillation), if any
        distill = recipe.algorithm.distill
        scorer = (placed(ScorerActor, where.scorer).remote(distill, recipe.rollout,
                                                           DirBundle.of(distill.teacher, "teacher"))
                  if distill.teacher else None)
        buffer = placed(BufferActor, where.buffer).remote(
            recipe.name, source.train, recipe.train.groups_per_step, recipe.async_.max_staleness,
            recipe.async_.max_inflight_groups, recipe.algorithm.filter_zero_variance, recipe.train.seed,
            recipe.async_.overprovision, recipe.async_.schedule, recipe.async_.lookahead, recipe.failures,
            record.keeps_all_samples)
        created.extend(a for a in (trainer, scorer, buffer) if a is not None)
        if record.keeps_all_samples:  # a failing run still records what it generated (failed groups too)
            created.before_kill.append(lambda: record.log_discarded(
                record.step, *ray.get(buffer.take_discarded.remote(unused=True), timeout=30)))
        ray.get([e.start.remote() for e in engines])
        if not own_engines:
            ray.get([e.set_partial_rollout.remote(recipe.rollout.partial_rollout) for e in engines])
        version = 0
        deadlines = recipe.deadlines  # every wait below ends: batch, weight sync, trainer step, evaluation
        if resume_from is not None:
            state = ray.get(trainer.load_checkpoint.remote(DirBundle.of(resume_from)))
            ray.get(buffer.load_state_dict.remote(state["buffer"]))
            version = state["version"]
        if recipe.rollout.weight_sync == "broadcast":
            connect_broadcast(engines, trainer, recipe.rollout.sync_backend)
        if version or not own_engines or recipe.rollout.urls:  # engines we did not start may hold other weights
            publish_weights(engines, trainer, version, recipe.rollout.weight_sync, deadlines.weight_sync_s)
            ray.get(buffer.set_version.remote(version))
        workers = [placed(EnvWorkerActor, where.env_worker).remote(policy_ref, recipe.environment, recipe.rollout,
                                                                   engines, buffer, recipe.failures, deadlines)
                   for _ in range(recipe.environment.workers)]
        created.extend(workers)
        ray.get([w.start.remote() for w in workers])
        nodes = {"driver": node_ip(), "trainer": ray.get(trainer.node_ip.remote()),
                 "buffer": ray.get(buffer.node_ip.remote()),
                 "engines": ray.get([e.node_ip.remote() for e in engines]),
                 "env_workers": ray.get([w.node_ip.remote() for w in workers])}

        results: dict = {"run_dir": str(run_dir), "recipe": recipe.name, "policy": str(policy), "nodes": nodes}
        if recipe.eval.before:
            phase(f"evaluating the starting policy on {len(heldout)} held-out tasks")
            results["before"] = evaluate_workers(workers, heldout, recipe, "before",
                                                 keep_episodes=record.keeps_all_samples)
            record.log_evaluation(version, version, "heldout", results["before"], results["before"].pop("episodes", None),
                                  "before")

        phase("training")
        producing = [w.produce.remote() for w in workers]
        t_train = time.perf_counter()
        wait_s = sync_s = fill_s = 0.0
        samples_done = 0
        window = WindowedRate()  # samples/s over the last steps: a running mean hides a slowdown
        # generated counts from the buffer's total, which a resumed run restores from its checkpoint
        window.observe(0.0, trained=0, generated=ray.get(buffer.metrics.remote())["buffer/finished_samples"])
        for step in range(version + 1, recipe.train.steps + 1):
            t0 = time.perf_counter()
            batch = get_within(buffer.get_batch.remote(), deadlines.batch_s, f"the batch of step {step}",
                               "deadlines.batch_s", lambda: _buffer_state(buffer))
            wait_s += time.perf_counter() - t0
            if step == version + 1:  # the pipeline fill: nothing to train on until the first batch
                fill_s = wait_s
            scored = {}
            if scorer is not None:
                t_score = time.perf_counter()
                batch, scored = get_within(scorer.score.remote(batch), deadlines.train_step_s,
                                           f"scoring the batch of step {step}", "deadlines.train_step_s")
                scored["perf/score_s"] = time.perf_counter() - t_score
            metrics = get_within(trainer.train_step.remote(batch), deadlines.train_step_s, f"trainer step {step}",
                                 "deadlines.train_step_s")
            metrics.update(scored)
            sync = publish_weights(engines, trainer, step, recipe.rollout.weight_sync, deadlines.weight_sync_s)
            sync_s += sync["weightsync/seconds"]
            ray.get(buffer.set_version.remote(step))
            record.log_batch(batch, step)
            if record.keeps_all_samples:  # what this step's generation will never train: filtered, stale, failed
                record.log_discarded(step, partial(ray.get, buffer.take_discarded.remote()))  # fetched off the loop
            samples_done += len(batch.samples)
            elapsed = time.perf_counter() - t_train
            metrics.update(ray.get(buffer.metrics.remote()))
            metrics.update(engine_metrics(engines))
            metrics.update(sync)
            rates = window.observe(elapsed, trained=samples_done, generated=metrics["buffer/finished_samples"])
            metrics.update({"perf/trained_samples_per_s": rates["trained"], "perf/generated_samples_per_s":
                            rates["generated"], "perf/trained_samples": samples_done})
            metrics.update({"perf/samples_per_s": samples_done / elapsed,
                            "perf/trainer_idle_fraction": wait_s / elapsed, "perf/elapsed_s": elapsed})
            record.log_step(step, metrics)
            if on_step:
                on_step(StepReport(step, metrics))
            every = recipe.train.checkpoint_every
            if (every and step % every == 0) or step == recipe.train.steps:
                # the state and the discards so far in one call: nothing slips between the two
                state, discarded, failed = ray.get(buffer.checkpoint_state.remote())
                record.log_discarded(step, discarded, failed)
                extra = {"buffer": state, "step": step}
                ckpt = run_dir / "checkpoints" / f"step-{step:06d}"
                record.flush()  # the lake holds every row up to a checkpoint before the checkpoint exists
                bundle = get_within(trainer.checkpoint.remote(extra), deadlines.train_step_s,
                                    f"checkpoint of step {step}", "deadlines.train_step_s")
                bundle.write(ckpt)  # from the trainer's node to the run dir
                record.log_checkpoint(step, step, ckpt)
        train_s = time.perf_counter() - t_train

        phase("stopping rollouts")
        ray.get(buffer.stop.remote())
        ray.get([w.stop_producing.remote() for w in workers])
        ray.get(producing)
        if record.keeps_all_samples:  # what was still queued, and what finished while stopping
            record.log_discarded(recipe.train.steps, *ray.get(buffer.take_discarded.remote(unused=True)))
        results["buffer"] = ray.get(buffer.metrics.remote())  # the final counts: every group's fate
        results["engine_requests"] = [m.get("rollout/engine_requests", 0.0)
                                      for m in ray.get([e.metrics.remote() for e in engines])]
        if recipe.eval.after:
            phase(f"evaluating the trained policy on {len(heldout)} held-out tasks")
            results["after"] = evaluate_workers(workers, heldout, recipe, "after", keep_episodes=record.keeps_all_samples)
            record.log_evaluation(recipe.train.steps, recipe.train.steps, "heldout", results["after"],
                                  results["after"].pop("episodes", None), "after")
        ray.get([w.close.remote() for w in workers])
        if own_engines:
            ray.get([e.stop.remote() for e in engines])

    results.update({
        "steps": recipe.train.steps,
        "max_staleness": recipe.async_.max_staleness,
        "samples_trained": samples_done,
        "train_seconds": train_s,
        "trainer_idle_fraction": wait_s / max(train_s, 1e-9),
        "first_batch_wait_seconds": fill_s,
        "trainer_idle_fraction_after_first_batch": (wait_s - fill_s) / max(train_s - fill_s, 1e-9),
        "weight_sync_seconds": sync_s,
        "total_seconds": time.time() - t_start,
    })
    if "before" in results and "after" in results:
        b, a = results["before"], results["after"]
        results["delta"] = a["mean"] - b["mean"]
        results["delta_stderr"] = (a["stderr"] ** 2 + b["stderr"] ** 2) ** 0.5
        results["improved_beyond_2se"] = results["delta"] > 2 * results["delta_stderr"]
    return results


def _buffer_state(buffer) -> str:
    """What the buffer holds, for an error about a batch that never came."""
    try:
        m = ray.get(buffer.metrics.remote(), timeout=10)
    except Exception:  # noqa: BLE001  (the buffer itself may be what hangs)
        return "the buffer did not answer either"
    return (f"buffer: {m['buffer/running']:.0f} groups running, {m['buffer/queued']:.0f} queued; finished so far "
            f"{m['buffer/consumed']:.0f} trained, {m['buffer/filtered']:.0f} filtered, {m['buffer/rejected_groups']:.0f} "
            f"rejected, {m['buffer/failed']:.0f} failed")
