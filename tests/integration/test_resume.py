"""Exact resume on the real stack: a run resumed from its step-k checkpoint at η = 0 trains the same
samples, in the same order, as the run that went on, and reaches the same weights. (With LoRA and a
KL penalty, whose base and reference must stay the original policy: tests/integration/test_lora.py.)"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import ray
from safetensors.torch import load_file

from factory.lake.query import sql
from factory.run import run
from factory.runtime.warm import TRAINERS

from .conftest import FILTER_ON, actor_pids, small_recipe

# η = 0 with seeded requests: generation for step k+1 starts from the same weights, tasks, group ids and
# seeds in both runs, so it repeats token for token, and so do the rewards and which groups the
# zero-variance filter drops (kept on: the test policy scores 0 on most groups, which teach nothing).
EXACT = ["async.max_staleness=0", "rollout.seed=7", "train.steps=3", "train.checkpoint_every=2",
         "eval.before=false", "eval.after=false", FILTER_ON]
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


def check_resume_repeats(engine, tmp_path, *overrides: str, whole=None) -> tuple:
    """Run `overrides` for 3 steps (or take that run: `whole`), resume a second run from its step-2
    checkpoint, and check that step 3 trained the same samples, in the same order, and reached the same
    weights. Returns both run dirs."""
    recipe = small_recipe(*EXACT, *overrides)
    resumed = tmp_path / f"{tmp_path.name}-resumed"  # run ids: unique
    if whole is None:
        whole = tmp_path / f"{tmp_path.name}-whole"
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

    check_same_weights(whole, resumed)
    return whole, resumed


def check_same_weights(whole, resumed) -> None:
    """The same weights after step 3, up to a small share of the step's own update."""
    before, whole3, resumed3 = weights(whole, 2), weights(whole, 3), weights(resumed, 3)
    for name, w in whole3.items():
        update = (w - before[name]).abs().max()
        gap = (resumed3[name] - w).abs().max()
        assert gap <= WEIGHT_TOLERANCE * update + 1e-7, (name, float(gap), float(update))
    assert max(float((whole3[n] - before[n]).abs().max()) for n in whole3) > 0  # the step did move them


@pytest.fixture(scope="module")
def whole_run(engine, tmp_path_factory):
    """The uninterrupted 3-step run both tests below compare with."""
    whole = tmp_path_factory.mktemp("resume") / "resume-whole"
    run(small_recipe(*EXACT), whole, engines=[engine])
    return whole


def test_a_resumed_run_repeats_the_uninterrupted_one(engine, tmp_path, whole_run):
    check_resume_repeats(engine, tmp_path, whole=whole_run)


def test_a_killed_trainer_is_rebuilt_and_the_run_resumes_inside_the_same_call(engine, tmp_path, whole_run):
    """SIGKILL of the trainer's process after step 3 is recorded, before its checkpoint: `run` rebuilds the
    trainer, rewinds the lake to the step-2 checkpoint and trains step 3 again, as the uninterrupted run did.
    It keeps one checkpoint (`train.keep_checkpoints=1`): the rebuilt trainer resumes from the one there is,
    and step 3's checkpoint replaces it."""
    killed = tmp_path / f"{tmp_path.name}-killed"
    pids: list[int] = []

    def kill_trainer(report):
        if report.step == 3 and not pids:
            pids.extend(actor_pids("TrainerActor"))
            assert len(pids) == 1
            os.kill(pids[0], signal.SIGKILL)

    results = run(small_recipe(*EXACT, "train.keep_checkpoints=1"), killed, engines=[engine], on_step=kill_trainer)

    assert pids and results["trainer_restarts"] == 1
    # the rebuilt trainer's process is kept for the next run (factory/runtime/warm.py); no other outlives the run
    kept = {ray.get(TRAINERS.kept().pid.remote())}
    assert kept != set(pids)
    deadline = time.monotonic() + 60
    while set(actor_pids("TrainerActor")) != kept and time.monotonic() < deadline:
        time.sleep(1)
    assert set(actor_pids("TrainerActor")) == kept
    # step 3 once in the lake (the killed attempt's rows rewound), trained on the uninterrupted run's samples
    steps = sql(f"SELECT step FROM steps WHERE run_id = '{killed.name}' ORDER BY step")["step"].to_pylist()
    assert steps == [1, 2, 3]
    rows = sql(f"SELECT sample_id, completion_ids FROM samples WHERE run_id = '{killed.name}' "
               "AND status = 'trained' AND trained_step = 3").to_pylist()
    assert sorted((r["sample_id"], list(r["completion_ids"])) for r in rows) == sorted(trained(whole_run, 3))
    ids = sql(f"SELECT sample_id FROM samples WHERE run_id = '{killed.name}'")["sample_id"].to_pylist()
    assert len(ids) == len(set(ids))
    check_same_weights(whole_run, killed)
    assert [p.name for p in (killed / "checkpoints").iterdir()] == ["step-000003"]
    # the lake keeps every checkpoint's row, the deleted one's too
    logged = sql(f"SELECT step FROM checkpoints WHERE run_id = '{killed.name}' ORDER BY step")["step"].to_pylist()
    assert logged == [2, 3]

