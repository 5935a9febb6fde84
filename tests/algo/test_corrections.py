"""Off-policy corrections, proximal estimates and staleness helpers against hand-computed values."""

import math

import pytest
import torch

from factory.algo import (
    CORRECTION_PARAMS,
    CORRECTIONS,
    IS_CORRECTIONS,
    CorrectionConfig,
    LossContext,
    apply_corrections,
    loglinear_proximal,
    register_correction,
)
from factory.algo.corrections import proximal_logp, stale_tokens, token_staleness, version_spread_metrics
from factory.core.types import NOT_SAMPLED

LN = math.log

# one sequence of three tokens: pi_prox = -1 everywhere, pi_b chosen so rho = pi_prox / pi_b = [e^0.5, e^-0.5, 3]
PROXIMAL = torch.tensor([[-1.0, -1.0, -1.0]])
BEHAVIOUR = torch.tensor([[-1.5, -0.5, -1.0 - LN(3.0)]])
RHO_CTX = LossContext(behaviour_logp=BEHAVIOUR, proximal_logp=PROXIMAL)
ONES = torch.ones(1, 3)
ADV = torch.tensor([1.0])


def run(name, ctx=RHO_CTX, mask=ONES, adv=ADV, logp=PROXIMAL, **cfg):
    return CORRECTIONS[name](logp, adv, mask, ctx, CorrectionConfig(**cfg))


def test_registry_and_parameters():
    assert {"tis", "icepop", "opsm", "version_reject", "length_mask"} <= set(CORRECTIONS)
    assert CORRECTION_PARAMS["tis"] == ("level", "cap")
    assert IS_CORRECTIONS >= {"tis", "icepop"} and "opsm" not in IS_CORRECTIONS
    with pytest.raises(ValueError, match="registered twice"):
        register_correction("tis")(lambda *a: None)
    with pytest.raises(ValueError, match="unknown parameters"):
        register_correction("x_bad_params", params=("nope",))


# ---------------------------------------------------------------- TIS


def test_tis_token_level():
    # rho = [1.648721, 0.606531, 3], cap 2 -> w = [1.648721, 0.606531, 2]; 1 of 3 truncated
    w, m = run("tis", level="token", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.648721, 0.606531, 2.0]]))
    assert m["truncated_fraction"] == pytest.approx(1 / 3)
    assert m["weight_mean"] == pytest.approx((1.648721 + 0.606531 + 2.0) / 3, abs=1e-5)


def test_tis_sequence_and_geometric_levels():
    # product of rho = e^0.5 * e^-0.5 * 3 = 3 -> min(3, 2) = 2 on every token
    w, _ = run("tis", level="sequence", cap=2.0)
    torch.testing.assert_close(w, torch.full((1, 3), 2.0))
    # geometric mean 3^(1/3) = 1.442250 < 2 -> kept as is
    w, m = run("tis", level="geometric", cap=2.0)
    torch.testing.assert_close(w, torch.full((1, 3), 3 ** (1 / 3)))
    assert m["truncated_fraction"] == 0.0


def test_tis_sequence_product_cannot_overflow():
    ctx = LossContext(behaviour_logp=torch.full((1, 400), -5.0), proximal_logp=torch.full((1, 400), -1.0))
    w, _ = CORRECTIONS["tis"](torch.zeros(1, 400), ADV, torch.ones(1, 400), ctx, CorrectionConfig(level="sequence"))
    assert torch.equal(w, torch.full((1, 400), 2.0))


def test_tis_is_one_when_the_proximal_is_the_behaviour():
    w, _ = run("tis", ctx=LossContext(behaviour_logp=BEHAVIOUR), logp=BEHAVIOUR)
    assert torch.equal(w, ONES)


# ---------------------------------------------------------------- IcePop


def test_icepop_token_and_sequence_levels():
    # rho [1.65, 0.61, 3] against [0.5, 2]: the third token is masked
    w, m = run("icepop", level="token", low=0.5, high=2.0)
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 0.0]]))
    assert m["masked_fraction"] == pytest.approx(1 / 3)
    # sequence ratio 3 > 2: the whole sequence goes; geometric 1.44 stays
    w, _ = run("icepop", level="sequence", low=0.5, high=2.0)
    assert torch.equal(w, torch.zeros(1, 3))
    w, _ = run("icepop", level="geometric", low=0.5, high=2.0)
    assert torch.equal(w, ONES)
    # a tighter low bound also drops the 0.61 token
    w, _ = run("icepop", level="token", low=0.7, high=5.0)
    assert torch.equal(w, torch.tensor([[1.0, 0.0, 1.0]]))


# ---------------------------------------------------------------- OPSM


def test_opsm_drops_only_negative_samples_that_drifted():
    # both samples: KL = mean(log pi_b - log pi_theta) = (0.2 + 0.4) / 2 = 0.3; A = [1, -1]
    behaviour = torch.full((2, 2), -1.0)
    logp = torch.tensor([[-1.2, -1.4], [-1.2, -1.4]])
    ctx = LossContext(behaviour_logp=behaviour)
    w, m = run("opsm", ctx=ctx, mask=torch.ones(2, 2), adv=torch.tensor([1.0, -1.0]), logp=logp, delta=0.1)
    assert torch.equal(w, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert m["masked_fraction"] == 0.5
    assert m["kl_mean"] == pytest.approx(0.3)
    w, m = run("opsm", ctx=ctx, mask=torch.ones(2, 2), adv=torch.tensor([1.0, -1.0]), logp=logp, delta=0.5)
    assert torch.equal(w, torch.ones(2, 2))
    # per-token advantages: the sample's mean advantage decides (-0.5 here)
    adv = torch.tensor([[1.0, 1.0], [-2.0, 1.0]])
    w, _ = run("opsm", ctx=ctx, mask=torch.ones(2, 2), adv=adv, logp=logp, delta=0.1)
    assert torch.equal(w, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


# ---------------------------------------------------------------- version rejection and length masking

VERSIONS = torch.tensor([[5, 5, 3], [4, 4, NOT_SAMPLED]])
VMASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_staleness_and_stale_masks():
    # V = 5: staleness [[0, 0, 2], [1, 1, -]]
    assert torch.equal(token_staleness(VERSIONS, VMASK, 5), torch.tensor([[0, 0, 2], [1, 1, 0]]))
    assert torch.equal(stale_tokens(VERSIONS, VMASK, 5, 1, "token"),
                       torch.tensor([[False, False, True], [False, False, False]]))
    assert torch.equal(stale_tokens(VERSIONS, VMASK, 5, 1, "sample"),
                       torch.tensor([[True, True, True], [False, False, False]]))
    assert not stale_tokens(VERSIONS, VMASK, 5, 2, "token").any()
    with pytest.raises(ValueError, match="level"):
        stale_tokens(VERSIONS, VMASK, 5, 1, "batch")


def test_version_reject_token_and_sequence_levels():
    ctx = LossContext(versions=VERSIONS, trainer_version=5)
    logp = torch.zeros(2, 3)
    w, m = run("version_reject", ctx=ctx, mask=VMASK, adv=torch.ones(2), logp=logp, max_staleness=1, level="token")
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
    assert m["dropped_fraction"] == pytest.approx(1 / 5)
    w, m = run("version_reject", ctx=ctx, mask=VMASK, adv=torch.ones(2), logp=logp, max_staleness=1, level="sequence")
    assert torch.equal(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    assert m["dropped_fraction"] == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="versions"):
        run("version_reject", ctx=LossContext(), mask=VMASK, adv=torch.ones(2), logp=logp)


def test_length_mask_drops_truncated_samples():
    ctx = LossContext(truncated=torch.tensor([True, False]))
    w, m = run("length_mask", ctx=ctx, mask=torch.ones(2, 3), adv=torch.ones(2), logp=torch.zeros(2, 3))
    assert torch.equal(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    assert m["masked_fraction"] == 0.5
    with pytest.raises(ValueError, match="truncat"):
        run("length_mask", ctx=LossContext(), mask=torch.ones(2, 3), adv=torch.ones(2), logp=torch.zeros(2, 3))


def test_version_spread_metrics():
    # counted staleness 0, 0, 2, 1, 1 -> mean 0.8, max 2; batch spread 5 - 3 = 2;
    # per-sample spreads 2 and 0 -> max 2, one of two samples mixes versions
    m = version_spread_metrics(VERSIONS, VMASK, 5)
    assert m == pytest.approx({"token_mean": 0.8, "token_max": 2.0, "version_spread": 2.0,
                               "sample_spread_max": 2.0, "mixed_sample_fraction": 0.5})
    empty = version_spread_metrics(VERSIONS, torch.zeros(2, 3), 5)
    assert set(empty.values()) == {0.0}


# ---------------------------------------------------------------- proximal policy


def test_loglinear_proximal_hand_values():
    # V = 3, versions 3, 2, 1, 0 -> alpha = 0, 0, 1/2, 2/3; pi_b = -1, pi_theta = -0.5
    # -> -1, -1, -1 + 0.5 * 0.5 = -0.75, -1 + (2/3) * 0.5 = -0.666667; NOT_SAMPLED keeps pi_b
    behaviour = torch.full((1, 5), -1.0)
    logp = torch.full((1, 5), -0.5, requires_grad=True)
    versions = torch.tensor([[3, 2, 1, 0, NOT_SAMPLED]])
    prox = loglinear_proximal(behaviour, logp, versions, 3)
    torch.testing.assert_close(prox, torch.tensor([[-1.0, -1.0, -0.75, -2 / 3, -1.0]]))
    assert not prox.requires_grad


def test_proximal_logp_modes_and_exact_override():
    behaviour = torch.tensor([[-2.0, -1.0]])
    logp = torch.tensor([[-1.0, -1.5]], requires_grad=True)
    ctx = LossContext(behaviour_logp=behaviour, versions=torch.tensor([[0, 2]]), trainer_version=2)
    assert torch.equal(proximal_logp("behaviour", logp, ctx), behaviour)
    assert torch.equal(proximal_logp("current", logp, ctx), logp.detach())
    # token 1: V - v = 2 -> alpha 1/2 -> -2 + 0.5 * 1 = -1.5; token 2 is fresh -> pi_b
    torch.testing.assert_close(proximal_logp("loglinear", logp, ctx), torch.tensor([[-1.5, -1.0]]))
    exact = torch.tensor([[-1.7, -1.2]])
    ctx_exact = LossContext(behaviour_logp=behaviour, proximal_logp=exact)
    for mode in ("behaviour", "current", "loglinear"):
        assert torch.equal(proximal_logp(mode, logp, ctx_exact), exact)
    with pytest.raises(ValueError, match="versions"):
        proximal_logp("loglinear", logp, LossContext(behaviour_logp=behaviour))
    with pytest.raises(ValueError, match="proximal mode"):
        proximal_logp("recompute", logp, ctx)


# ---------------------------------------------------------------- combining


def test_apply_corrections_multiplies_weights_and_drops_zeros():
    # tis [1.65, 0.61, 2] times icepop [1, 1, 0] -> [1.65, 0.61, 0]; the third token leaves the mask
    corrections = [("tis", CorrectionConfig(cap=2.0)), ("icepop", CorrectionConfig(low=0.5, high=2.0)),
                   ("tis", CorrectionConfig(cap=1.0))]
    mask, weights, metrics = apply_corrections(corrections, PROXIMAL, ADV, ONES, RHO_CTX)
    # the second tis (cap 1) gives [1, 0.61, 1] -> product [1.648721, 0.367879, 0]
    torch.testing.assert_close(weights, torch.tensor([[1.648721, 0.606531 ** 2, 0.0]]))
    assert torch.equal(mask, torch.tensor([[1.0, 1.0, 0.0]]))
    assert set(metrics) == {"tis/weight_mean", "tis/truncated_fraction", "icepop/masked_fraction",
                            "tis#2/weight_mean", "tis#2/truncated_fraction"}
    assert metrics["icepop/masked_fraction"] == pytest.approx(1 / 3)
    # the second tis sees the mask left by icepop: 2 counted tokens, one (1.65) truncated
    assert metrics["tis#2/truncated_fraction"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="unknown correction"):
        apply_corrections([("nope", CorrectionConfig())], PROXIMAL, ADV, ONES, RHO_CTX)


def test_no_corrections_leave_everything_as_is():
    mask, weights, metrics = apply_corrections([], PROXIMAL, ADV, ONES, RHO_CTX)
    assert torch.equal(mask, ONES) and torch.equal(weights, ONES) and metrics == {}
