"""CISPO, GSPO, decoupled PPO and correction weights inside the losses, against hand-computed values."""

import math

import pytest
import torch

from factory.algo import POLICY_LOSSES, LossConfig, LossContext

LN = math.log


def test_registry_holds_the_new_losses():
    assert {"cispo", "gspo", "decoupled_ppo"} <= set(POLICY_LOSSES)


# ---------------------------------------------------------------- weights from corrections


def test_ppo_clip_multiplies_the_correction_weights_before_aggregating():
    # on-policy (ratio 1), A = 1: per-token -1, weighted by [2, 0.5] -> [-2, -0.5], token_mean -1.25
    # gradient -w * ratio * A / 2 = [-1, -0.25]
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ctx = LossContext(weights=torch.tensor([[2.0, 0.5]]))
    loss, _ = POLICY_LOSSES["ppo_clip"](logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2), LossConfig(), ctx)
    loss.backward()
    assert loss.item() == pytest.approx(-1.25)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.25]]))


def test_reinforce_multiplies_the_correction_weights():
    # -w * A * logp: -3 * 1 * -1 = 3 and -1 * 1 * -2 = 2 -> token_mean 2.5
    logp = torch.tensor([[-1.0, -2.0]])
    ctx = LossContext(weights=torch.tensor([[3.0, 1.0]]))
    loss, _ = POLICY_LOSSES["reinforce"](logp, logp, torch.tensor([1.0]), torch.ones(1, 2), LossConfig(), ctx)
    assert loss.item() == pytest.approx(2.5)


# ---------------------------------------------------------------- CISPO


def test_cispo_hand_values_keep_gradient_on_clipped_tokens():
    # ratios 1.5 and 0.5, A = 2, bounds [0.8, 1.28] -> c = [1.28, 0.8]
    # logp = -1 + ln 1.5 = -0.594535 and -1 + ln 0.5 = -1.693147
    # per-token -c * A * logp = 1.522010 and 2.709035 -> token_mean 2.115522; gradient -c * A / 2 = [-1.28, -0.8]
    old_logp = torch.tensor([[-1.0, -1.0]])
    logp = (old_logp + torch.tensor([[LN(1.5), LN(0.5)]])).requires_grad_()
    loss, metrics = POLICY_LOSSES["cispo"](logp, old_logp, torch.tensor([2.0]), torch.ones(1, 2), LossConfig())
    loss.backward()
    assert loss.item() == pytest.approx(2.115522, abs=1e-5)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.28, -0.8]]))
    assert metrics["clip_fraction"] == 1.0
    assert metrics["is_weight_mean"] == pytest.approx(1.04)
    assert metrics["ratio_max"] == pytest.approx(1.5)


def test_cispo_inside_the_bounds_has_the_ratio_as_weight():
    # ratio 1.1 inside [0.8, 1.28]: gradient -1.1 * A = -1.1 (same as ppo_clip at the same point)
    old_logp = torch.tensor([[-1.0]])
    grads = []
    for name in ("cispo", "ppo_clip"):
        logp = (old_logp + LN(1.1)).requires_grad_()
        loss, _ = POLICY_LOSSES[name](logp, old_logp, torch.tensor([1.0]), torch.ones(1, 1), LossConfig())
        loss.backward()
        grads.append(logp.grad.item())
    assert grads == pytest.approx([-1.1, -1.1])


# ---------------------------------------------------------------- GSPO


def gspo_case():
    # seq 1: token log-ratios 0.1, -0.3 -> s = exp(-0.1) = 0.904837 inside [0.8, 1.28]
    # seq 2: one counted token, log-ratio 0.5 -> s = 1.648721 clipped at 1.28 (A = 1)
    old_logp = torch.tensor([[-1.0, -2.0], [-1.5, -9.0]])
    logp = (old_logp + torch.tensor([[0.1, -0.3], [0.5, 7.0]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return logp, old_logp, mask


def test_gspo_hand_values_sequence_mean():
    # seq_mean_token_mean: (-0.904837 - 1.28) / 2 = -1.092419
    # gradient on seq 1 tokens: (1/2 seqs) * (1/2 tokens) * -s = -0.226209; seq 2 clipped -> 0
    logp, old_logp, mask = gspo_case()
    cfg = LossConfig(aggregation="seq_mean_token_mean")
    loss, metrics = POLICY_LOSSES["gspo"](logp, old_logp, torch.tensor([1.0, 1.0]), mask, cfg)
    loss.backward()
    assert loss.item() == pytest.approx(-1.092419, abs=1e-5)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.226209, -0.226209], [0.0, 0.0]]))
    assert metrics["clip_fraction"] == 0.5
    assert metrics["seq_ratio_mean"] == pytest.approx((0.904837 + 1.648721) / 2, abs=1e-5)
    assert metrics["seq_ratio_max"] == pytest.approx(1.648721, abs=1e-5)


def test_gspo_token_mean_weighs_by_length():
    # token_mean: (2 * -0.904837 - 1.28) / 3 = -1.029891
    logp, old_logp, mask = gspo_case()
    loss, _ = POLICY_LOSSES["gspo"](logp, old_logp, torch.tensor([1.0, 1.0]), mask, LossConfig())
    assert loss.item() == pytest.approx(-1.029891, abs=1e-5)


def test_gspo_gradient_equals_the_sequence_level_objective():
    # J = -mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log-ratio), differentiated directly
    logp, old_logp, mask = gspo_case()
    adv = torch.tensor([0.7, -1.2])
    cfg = LossConfig(aggregation="seq_mean_token_mean")
    loss, _ = POLICY_LOSSES["gspo"](logp, old_logp, adv, mask, cfg)
    loss.backward()
    direct_logp = logp.detach().clone().requires_grad_()
    log_ratio = torch.where(mask > 0, direct_logp - old_logp, torch.zeros_like(old_logp))
    s = torch.exp(log_ratio.sum(1) / mask.sum(1))
    direct = -torch.minimum(s * adv, s.clamp(0.8, 1.28) * adv).mean()
    direct.backward()
    assert loss.item() == pytest.approx(direct.item(), abs=1e-6)
    torch.testing.assert_close(logp.grad, direct_logp.grad)


# ---------------------------------------------------------------- decoupled PPO


def test_decoupled_ppo_hand_values():
    # token 1: pi_b -2, pi_prox -1.5 -> u = e^0.5 = 1.648721; r = 1.1, A = 1 -> -u * 1.1 = -1.813593
    # token 2: pi_b -3, pi_prox -1 -> u = e^2 = 7.39 > cap 5 -> dropped (not in the normaliser)
    # token 3: pi_b = pi_prox = -1 -> u = 1; r = 1.5 clipped at 1.28 -> -1.28, no gradient
    # token_mean over 2 kept tokens: (-1.813593 - 1.28) / 2 = -1.546797; grad token 1: -u * r / 2 = -0.906797
    behaviour = torch.tensor([[-2.0, -3.0, -1.0]])
    proximal = torch.tensor([[-1.5, -1.0, -1.0]])
    logp = (proximal + torch.tensor([[LN(1.1), 0.0, LN(1.5)]])).requires_grad_()
    ctx = LossContext(behaviour_logp=behaviour)
    loss, metrics = POLICY_LOSSES["decoupled_ppo"](logp, proximal, torch.tensor([1.0]), torch.ones(1, 3),
                                                   LossConfig(behaviour_weight_cap=5.0), ctx)
    loss.backward()
    assert loss.item() == pytest.approx(-1.546797, abs=1e-5)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.906797, 0.0, 0.0]]))
    assert metrics["behaviour_dropped_fraction"] == pytest.approx(1 / 3)
    assert metrics["behaviour_weight_mean"] == pytest.approx((1.648721 + 1.0) / 2, abs=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(0.5)


def test_decoupled_ppo_without_behaviour_is_ppo_clip():
    old_logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    logp = old_logp + torch.tensor([[0.2, -0.1], [0.4, 0.0]])
    adv = torch.tensor([1.0, -0.5])
    a, _ = POLICY_LOSSES["decoupled_ppo"](logp, old_logp, adv, torch.ones(2, 2), LossConfig())
    b, _ = POLICY_LOSSES["ppo_clip"](logp, old_logp, adv, torch.ones(2, 2), LossConfig())
    assert a.item() == pytest.approx(b.item())


# ---------------------------------------------------------------- masking holds for every new loss


@pytest.mark.parametrize("name", ["cispo", "gspo", "decoupled_ppo"])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_masked_tokens_have_no_influence(name, mode):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    base_logp = torch.tensor([[-1.0, -0.5, -0.7], [-2.0, -0.3, -0.2]])
    old_logp = torch.tensor([[-1.2, -0.4, -0.9], [-1.8, -0.6, -0.1]])
    behaviour = torch.tensor([[-1.3, -0.5, -0.9], [-1.7, -0.6, -0.1]])
    advantages = torch.tensor([[1.0, 1.0, 3.0], [-0.5, 2.0, 2.0]])
    junk_logp, junk_old = base_logp.clone(), old_logp.clone()
    junk_behaviour, junk_adv = behaviour.clone(), advantages.clone()
    junk_logp[0, 2], junk_logp[1, 1] = float("-inf"), 50.0
    junk_old[1, 2] = float("-inf")
    junk_behaviour[1, 1] = float("nan")
    junk_adv[0, 2], junk_adv[1, 1] = float("nan"), 1e6
    weights = torch.tensor([[1.5, 0.5, float("nan")], [2.0, float("inf"), 0.0]])
    results = []
    for values, old, behav, adv in ((base_logp, old_logp, behaviour, advantages),
                                    (junk_logp, junk_old, junk_behaviour, junk_adv)):
        logp = values.clone().requires_grad_()
        ctx = LossContext(behaviour_logp=behav, weights=weights)
        loss, metrics = POLICY_LOSSES[name](logp, old, adv, mask, LossConfig(aggregation=mode), ctx)
        loss.backward()
        results.append((loss.item(), logp.grad.clone(), metrics))
    (clean_loss, clean_grad, clean_metrics), (junk_loss, junk_grad, junk_metrics) = results
    assert math.isfinite(clean_loss)
    assert junk_loss == pytest.approx(clean_loss)
    torch.testing.assert_close(junk_grad, clean_grad)
    assert torch.equal(junk_grad * (1 - mask), torch.zeros_like(mask))
    assert junk_metrics == pytest.approx(clean_metrics)
