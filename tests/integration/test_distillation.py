"""On-policy distillation through the run loop: a teacher scores every trained token, the loss uses it."""

from __future__ import annotations

import json

import pytest
import torch

from factory.run import run
from factory.types import Batch, Group, Sample, Task

from .conftest import small_recipe
from .test_weight_sync import BF16_MAX_TOL, BF16_MEAN_TOL


def test_teacher_scores_reach_every_trained_sample(engine, policy, tmp_path):
    """With the student's own starting weights as the teacher, the teacher's logprob of each sampled
    token is the behaviour logprob up to bf16 serving noise — the scorer computes the right thing."""
    recipe = small_recipe(f"algorithm.distill.teacher={policy}", "train.steps=1", "eval.before=false",
                          "eval.after=false", "async.max_staleness=0")
    run(recipe, tmp_path, engines=[engine])
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows
    gaps = []
    for r in rows:
        assert len(r["teacher_logprobs"]) == len(r["completion_ids"])
        gaps += [abs(t - b) for t, b, m in zip(r["teacher_logprobs"], r["logprobs"], r["loss_mask"]) if m]
    gaps = torch.tensor(gaps)
    assert gaps.mean() < BF16_MEAN_TOL and gaps.max() < BF16_MAX_TOL, (gaps.mean(), gaps.max())
    from factory.lake.query import sql  # the lake keeps the teacher's logprobs with each trained sample

    lake = sql(f"SELECT sample_id, teacher_logprobs FROM samples WHERE run_id = '{tmp_path.name}' "
               "AND status = 'trained'").to_pylist()
    want = {r["sample_id"]: r["teacher_logprobs"] for r in rows}
    assert sorted(r["sample_id"] for r in lake) == sorted(want)
    for r in lake:  # float32 in the lake
        assert r["teacher_logprobs"] == pytest.approx(want[r["sample_id"]], rel=1e-6, abs=1e-6)
    step = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(step["distill/reverse_kl"]) < BF16_MEAN_TOL and step["perf/score_s"] > 0


@pytest.mark.parametrize("direction", [1.0, -1.0])
def test_the_loss_moves_the_student_toward_the_teacher(policy, direction):
    """Equal rewards leave no task advantage: only the teacher's grades move the policy. Tokens the
    teacher rates above the student's logprob become likelier after one small step (lr 1e-5: Adam's
    first step moves every weight by ~lr, so a large one leaves the first-order regime), and vice versa."""
    from transformers import AutoTokenizer

    from factory.model.tokens import encode_chat
    from factory.trainer import Trainer

    recipe = small_recipe(f"algorithm.distill.teacher={policy}", "algorithm.distill.coef=1.0", "train.lr=1e-5",
                          "algorithm.filter_zero_variance=false")
    trainer = Trainer(str(policy), recipe.algorithm, recipe.train, recipe.rollout)
    tok = AutoTokenizer.from_pretrained(policy)
    prompt = encode_chat(tok, [{"role": "user", "content": "Calculate 40 + 2."}])
    completion = tok("42", add_special_tokens=False).input_ids + [tok.eos_token_id]
    probe = Sample("p", "g", "t", prompt, completion, [0.0] * len(completion), [1] * len(completion),
                   [0] * len(completion))
    before = torch.tensor(trainer.logprobs([probe])[0])
    samples = [Sample(f"s{i}", "g", "t", prompt, completion, before.tolist(), [1] * len(completion),
                      [0] * len(completion), reward=1.0,
                      teacher_logprobs=(before + direction).tolist()) for i in range(4)]
    metrics = trainer.train_step(Batch(0, [Group("g", Task("t", "basic_arithmetic", "q", "42"), samples)]))
    after = torch.tensor(trainer.logprobs([probe])[0])
    assert metrics["train/loss"] != 0.0
    moved = (after - before) * direction
    # first order: every token the student is unsure of moves the teacher's way; a near-certain one
    # (here end-of-turn at p > 0.99, gradient ~ 1 - p) moves only at Adam's second order: within noise
    unsure = before < -0.05
    assert unsure.sum() >= 2 and (moved[unsure] > 0).all(), (before, after)
    assert (moved[~unsure] > -1e-5).all(), (before, after)
