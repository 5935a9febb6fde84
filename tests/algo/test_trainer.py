"""The trainer's wiring of the algorithm section: per-token versions in, the recipe's loss,
corrections and version-spread gate applied, the metrics out. A 1-layer model keeps it fast."""

from __future__ import annotations

import math

import pytest
import torch

from factory.recipe import recipe_from_dict
from factory.core.types import NOT_SAMPLED, Batch, Group, Sample, Task

from .conftest import tiny_model_dir

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "tiny",
                          hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_position=64)


def trainer_for(model_path, *overrides):
    from factory.training.trainer import Trainer

    recipe = recipe_from_dict({}, overrides=["rollout.max_new_tokens=4", *overrides])
    return Trainer(model_path, recipe.algorithm, recipe.train, recipe.rollout)


def sample(i, versions, reward, finish="stop", loss_mask=None):
    n = len(versions)
    loss_mask = loss_mask or [1] * n
    versions = [v if m else NOT_SAMPLED for v, m in zip(versions, loss_mask)]
    return Sample(sample_id=f"s{i}", group_id=f"g{i // 2}", task_id="t", prompt_ids=[10 + i, 11, 12],
                  completion_ids=[20 + j + i for j in range(n)], logprobs=[0.0] * n, loss_mask=loss_mask,
                  versions=versions, reward=reward, finish_reason=finish)


def batch_of(trainer, samples, version):
    """Two samples per group; behaviour logprobs = the trainer's own (on-policy, ratio 1)."""
    for s, lps in zip(samples, trainer.logprobs(samples)):
        s.logprobs = [lp if m else 0.0 for lp, m in zip(lps, s.loss_mask)]
    task = Task("t", "f", "q", "a")
    groups = [Group(f"g{k}", task, samples[2 * k: 2 * k + 2]) for k in range(len(samples) // 2)]
    return Batch(version=version, groups=groups)


# V = 3: sample 0 fresh, sample 1 mixes versions 3 and 0 (staleness 0, 0, 3), samples 2 and 3 are one behind;
# sample 3 also has an unsampled (tool) token in the middle and was cut at the length limit
SAMPLES = [([3, 3, 3], 1.0, "stop", None), ([3, 3, 0], 0.0, "stop", None),
           ([2, 2], 1.0, "stop", None), ([2, 2, 2, 2], 0.0, "length", [1, 0, 1, 1])]


def make_samples():
    return [sample(i, v, r, f, m) for i, (v, r, f, m) in enumerate(SAMPLES)]


def test_pad_samples_carries_versions_truncation_and_lengths():
    from factory.model.logprobs import pad_samples

    t = pad_samples(make_samples(), pad_id=0)
    assert torch.equal(t["versions"], torch.tensor([[3, 3, 3, -1], [3, 3, 0, -1], [2, 2, -1, -1], [2, -1, 2, 2]]))
    assert t["truncated"].tolist() == [False, False, False, True]
    assert t["sampled_lens"].tolist() == [3, 3, 2, 3]


def test_train_step_reports_the_token_level_spread(model_path):
    trainer = trainer_for(model_path, "algorithm.max_token_staleness=1")
    trainer.version = 3
    out = trainer.train_step(batch_of(trainer, make_samples(), 3))
    # counted staleness: 0,0,0 | 0,0,3 | 1,1 | 1,1,1 -> 8 / 11 = 0.727273; one stale token of 11
    assert out["staleness/token_mean"] == pytest.approx(8 / 11)
    assert out["staleness/token_max"] == 3.0
    assert out["staleness/version_spread"] == 3.0
    assert out["staleness/sample_spread_max"] == 3.0
    assert out["staleness/mixed_sample_fraction"] == 0.25
    assert out["staleness/stale_token_fraction"] == pytest.approx(1 / 11)
    assert out["staleness/stale_sample_fraction"] == 0.25
    assert out["train/dropped_token_fraction"] == 0.0
    assert out["train/tokens"] == 11.0 and trainer.version == 4


@pytest.mark.parametrize("level, dropped", [("token", 1 / 11), ("sample", 3 / 11)])
def test_train_step_gate_drops_stale_tokens_or_samples(model_path, level, dropped):
    trainer = trainer_for(model_path, "algorithm.max_token_staleness=1", "algorithm.spread_action=drop",
                          f"algorithm.spread_level={level}")
    trainer.version = 3
    out = trainer.train_step(batch_of(trainer, make_samples(), 3))
    assert out["staleness/dropped_token_fraction"] == pytest.approx(dropped)
    assert out["train/tokens"] == pytest.approx(11 * (1 - dropped))


def test_train_step_gate_correct_and_the_whole_batch_dropped(model_path):
    trainer = trainer_for(model_path, "algorithm.max_token_staleness=1", "algorithm.spread_action=correct")
    trainer.version = 3
    out = trainer.train_step(batch_of(trainer, make_samples(), 3))
    assert out["staleness/corrected_token_fraction"] == pytest.approx(1 / 11)
    # every token older than the limit: nothing to learn from, the step is a no-op with loss 0
    trainer = trainer_for(model_path, "algorithm.max_token_staleness=0", "algorithm.spread_action=drop")
    trainer.version = 5
    before = [p.detach().clone() for p in trainer.model.parameters()]
    out = trainer.train_step(batch_of(trainer, make_samples(), 5))
    assert out["train/loss"] == 0.0 and out["train/dropped_token_fraction"] == 1.0
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))


CONFIGS = [
    ["algorithm.loss=ppo_clip"],
    ["algorithm.loss=reinforce"],
    ["algorithm.loss=cispo"],
    ["algorithm.loss=gspo", "algorithm.aggregation=seq_mean_token_mean"],
    ["algorithm.loss=decoupled_ppo", "algorithm.proximal=loglinear"],
    ["algorithm.loss=decoupled_ppo", "algorithm.proximal=current"],
    ["algorithm.advantage=reinforce_pp"],
    ["algorithm.proximal=current", "algorithm.corrections=[{name: tis, level: sequence, cap: 2}]"],
    ["algorithm.proximal=loglinear", "algorithm.corrections=[{name: icepop, low: 0.5, high: 2}, {name: opsm}]"],
    ["algorithm.corrections=[{name: version_reject, max_staleness: 0, level: sequence}, {name: length_mask}]"],
    ["algorithm.kl_coef=0.1", "algorithm.corrections=[{name: length_mask}]"],
]


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: " ".join(x.split("=", 1)[1] for x in o))
def test_every_loss_and_correction_is_selectable_by_name(model_path, overrides):
    trainer = trainer_for(model_path, *overrides)
    trainer.version = 3
    out = trainer.train_step(batch_of(trainer, make_samples(), 3))
    assert math.isfinite(out["train/loss"]) and out["train/version"] == 4.0
    for o in overrides:
        if "corrections" in o:
            for name in ("tis", "icepop", "opsm", "version_reject", "length_mask"):
                if f"name: {name}" in o:
                    assert any(k.startswith(f"train/{name}/") for k in out), name


def test_length_mask_and_version_reject_through_the_trainer(model_path):
    # version_reject (max 0, whole sequences): samples 1, 2, 3 have tokens older than V = 3 -> only sample 0
    trainer = trainer_for(model_path, "algorithm.corrections=[{name: version_reject, max_staleness: 0, "
                                      "level: sequence}, {name: length_mask}]")
    trainer.version = 3
    out = trainer.train_step(batch_of(trainer, make_samples(), 3))
    assert out["train/tokens"] == 3.0
    assert out["train/version_reject/dropped_fraction"] == pytest.approx(8 / 11)
    # length_mask runs after it: sample 3 is already gone, so it drops 1 of 4 samples but no further token
    assert out["train/length_mask/masked_fraction"] == 0.25


def test_overlong_shaping_and_batch_advantages(model_path):
    # max_new_tokens 4, buffer 2: sampled lengths 3, 3, 2, 3 -> penalty (2 - 3) / 2 = -0.5 on three samples
    trainer = trainer_for(model_path, "algorithm.overlong_buffer=2", "algorithm.advantage=dr_grpo")
    batch = batch_of(trainer, make_samples(), 0)
    out = trainer.train_step(batch)
    assert out["rollout/overlong_penalty_mean"] == pytest.approx(-1.5 / 4)
    assert out["rollout/reward_mean"] == 0.5  # the raw reward, before shaping
    # shaped rewards 0.5, -0.5 | 1, -0.5 -> dr_grpo per group: [0.5, -0.5, 0.75, -0.75]
    shaped = trainer.shaped_rewards(batch.samples, torch.tensor([3, 3, 2, 3]))
    torch.testing.assert_close(trainer.advantages(batch, shaped), torch.tensor([0.5, -0.5, 0.75, -0.75]))


def test_overlong_buffer_longer_than_the_limit_is_an_error(model_path):
    with pytest.raises(ValueError, match=r"algorithm.overlong_buffer \(5\) must not exceed rollout.max_new_tokens"):
        trainer_for(model_path, "algorithm.overlong_buffer=5")


def test_warm_up_changes_nothing_a_step_reads(model_path):
    """A warmed trainer's first step is bitwise the unwarmed one's: the warm-up pass leaves no gradient,
    no weight change, zero optimizer moments at step 0 and the RNG stream where it was."""
    warmed, cold = trainer_for(model_path), trainer_for(model_path)
    before = {k: v.clone() for k, v in warmed.model.state_dict().items()}
    rng = torch.random.get_rng_state()
    assert warmed.warm_up() > 0
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(p.grad is None for p in warmed.model.parameters())
    states = list(warmed.optimizer.state.values())  # made already, as a fresh optimizer's first step makes it
    assert states and all(float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in states)
    assert all(torch.equal(before[k], v) for k, v in warmed.model.state_dict().items())
    for step in range(2):  # the second step's update reads the first's moments and step count
        torch.random.set_rng_state(rng)
        after_warm = warmed.train_step(batch_of(warmed, make_samples(), 3))
        torch.random.set_rng_state(rng)
        after_cold = cold.train_step(batch_of(cold, make_samples(), 3))
        assert after_warm["train/loss"] == after_cold["train/loss"]
        assert all(torch.equal(a, b) for a, b in zip(warmed.model.parameters(), cold.model.parameters())), step
