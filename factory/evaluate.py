"""Held-out evaluation: sampled accuracy of a policy on a task suite, with its standard error.

`evaluate_workers` is what the run loop calls with its own env workers; `evaluate_checkpoint`
stands up its own engine and env worker, so a checkpoint can be scored while training goes on
(the Dagster evaluation asset, schedule and sensor call it).
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import ray

from factory.data.tasks import ReasoningGymSource, seeded_subset
from factory.recipe import Recipe
from factory.runtime.actors import EngineActor, EnvWorkerActor, placed
from factory.runtime.cluster import local_ray
from factory.runtime.transfer import DirBundle
from factory.runtime.weights import load_bundle

SUITES = ("heldout", "train")


def tasks_digest(tasks) -> str:
    """12 hex digits naming the set of tasks an evaluation scored (equal digests: the same tasks)."""
    return hashlib.sha256("\n".join(sorted(t.task_id for t in tasks)).encode()).hexdigest()[:12]


def evaluate_workers(workers, tasks, recipe: Recipe, tag: str) -> dict:
    """One episode per task, sharded over `workers`; mean reward ± standard error, per family, and
    the digest of the task set."""
    shards = [tasks[i:: len(workers)] for i in range(len(workers))]
    parts = ray.get([w.evaluate.remote(s, recipe.eval.temperature, recipe.rollout.max_new_tokens, f"{tag}-{i}")
                     for i, (w, s) in enumerate(zip(workers, shards)) if s])
    return {**_merge(parts), "tasks_digest": tasks_digest(tasks)}


def _merge(parts: list[dict]) -> dict:
    """Shard results as one: the pooled mean, and SE = sqrt(Σ (n_i·SE_i)²) / n."""
    if len(parts) == 1:
        return parts[0]
    n = sum(p["n"] for p in parts)
    mean = sum(p["mean"] * p["n"] for p in parts) / n
    stderr = sum((p["stderr"] * p["n"]) ** 2 for p in parts) ** 0.5 / n
    families: dict[str, float] = {}
    for f in {f for p in parts for f in p["by_family"]}:
        weighted = [(p["by_family"][f], p["n"]) for p in parts if f in p["by_family"]]
        families[f] = sum(v * k for v, k in weighted) / sum(k for _, k in weighted)
    return {"mean": mean, "stderr": stderr, "n": n, "by_family": families}


def suite_tasks(recipe: Recipe, suite: str = "heldout", n: int | None = None,
                source: ReasoningGymSource | None = None):
    """The tasks an evaluation of `n` (default `eval.heldout`) scores: a sample of the suite seeded by
    `eval.seed`, so before and after training, and every run of the recipe, score the same tasks."""
    if suite not in SUITES:
        raise ValueError(f"suite: unknown {suite!r}; choose one of {list(SUITES)}")
    if n is not None and n <= 0:
        raise ValueError(f"n: expected a positive number of tasks, got {n}")
    source = source or ReasoningGymSource.from_recipe(recipe.data)
    tasks = source.heldout if suite == "heldout" else source.train
    return seeded_subset(tasks, n or recipe.eval.heldout, recipe.eval.seed)


def evaluate_checkpoint(recipe: Recipe, checkpoint: str | Path, suite: str = "heldout", n: int | None = None,
                        engines: list | None = None) -> dict:
    """Score the policy saved at `checkpoint` (an HF model dir) on `suite`.

    Starts its own engine, or reuses started `engines` after loading the checkpoint into them
    (disk reload; they keep those weights afterwards)."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint}: not a model directory (no config.json)")
    tasks = suite_tasks(recipe, suite, n)
    with local_ray(), tempfile.TemporaryDirectory(prefix="factory-eval-") as tmp:
        model = ray.put(DirBundle.of(checkpoint, exclude=("trainer.pt",)))  # to whichever nodes serve it
        own = engines is None
        if own:
            engines = [placed(EngineActor, recipe.placement.engine).remote(
                recipe.rollout.engine, model, recipe.rollout, str(Path(tmp) / "engine.log"))]
            ray.get([e.start.remote() for e in engines])
        else:
            ray.get([e.begin_update.remote() for e in engines])
            load_bundle(engines, model, "disk")
            ray.get([e.end_update.remote(-1) for e in engines])  # -1: not a version of any run
        worker = placed(EnvWorkerActor, recipe.placement.env_worker).remote(model, recipe.environment, recipe.rollout,
                                                                             engines, None)
        try:
            ray.get(worker.start.remote())
            return evaluate_workers([worker], tasks, recipe, f"eval-{suite}")
        finally:
            ray.get(worker.close.remote())
            if own:
                ray.get([e.stop.remote() for e in engines])
