"""Exact resume on the real stack: a run resumed from its step-k checkpoint at η = 0 trains the same
samples, in the same order, as the run that went on, and reaches the same weights. (With LoRA and a
KL penalty, whose base and reference must stay the original policy: tests/integration/test_lora.py.)"""

from __future__ import annotations

import json

from safetensors.torch import load_file

from factory.lake.query import sql
from factory.run import run

from .conftest import small_recipe

# η = 0 with seeded requests: generation for step k+1 starts from the same weights, tasks, group ids and
# seeds in both runs, so it repeats token for token, and so do the rewards and which groups the
# zero-variance filter drops (kept on: the test policy scores 0 on most groups, which teach nothing).
EXACT = ["async.max_staleness=0", "rollout.seed=7", "train.steps=3", "train.checkpoint_every=2",
         "eval.before=false", "eval.after=false"]
# The weights after the step past the resume: equal up to this share of that step's own update (the
# behaviour logprobs come from a bf16 engine whose batches may be composed differently).
WEIGHT_TOLERANCE = 0.02


def trained(run_dir, step):
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return [(r["sample_id"], r["completion_ids"]) for r in rows if r["trained_step"] == step]


def weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def step_metrics(run_dir, step) -> dict:
    return next(m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m["step"] == step)


def check_resume_repeats(engine, tmp_path, *overrides: str) -> tuple:
    """Run `overrides` for 3 steps, resume a second run from its step-2 checkpoint, and check that step 3
    trained the same samples, in the same order, and reached the same weights. Returns both run dirs."""
    recipe = small_recipe(*EXACT, *overrides)
    whole, resumed = tmp_path / f"{tmp_path.name}-whole", tmp_path / f"{tmp_path.name}-resumed"  # run ids: unique
    run(recipe, whole, engines=[engine])
    checkpoint = whole / "checkpoints" / "step-000002"
    state = json.loads((checkpoint / "state.json").read_text())["buffer"]  # the BufferActor's state
    results = run(recipe, resumed, engines=[engine], resume_from=checkpoint)

    # the same samples, in the same order, for the step after the checkpoint
    assert results["samples_trained"] == len(trained(resumed, 3)) > 0
    assert trained(resumed, 3) == trained(whole, 3)
    # what the checkpoint held in flight or queued was re-started under its ids, not skipped (trained,
    # or filtered: the lake has every generated sample with its fate)
    pending = {gid for gid, _ in state["inflight"]} | {g["group_id"] for g in state["buffer"]["queue"]}
    generated = sql(f"SELECT DISTINCT group_id FROM samples WHERE run_id = '{resumed.name}' AND status <> 'evaluation'")
    assert pending and pending <= set(generated["group_id"].to_pylist())

    # the same weights after that step, up to a small share of the step's own update
    before, whole3, resumed3 = weights(whole, 2), weights(whole, 3), weights(resumed, 3)
    for name, w in whole3.items():
        update = (w - before[name]).abs().max()
        gap = (resumed3[name] - w).abs().max()
        assert gap <= WEIGHT_TOLERANCE * update + 1e-7, (name, float(gap), float(update))
    assert max(float((whole3[n] - before[n]).abs().max()) for n in whole3) > 0  # the step did move them
    return whole, resumed


def test_a_resumed_run_repeats_the_uninterrupted_one(engine, tmp_path):
    check_resume_repeats(engine, tmp_path)

