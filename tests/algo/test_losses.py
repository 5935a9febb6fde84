"""Aggregation modes and policy losses against hand-computed values."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.algo import POLICY_LOSSES, LossConfig, aggregate, register_policy_loss

ppo_clip = POLICY_LOSSES["ppo_clip"]
reinforce = POLICY_LOSSES["reinforce"]


def one_token(ratio, advantage, **cfg):
    """Run ppo_clip on a single counted token with the given ratio; return loss, metrics, dloss/dlogp."""
    old_logp = torch.tensor([[-1.0]])
    logp = (old_logp + math.log(ratio)).requires_grad_()
    loss, metrics = ppo_clip(logp, old_logp, torch.tensor([advantage]), torch.ones(1, 1), LossConfig(**cfg))
    loss.backward()
    return loss.item(), metrics, logp.grad.item()


# ---------------------------------------------------------------- aggregation

# two sequences of unequal length (3 and 1 counted tokens); padding holds 100 to show it is ignored
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 100.0], [6.0, 100.0, 100.0, 100.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_token_mean():
    # (1 + 2 + 3 + 6) / 4 tokens = 3
    assert aggregate(PER_TOKEN, MASK, "token_mean").item() == pytest.approx(3.0)


def test_seq_mean_token_mean():
    # sequence means 6/3 = 2 and 6/1 = 6 -> (2 + 6) / 2 = 4
    assert aggregate(PER_TOKEN, MASK, "seq_mean_token_mean").item() == pytest.approx(4.0)


def test_seq_mean_token_sum_defaults_to_padded_length():
    # sums 6 and 6, each / T = 4 -> 1.5 and 1.5 -> mean 1.5
    assert aggregate(PER_TOKEN, MASK, "seq_mean_token_sum").item() == pytest.approx(1.5)


def test_seq_mean_token_sum_uses_max_tokens():
    # sums 6 and 6, each / 3 -> 2 and 2 -> mean 2
    assert aggregate(PER_TOKEN, MASK, "seq_mean_token_sum", max_tokens=3).item() == pytest.approx(2.0)


def test_three_modes_differ_on_unequal_lengths():
    # seq 1 counts [1,2,3] (sum 6), seq 2 counts [4]; padding 9 is ignored
    # token_mean (6+4)/4 = 2.5; seq_mean_token_mean (2+4)/2 = 3; seq_mean_token_sum (6/4 + 4/4)/2 = 1.25
    per_token = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    expected = {"token_mean": 2.5, "seq_mean_token_mean": 3.0, "seq_mean_token_sum": 1.25}
    results = {mode: aggregate(per_token, MASK, mode).item() for mode in expected}
    assert results == pytest.approx(expected)


def test_empty_sequence_is_not_counted_by_seq_mean_token_mean():
    # seq 2 has no counted token: seq_mean_token_mean = mean over seq 1 only = (1+2)/2 = 1.5
    # token_mean = 3 / 2 = 1.5; seq_mean_token_sum counts it as 0: (3/2 + 0) / 2 = 0.75
    per_token = torch.tensor([[1.0, 2.0], [5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert aggregate(per_token, mask, "seq_mean_token_mean").item() == pytest.approx(1.5)
    assert aggregate(per_token, mask, "token_mean").item() == pytest.approx(1.5)
    assert aggregate(per_token, mask, "seq_mean_token_sum").item() == pytest.approx(0.75)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_nothing_counted_gives_zero_and_a_usable_graph(mode):
    per_token = torch.full((2, 3), float("nan"), requires_grad=True)
    result = aggregate(per_token, torch.zeros(2, 3), mode)
    result.backward()
    assert result.item() == 0.0
    assert torch.equal(per_token.grad, torch.zeros(2, 3))


def test_unknown_mode_names_the_valid_ones():
    with pytest.raises(ValueError, match="seq_mean_token_mean.*seq_mean_token_sum.*token_mean"):
        aggregate(PER_TOKEN, MASK, "sum")


# ---------------------------------------------------------------- ppo_clip


def test_registry_holds_the_losses():
    assert {"ppo_clip", "reinforce"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match="ppo_clip"):
        register_policy_loss("ppo_clip")(ppo_clip)


def test_unclipped_token_is_minus_ratio_times_advantage():
    # ratio 1.1, A = 2 inside [0.8, 1.28]: loss = -1.1 * 2 = -2.2; dloss/dlogp = -ratio * A = -2.2
    loss, metrics, grad = one_token(1.1, 2.0)
    assert loss == pytest.approx(-2.2)
    assert grad == pytest.approx(-2.2)
    assert metrics["clip_fraction"] == 0.0


def test_clip_higher_leaves_ratio_1_25_unclipped():
    # clip_high 0.28: 1.25 < 1.28, loss = -1.25 * 1, gradient -1.25
    loss, metrics, grad = one_token(1.25, 1.0, clip_high=0.28)
    assert loss == pytest.approx(-1.25)
    assert grad == pytest.approx(-1.25)
    assert metrics["clip_fraction"] == 0.0


def test_symmetric_clip_clips_ratio_1_25():
    # clip_high 0.2: min(1.25, 1.2) * 1 = 1.2 -> loss -1.2, clipped term active -> gradient 0
    loss, metrics, grad = one_token(1.25, 1.0, clip_high=0.2)
    assert loss == pytest.approx(-1.2)
    assert grad == 0.0
    assert metrics["clip_fraction"] == 1.0


def test_clip_low_clips_ratio_0_75_with_negative_advantage():
    # A = -1: min(0.75 * -1, 0.8 * -1) = -0.8 -> loss 0.8, clipped -> gradient 0
    loss, metrics, grad = one_token(0.75, -1.0, clip_low=0.2)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert metrics["clip_fraction"] == 1.0


def test_wider_clip_low_leaves_ratio_0_75_unclipped():
    # clip_low 0.3: bound 0.7 < 0.75 -> loss = -(0.75 * -1) = 0.75, gradient -A * ratio = 0.75
    loss, metrics, grad = one_token(0.75, -1.0, clip_low=0.3)
    assert loss == pytest.approx(0.75)
    assert grad == pytest.approx(0.75)
    assert metrics["clip_fraction"] == 0.0


def test_ratio_outside_bounds_is_not_clipped_when_clipping_would_not_bind():
    # ratio 0.75, A = +1: min(0.75, 0.8) = 0.75 is the unclipped term -> loss -0.75, gradient -0.75
    loss, metrics, grad = one_token(0.75, 1.0)
    assert loss == pytest.approx(-0.75)
    assert grad == pytest.approx(-0.75)
    assert metrics["clip_fraction"] == 0.0


def test_batch_values_gradients_and_metrics():
    # tokens (ratio, A): (1.25, 1) kept, (1.5, 1) clipped at 1.28, (0.75, -1) clipped at 0.8, (1.0, -1) kept
    # per-token losses: -1.25, -1.28, 0.8, 1.0 -> token_mean = -0.73 / 4 = -0.1825
    # dloss/dlogp = -ratio * A / 4 for unclipped tokens: -0.3125, 0, 0, 0.25
    ratios = torch.tensor([[1.25, 1.5], [0.75, 1.0]])
    old_logp = torch.full((2, 2), -2.0)
    logp = (old_logp + ratios.log()).requires_grad_()
    loss, metrics = ppo_clip(logp, old_logp, torch.tensor([1.0, -1.0]), torch.ones(2, 2), LossConfig())
    loss.backward()
    assert loss.item() == pytest.approx(-0.1825, abs=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.3125, 0.0], [0.0, 0.25]]))
    # clip_fraction 2/4; ratio_mean (1.25+1.5+0.75+1)/4 = 1.125; ratio_max 1.5
    # approx_kl = mean(r - 1 - ln r) = (0.026856 + 0.094535 + 0.037682 + 0) / 4 = 0.039768
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx(1.125)
    assert metrics["ratio_max"] == pytest.approx(1.5)
    expected_kl = sum(r - 1 - math.log(r) for r in (1.25, 1.5, 0.75, 1.0)) / 4
    assert metrics["approx_kl"] == pytest.approx(expected_kl, rel=1e-5)
    assert all(isinstance(value, float) for value in metrics.values())


def test_aggregation_mode_is_applied():
    # ratio 1 everywhere, per-token loss = -A: seq 1 A=1 over 3 tokens, seq 2 A=4 over 1 token
    # token_mean -(3 + 4)/4 = -1.75; seq_mean_token_mean -(1 + 4)/2 = -2.5;
    # seq_mean_token_sum with max_tokens 4: -(3/4 + 4/4)/2 = -0.875
    logp = torch.full((2, 4), -1.0)
    advantages = torch.tensor([1.0, 4.0])
    expected = {"token_mean": -1.75, "seq_mean_token_mean": -2.5, "seq_mean_token_sum": -0.875}
    for mode, value in expected.items():
        loss, _ = ppo_clip(logp, logp, advantages, MASK, LossConfig(aggregation=mode, max_tokens=4))
        assert loss.item() == pytest.approx(value), mode


def test_per_sequence_and_per_token_advantages_agree():
    logp = torch.tensor([[-1.0, -0.5], [-2.0, -0.1]])
    old_logp = torch.tensor([[-1.1, -0.4], [-1.9, -0.3]])
    per_sequence, _ = ppo_clip(logp, old_logp, torch.tensor([0.5, -2.0]), torch.ones(2, 2), LossConfig())
    per_token, _ = ppo_clip(
        logp, old_logp, torch.tensor([[0.5, 0.5], [-2.0, -2.0]]), torch.ones(2, 2), LossConfig()
    )
    assert per_sequence.item() == pytest.approx(per_token.item())


def test_bad_advantage_shape_is_an_error():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip(logp, logp, torch.zeros(3), torch.ones(2, 3), LossConfig())


@pytest.mark.parametrize("name", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_masked_tokens_have_no_influence(name, mode):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    base_logp = torch.tensor([[-1.0, -0.5, -0.7], [-2.0, -0.3, -0.2]])
    old_logp = torch.tensor([[-1.2, -0.4, -0.9], [-1.8, -0.6, -0.1]])
    advantages = torch.tensor([[1.0, 1.0, 3.0], [-0.5, 2.0, 2.0]])
    # garbage at the masked positions: -inf logprobs, huge and NaN advantages
    junk_logp = base_logp.clone()
    junk_logp[0, 2], junk_logp[1, 1] = float("-inf"), 50.0
    junk_old = old_logp.clone()
    junk_old[1, 2] = float("-inf")
    junk_adv = advantages.clone()
    junk_adv[0, 2], junk_adv[1, 1] = float("nan"), 1e6

    results = []
    for logp_values, old, adv in ((base_logp, old_logp, advantages), (junk_logp, junk_old, junk_adv)):
        logp = logp_values.clone().requires_grad_()
        loss, metrics = POLICY_LOSSES[name](logp, old, adv, mask, LossConfig(aggregation=mode))
        loss.backward()
        results.append((loss.item(), logp.grad.clone(), metrics))
    (clean_loss, clean_grad, clean_metrics), (junk_loss, junk_grad, junk_metrics) = results
    assert junk_loss == pytest.approx(clean_loss)
    torch.testing.assert_close(junk_grad, clean_grad)
    assert torch.equal(junk_grad * (1 - mask), torch.zeros_like(mask))
    assert junk_metrics == pytest.approx(clean_metrics)


# ---------------------------------------------------------------- reinforce


def test_reinforce_hand_values():
    # per-token -A * logp: seq 1 A=2: -2*-1 = 2, -2*-2 = 4; seq 2 A=-1: 1*-0.5 = -0.5 (token 2 masked)
    # token_mean (2 + 4 - 0.5)/3 = 1.833333; gradient -A/3: [[-2/3, -2/3], [1/3, 0]]
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, metrics = reinforce(logp, logp.detach(), torch.tensor([2.0, -1.0]), mask, LossConfig())
    loss.backward()
    assert loss.item() == pytest.approx(5.5 / 3)
    torch.testing.assert_close(logp.grad, torch.tensor([[-2 / 3, -2 / 3], [1 / 3, 0.0]]))
    assert metrics["approx_kl"] == 0.0


def test_reinforce_and_ppo_clip_share_the_on_policy_gradient():
    # at ratio 1 d(-ratio*A)/dlogp = -A = d(-A*logp)/dlogp, so the two gradients coincide
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = torch.tensor([0.7, -1.3])
    grads = []
    for loss_fn in (ppo_clip, reinforce):
        logp = torch.tensor([[-1.0, -0.5, -0.7], [-2.0, -0.3, -0.2]], requires_grad=True)
        loss, _ = loss_fn(logp, logp.detach(), advantages, mask, LossConfig())
        loss.backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[0], grads[1])


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-0.5, 0.5), min_size=6, max_size=6),
    st.lists(st.floats(-3, 3), min_size=2, max_size=2),
)
def test_ppo_clip_never_exceeds_unclipped_objective(log_ratios, advantages):
    # the clipped objective is a pessimistic bound: -loss_t <= ratio_t * A_t on every token
    old_logp = torch.full((2, 3), -1.0)
    logp = old_logp + torch.tensor(log_ratios).view(2, 3)
    adv = torch.tensor(advantages)
    loss, metrics = ppo_clip(logp, old_logp, adv, torch.ones(2, 3), LossConfig())
    unclipped = aggregate(-(logp - old_logp).exp() * adv[:, None], torch.ones(2, 3), "token_mean")
    assert loss.item() >= unclipped.item() - 1e-6
    assert 0.0 <= metrics["clip_fraction"] <= 1.0
    assert metrics["approx_kl"] >= 0.0
