"""The per-step objective: version-spread gate, proximal policy, corrections and loss together."""

import math

import pytest
import torch

from factory.algo import CorrectionConfig, LossConfig, LossContext, ObjectiveConfig, policy_objective

LN = math.log

# V = 4; versions [[4, 2], [3, 1]] -> staleness [[0, 2], [1, 3]]; with max_token_staleness 1 the
# stale tokens are (0, 1) and (1, 1). The policy moved on the stale tokens only:
# pi_theta / pi_b = 1.5 at (0, 1) and 3 at (1, 1), 1 elsewhere. Advantages A = [1, 2].
VERSIONS = torch.tensor([[4, 2], [3, 1]])
BEHAVIOUR = torch.tensor([[-1.0, -2.0], [-1.5, -3.0]])
CURRENT = BEHAVIOUR + torch.tensor([[0.0, LN(1.5)], [0.0, LN(3.0)]])
ADV = torch.tensor([1.0, 2.0])
MASK = torch.ones(2, 2)


def objective(**cfg):
    logp = CURRENT.clone().requires_grad_()
    ctx = LossContext(behaviour_logp=BEHAVIOUR, versions=VERSIONS, trainer_version=4)
    loss, metrics, mask = policy_objective(logp, ADV, MASK, ctx, ObjectiveConfig(**cfg))
    loss.backward()
    return loss.item(), logp.grad, metrics, mask


def test_no_gate_is_plain_ppo_clip_and_reports_the_spread():
    # (0,1) ratio 1.5, A 1 -> clipped -1.28; (1,1) ratio 3, A 2 -> clipped -2.56; others -A
    # token_mean (-1 - 1.28 - 2 - 2.56) / 4 = -1.71; only the fresh tokens have gradient -A / 4
    loss, grad, m, mask = objective()
    assert loss == pytest.approx(-1.71)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, 0.0], [-0.5, 0.0]]))
    # staleness 0, 2, 1, 3: mean 1.5, max 3; batch spread 4 - 1 = 3; each sample spans 2 versions
    assert m["staleness/token_mean"] == 1.5 and m["staleness/token_max"] == 3.0
    assert m["staleness/version_spread"] == 3.0 and m["staleness/sample_spread_max"] == 2.0
    assert m["staleness/mixed_sample_fraction"] == 1.0
    assert m["train/dropped_token_fraction"] == 0.0
    assert m["train/clip_fraction"] == 0.5
    assert torch.equal(mask, MASK)


def test_gate_none_reports_the_stale_share_without_acting():
    loss, _, m, _ = objective(max_token_staleness=1, spread_action="none")
    assert loss == pytest.approx(-1.71)
    assert m["staleness/stale_token_fraction"] == 0.5
    assert m["staleness/stale_sample_fraction"] == 1.0
    assert "staleness/dropped_token_fraction" not in m


def test_gate_drop_token_level():
    # only the fresh tokens remain: (-1 - 2) / 2 = -1.5; gradient -A / 2
    loss, grad, m, mask = objective(max_token_staleness=1, spread_action="drop")
    assert loss == pytest.approx(-1.5)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.0], [-1.0, 0.0]]))
    assert torch.equal(mask, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    assert m["staleness/dropped_token_fraction"] == 0.5
    assert m["train/dropped_token_fraction"] == 0.5


def test_gate_drop_sample_level_drops_everything_here():
    loss, grad, m, mask = objective(max_token_staleness=1, spread_action="drop", spread_level="sample")
    assert loss == 0.0 and torch.equal(grad, torch.zeros(2, 2)) and not mask.any()
    assert m["train/dropped_token_fraction"] == 1.0
    # staleness 2 tolerated: only sample 2 (oldest token 3 behind) goes -> (-1 - 1.28) / 2 = -1.14
    loss, _, m, mask = objective(max_token_staleness=2, spread_action="drop", spread_level="sample")
    assert loss == pytest.approx(-1.14)
    assert torch.equal(mask, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_gate_correct_recentres_and_truncates_the_stale_tokens():
    # stale tokens: ratio 1 (centred on pi_theta), weight min(pi_theta / pi_b, 2) = 1.5 and 2
    # per-token: -1, -1 * 1.5, -2, -2 * 2 -> token_mean (-1 - 1.5 - 2 - 4) / 4 = -2.125
    # gradient -w * A / 4: [[-0.25, -0.375], [-0.5, -1.0]] (the stale tokens now carry signal)
    loss, grad, m, mask = objective(max_token_staleness=1, spread_action="correct", spread_is_cap=2.0)
    assert loss == pytest.approx(-2.125)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.375], [-0.5, -1.0]]))
    assert m["staleness/corrected_token_fraction"] == 0.5
    assert torch.equal(mask, MASK)


def test_gate_without_versions_is_an_error():
    ctx = LossContext(behaviour_logp=BEHAVIOUR)
    with pytest.raises(ValueError, match="versions"):
        policy_objective(CURRENT, ADV, MASK, ctx, ObjectiveConfig(max_token_staleness=1, spread_action="drop"))


def test_current_proximal_with_tis_is_truncated_is_policy_gradient():
    # proximal = pi_theta: ratio 1 everywhere; tis weights min(pi_theta / pi_b, 2) = [[1, 1.5], [1, 2]]
    # per-token -w * A: -1, -1.5, -2, -4 -> -2.125 (same as the gate's correction of the stale tokens)
    loss, grad, m, _ = objective(proximal="current", corrections=[("tis", CorrectionConfig(cap=2.0))])
    assert loss == pytest.approx(-2.125)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.375], [-0.5, -1.0]]))
    assert m["train/tis/truncated_fraction"] == 0.25
    assert m["train/clip_fraction"] == 0.0


def test_decoupled_ppo_with_the_loglinear_proximal():
    # one token sampled at v = 1, V = 3: alpha = (2 - 1) / 2 = 1/2; pi_b = -2, pi_theta = -1
    # pi_prox = -1.5; u = pi_prox / pi_b = e^0.5; r = pi_theta / pi_prox = e^0.5; A = -1
    # -> min(-e^0.5, -1.28) = -e^0.5 -> loss = u * e^0.5 = e; gradient -u * r * A = e
    logp = torch.tensor([[-1.0]], requires_grad=True)
    ctx = LossContext(behaviour_logp=torch.tensor([[-2.0]]), versions=torch.tensor([[1]]), trainer_version=3)
    cfg = ObjectiveConfig(loss="decoupled_ppo", proximal="loglinear", loss_cfg=LossConfig(behaviour_weight_cap=5.0))
    loss, metrics, _ = policy_objective(logp, torch.tensor([-1.0]), torch.ones(1, 1), ctx, cfg)
    loss.backward()
    assert loss.item() == pytest.approx(math.e, rel=1e-5)
    assert logp.grad.item() == pytest.approx(math.e, rel=1e-5)
    assert metrics["train/behaviour_weight_mean"] == pytest.approx(math.exp(0.5), rel=1e-5)


def test_corrections_after_the_gate_see_its_mask():
    # drop the stale tokens, then length-mask sample 2: only token (0, 0) remains -> loss -1
    logp = CURRENT.clone().requires_grad_()
    ctx = LossContext(behaviour_logp=BEHAVIOUR, versions=VERSIONS, trainer_version=4,
                      truncated=torch.tensor([False, True]))
    cfg = ObjectiveConfig(max_token_staleness=1, spread_action="drop",
                          corrections=[("length_mask", CorrectionConfig())])
    loss, m, mask = policy_objective(logp, ADV, MASK, ctx, cfg)
    assert loss.item() == pytest.approx(-1.0)
    assert torch.equal(mask, torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    assert m["train/dropped_token_fraction"] == 0.75
    assert m["train/length_mask/masked_fraction"] == 0.5


@pytest.mark.parametrize("bad, match", [({"loss": "nope"}, "policy loss"), ({"spread_action": "zap"}, "spread action")])
def test_bad_names_are_errors(bad, match):
    ctx = LossContext(behaviour_logp=BEHAVIOUR)
    with pytest.raises(ValueError, match=match):
        policy_objective(CURRENT, ADV, MASK, ctx, ObjectiveConfig(**bad))


def test_configs_take_every_field_from_the_recipe_section_by_name():
    """One source per setting: a recipe value reaches the loss, objective and corrections with no
    hand-kept field list (a field added to both a config and its section flows through)."""
    import dataclasses

    from factory.algo import CorrectionConfig, LossConfig, ObjectiveConfig, from_section
    from factory.recipe import load_recipe
    from factory.paths import REPO_ROOT

    recipe = load_recipe(REPO_ROOT / "recipes" / "default.yaml", [
        "algorithm.clip_high=0.4", "algorithm.aggregation=seq_mean_token_sum", "algorithm.behaviour_weight_cap=3.0",
        "algorithm.proximal=loglinear", "algorithm.max_token_staleness=2",
        "algorithm.corrections=[{name: icepop, low: 0.3, high: 3.0}]"])
    a = recipe.algorithm
    loss = from_section(LossConfig, a, max_tokens=8)
    assert (loss.clip_low, loss.clip_high, loss.aggregation, loss.max_tokens, loss.behaviour_weight_cap) == (
        0.2, 0.4, "seq_mean_token_sum", 8, 3.0)
    (name, c), = [(c.name, from_section(CorrectionConfig, c)) for c in a.corrections]
    assert name == "icepop" and (c.low, c.high) == (0.3, 3.0)
    objective = from_section(ObjectiveConfig, a, loss_cfg=loss, corrections=[(name, c)])
    assert (objective.loss, objective.proximal, objective.max_token_staleness) == ("ppo_clip", "loglinear", 2)
    # every field of each config exists in its recipe section (else it would silently keep its default)
    for config, section, given in ((LossConfig, a, {"max_tokens"}), (ObjectiveConfig, a, {"loss_cfg", "corrections"}),
                                   (CorrectionConfig, a.corrections[0], set())):
        missing = {f.name for f in dataclasses.fields(config)} - given - set(type(section).model_fields)
        assert missing == set(), (config.__name__, missing)
