"""Evaluation on the cluster: episodes of a task suite spread over env workers (the run's own, or an
engine and worker stood up for one checkpoint). Which tasks, and how results merge: factory/data/heldout.py.

`evaluate_workers` is what the run loop calls with its own env workers; `evaluate_checkpoint`
stands up its own engine (or attaches to running ones by URL) and env worker, so a checkpoint can be
scored while training goes on (the Dagster evaluation asset, schedule and sensor call it).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import ray

from factory.data.heldout import merge_chunks, suite_tasks, tasks_digest
from factory.recipe import Recipe
from factory.rewards import verifier_specs
from factory.rollout.episodes import summarize
from factory.runtime.actor_base import placed
from factory.runtime.engine_actor import EngineActor
from factory.runtime.env_worker import EnvWorkerActor
from factory.runtime.cluster import local_ray
from factory.runtime.deadlines import Deadline
from factory.runtime.transfer import DirBundle
from factory.support.threads import shape_of

CHUNK = 32  # tasks per call: progress moves every CHUNK episodes
IN_FLIGHT = 4  # calls per worker at once: CHUNK * IN_FLIGHT episodes in flight, as before in one call


def _check_samples(samples: int) -> None:
    if samples < 1:
        raise ValueError(f"samples: expected at least 1 episode per task, got {samples}")


def evaluate_workers(workers, tasks, recipe: Recipe, tag: str,
                     on_progress: Callable[[int, int], None] | None = None, keep_episodes: bool = False,
                     samples: int = 1) -> dict:
    """`samples` episodes per task (each its own seeded request), in chunks spread over `workers`; the
    mean reward ± standard error over the tasks (of each task's mean: a task's samples are not
    independent draws of the suite), per family, and the digest of the task set. `samples` > 1 lowers
    the sampling noise of a score at temperature > 0 (mean@k); the result's "samples_per_task" says
    which. `on_progress(done, total)` counts episodes after each chunk; the whole evaluation ends
    within `deadlines.evaluation_s`. `keep_episodes`: the result's "episodes" holds each episode's
    Sample, in the tasks' order (a task's samples together; for the lake)."""
    _check_samples(samples)
    deadline = Deadline(recipe.deadlines.evaluation_s, f"evaluation {tag} on {len(tasks)} tasks"
                        + (f" × {samples} samples" if samples > 1 else ""), "deadlines.evaluation_s")
    played = [t for t in tasks for _ in range(samples)]
    chunks = [(i, played[i: i + CHUNK]) for i in range(0, len(played), CHUNK)]
    rewards: dict[int, list[float]] = {}
    episodes: dict[int, list] = {}
    running: dict = {}  # ObjectRef -> (worker, chunk start)
    busy = dict.fromkeys(range(len(workers)), 0)
    while chunks or running:
        for w in range(len(workers)):
            while chunks and busy[w] < IN_FLIGHT:
                start, part = chunks.pop(0)
                ref = workers[w].episodes.remote(part, recipe.eval.temperature, recipe.rollout.max_new_tokens,
                                                 f"{tag}-{start}", keep_episodes)
                running[ref] = (w, start)
                busy[w] += 1
        ready, _ = ray.wait(list(running), num_returns=1, timeout=deadline.left())
        if not ready:
            raise deadline.exceeded()
        for ref in ready:
            w, start = running.pop(ref)
            busy[w] -= 1
            done = deadline.get(ref)
            rewards[start] = [reward for reward, _ in done]
            episodes[start] = [sample for _, sample in done]
        if on_progress:
            on_progress(sum(len(r) for r in rewards.values()), len(played))
    ordered = merge_chunks(rewards)
    per_task = [sum(ordered[i: i + samples]) / samples for i in range(0, len(ordered), samples)]
    result = {**summarize(per_task, [t.family for t in tasks]).to_dict(), "tasks_digest": tasks_digest(tasks),
              "samples_per_task": samples}
    if keep_episodes:
        result["episodes"] = merge_chunks(episodes)
    return result


def evaluate_checkpoint(recipe: Recipe, checkpoint: str | Path, suite: str = "heldout", n: int | None = None,
                        engines: list | None = None, on_phase: Callable[[str], None] | None = None,
                        on_progress: Callable[[int, int], None] | None = None, keep_episodes: bool = False,
                        urls: Sequence[str] = (), samples: int = 1) -> dict:
    """Score the policy saved at `checkpoint` (an HF model dir) on `suite`; `keep_episodes` and
    `samples` (episodes per task): see `evaluate_workers`.

    Starts its own engine, or reuses started `engines`, or attaches to the vLLM servers running at
    `urls` (rollout.urls' form), loading the checkpoint into them (disk reload; they keep those weights
    afterwards, so they must be servers no run is training on) and leaving them running.
    `on_phase(text)` names each stage, `on_progress(done, total)` counts episodes."""
    phase = on_phase or (lambda _: None)
    _check_samples(samples)  # before an engine starts
    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint}: not a model directory (no config.json)")
    phase(f"choosing {n or recipe.eval.heldout} {suite} tasks (a sample seeded by eval.seed={recipe.eval.seed})")
    tasks = suite_tasks(recipe, suite, n)
    with local_ray(), tempfile.TemporaryDirectory(prefix="factory-eval-") as tmp:
        model = ray.put(DirBundle.of(checkpoint, exclude=("trainer.pt",)))  # to whichever nodes serve it
        own = engines is None  # ours to stop (an attached server stays up: stopping its client disconnects)
        if engines is None:
            phase(f"attaching to {', '.join(urls)}" if urls else f"starting a {recipe.rollout.engine} engine on "
                  f"{checkpoint}")
            engines = [placed(EngineActor, recipe.placement.engine).remote(
                recipe.rollout.engine, model, recipe.rollout, str(Path(tmp) / f"engine-{i}.log"), url=url,
                shape=shape_of(recipe, generating_only=True)) for i, url in enumerate(urls or [None])]
        # the worker's process (tokenizer, verifiers warmed) is made while the engines start
        worker = placed(EnvWorkerActor, recipe.placement.env_worker).remote(
            model, recipe.environment, recipe.rollout, engines, None, recipe.failures, recipe.deadlines,
            verifiers=verifier_specs(tasks))
        if own:
            ray.get([e.start.remote() for e in engines])
        if not own or urls:
            ray.get([e.update.remote(-1, "disk", model) for e in engines])  # -1: not a version of any run
        try:
            ray.get(worker.start.remote())
            phase(f"evaluating on {len(tasks)} {suite} tasks" + (f", {samples} samples each" if samples > 1 else ""))
            return evaluate_workers([worker], tasks, recipe, f"eval-{suite}", on_progress, keep_episodes, samples)
        finally:
            ray.get(worker.close.remote())
            if own:
                ray.get([e.stop.remote() for e in engines])
