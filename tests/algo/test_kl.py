"""KL estimators against hand-computed values."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.algo import kl_penalty

# two tokens: (logp, ref_logp) = (-1, -2) and (-2, -1); x = ref_logp - logp = -1 and +1
LOGP = torch.tensor([[-1.0, -2.0]])
REF_LOGP = torch.tensor([[-2.0, -1.0]])


def test_k1_is_the_log_ratio():
    # logp - ref_logp = [1, -1]
    torch.testing.assert_close(kl_penalty(LOGP, REF_LOGP, "k1"), torch.tensor([[1.0, -1.0]]))


def test_k2_is_half_the_squared_log_ratio():
    # 0.5 * 1^2 = 0.5 for both
    torch.testing.assert_close(kl_penalty(LOGP, REF_LOGP, "k2"), torch.tensor([[0.5, 0.5]]))


def test_k3_hand_values():
    # x = -1: e^-1 + 1 - 1 = 0.367879; x = 1: e - 1 - 1 = 0.718282
    expected = torch.tensor([[math.exp(-1.0), math.e - 2.0]])
    torch.testing.assert_close(kl_penalty(LOGP, REF_LOGP, "k3"), expected)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_zero_when_policies_agree(estimator):
    logp = torch.tensor([[-0.3, -1.7, -4.0], [-0.01, -2.5, -9.0]])
    assert torch.equal(kl_penalty(logp, logp.clone(), estimator), torch.zeros_like(logp))


def test_k3_gradient_pushes_towards_the_reference():
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp); at x = ref - logp = -1: 1 - e^-1
    logp = torch.tensor([-1.0], requires_grad=True)
    kl_penalty(logp, torch.tensor([-2.0]), "k3").sum().backward()
    assert math.isclose(logp.grad.item(), 1 - math.exp(-1.0), rel_tol=1e-6)


def test_unknown_estimator_names_the_valid_ones():
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        kl_penalty(LOGP, REF_LOGP, "k4")


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(LOGP, REF_LOGP[:, :1], "k3")


logprobs = st.lists(st.floats(-20, 0, width=32), min_size=1, max_size=16)


@settings(max_examples=100, deadline=None)
@given(logprobs, st.data())
def test_k2_and_k3_are_non_negative(logp, data):
    ref = data.draw(st.lists(st.floats(-20, 0, width=32), min_size=len(logp), max_size=len(logp)))
    logp, ref = torch.tensor(logp), torch.tensor(ref)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert (kl_penalty(logp, ref, "k2") >= 0).all()


@settings(max_examples=100, deadline=None)
@given(st.floats(-2**-10, 2**-10, width=32), st.floats(-20, 0, width=32))
def test_k3_non_negative_near_zero_log_ratio(offset, logp):
    # tiny log-ratios are where rounding could make exp(x) - x - 1 dip below 0
    logp = torch.tensor([logp])
    assert (kl_penalty(logp, logp + offset, "k3") >= 0).all()
