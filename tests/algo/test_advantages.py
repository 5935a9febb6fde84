"""Advantage estimators against hand-computed values."""

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.algo import ADVANTAGES, register_advantage


def advantages(name, rewards):
    return ADVANTAGES[name](torch.tensor(rewards))


def test_registry_holds_the_estimators():
    assert {"grpo", "dr_grpo", "rloo"} <= set(ADVANTAGES)


def test_registering_a_taken_name_fails():
    with pytest.raises(ValueError, match="grpo"):
        register_advantage("grpo")(lambda rewards: rewards)


def test_grpo_binary_group():
    # [1,0,0,1]: mean 0.5, population std 0.5 -> (r - 0.5) / 0.5 = [1,-1,-1,1] (eps 1e-6 aside)
    out = advantages("grpo", [[1.0, 0.0, 0.0, 1.0]])
    torch.testing.assert_close(out, torch.tensor([[1.0, -1.0, -1.0, 1.0]]), atol=1e-5, rtol=0)


def test_grpo_uses_population_std():
    # [1,2,3]: mean 2, var = (1+0+1)/3 = 2/3, std = 0.816497 -> [-1.224745, 0, 1.224745]
    # (the unbiased std, 1.0, would give [-1, 0, 1])
    out = advantages("grpo", [[1.0, 2.0, 3.0]])
    torch.testing.assert_close(out, torch.tensor([[-1.224745, 0.0, 1.224745]]), atol=1e-5, rtol=0)


def test_grpo_groups_are_independent():
    # row 0: [1,0] -> mean .5, std .5 -> [1,-1]; row 1: [4,2] -> mean 3, std 1 -> [1,-1]
    out = advantages("grpo", [[1.0, 0.0], [4.0, 2.0]])
    torch.testing.assert_close(out, torch.tensor([[1.0, -1.0], [1.0, -1.0]]), atol=1e-5, rtol=0)


def test_grpo_zero_variance_group_is_exactly_zero():
    # all-equal groups: r - mean = 0 and std = 0; 0.1 is not exact in float32, so the mean may be
    # one ulp off, which must not be amplified by 1/eps
    out = advantages("grpo", [[1.0] * 7, [0.0] * 7, [0.1] * 7, [0.3] * 7])
    assert torch.isfinite(out).all()
    assert torch.equal(out, torch.zeros_like(out))


def test_dr_grpo_only_centres():
    # [1,2,3] - 2 = [-1,0,1]; [1,0,0,1] - 0.5 = [.5,-.5,-.5,.5]
    torch.testing.assert_close(advantages("dr_grpo", [[1.0, 2.0, 3.0]]), torch.tensor([[-1.0, 0.0, 1.0]]))
    torch.testing.assert_close(
        advantages("dr_grpo", [[1.0, 0.0, 0.0, 1.0]]), torch.tensor([[0.5, -0.5, -0.5, 0.5]])
    )


def test_rloo_leave_one_out():
    # [1,2,3]: 1 - (2+3)/2 = -1.5; 2 - (1+3)/2 = 0; 3 - (1+2)/2 = 1.5  (= 3/2 * [-1,0,1])
    torch.testing.assert_close(advantages("rloo", [[1.0, 2.0, 3.0]]), torch.tensor([[-1.5, 0.0, 1.5]]))
    # [1,0,0,0]: 1 - 0 = 1; 0 - 1/3 = -1/3 for the others
    torch.testing.assert_close(
        advantages("rloo", [[1.0, 0.0, 0.0, 0.0]]), torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]])
    )


def test_rloo_single_completion_is_zero():
    assert torch.equal(advantages("rloo", [[5.0], [2.0]]), torch.zeros(2, 1))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_output_is_float32_of_the_same_shape(name):
    for rewards in (torch.tensor([[1, 0, 1]]), torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)):
        out = ADVANTAGES[name](rewards)
        assert out.dtype == torch.float32 and out.shape == rewards.shape


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_rejects_flat_rewards(name):
    with pytest.raises(ValueError, match="num_groups"):
        ADVANTAGES[name](torch.tensor([1.0, 0.0]))


reward_groups = st.integers(1, 4).flatmap(
    lambda num_groups: st.integers(1, 8).flatmap(
        lambda group_size: st.lists(
            st.lists(st.floats(-10, 10, width=32), min_size=group_size, max_size=group_size),
            min_size=num_groups,
            max_size=num_groups,
        )
    )
)


@settings(max_examples=60, deadline=None)
@given(reward_groups)
def test_advantages_sum_to_zero_within_each_group(rewards):
    rewards = torch.tensor(rewards)
    for name in ("grpo", "dr_grpo", "rloo"):
        out = ADVANTAGES[name](rewards)
        assert torch.isfinite(out).all()
        # grpo divides by std + 1e-6, so its entries are at most ~sqrt(G) in size
        tolerance = 1e-3 if name == "grpo" else 1e-4 * (1 + rewards.abs().max().item())
        assert out.sum(dim=1).abs().max().item() <= tolerance, name


@settings(max_examples=60, deadline=None)
@given(reward_groups.filter(lambda rows: len(rows[0]) >= 2))
def test_rloo_is_dr_grpo_scaled_by_g_over_g_minus_1(rewards):
    rewards = torch.tensor(rewards)
    group_size = rewards.shape[1]
    expected = group_size / (group_size - 1) * ADVANTAGES["dr_grpo"](rewards)
    torch.testing.assert_close(ADVANTAGES["rloo"](rewards), expected, atol=1e-4, rtol=1e-4)


def test_algo_imports_no_heavy_dependencies():
    code = (
        "import sys, factory.algo; "
        "heavy = [m for m in ('ray', 'vllm', 'dagster') if m in sys.modules]; "
        "other = [m for m in sys.modules if m.startswith('factory.') and m != 'factory.core' "
        "and not m.startswith(('factory.algo', 'factory.core.types', 'factory.core.registry', 'factory.core.registries'))]; "
        "assert not heavy and not other, (heavy, other)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_grpo_epsilon_keeps_tiny_spreads_finite():
    # [0, 1e-7]: mean 5e-8, std 5e-8 -> ±5e-8 / (5e-8 + 1e-6) = ±0.047619
    out = advantages("grpo", [[0.0, 1e-7]])
    expected = 5e-8 / (5e-8 + 1e-6)
    assert math.isclose(out[0, 1].item(), expected, rel_tol=1e-3)
    assert math.isclose(out[0, 0].item(), -expected, rel_tol=1e-3)


# ---------------------------------------------------------------- REINFORCE++ and batch scope


def test_reinforce_pp_normalises_over_the_whole_batch():
    # rewards 1, 0, 0, 0: batch mean 0.25, population std sqrt((0.75^2 + 3 * 0.25^2) / 4) = sqrt(0.1875)
    # -> A = 0.75 / 0.433013 = 1.732051 and -0.25 / 0.433013 = -0.577350; the [0, 0] group is not 0
    out = advantages("reinforce_pp", [[1.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(out, torch.tensor([[1.732051, -0.577350], [-0.577350, -0.577350]]))


def test_reinforce_pp_constant_batch_is_zero():
    assert torch.equal(advantages("reinforce_pp", [[2.0, 2.0], [2.0, 2.0]]), torch.zeros(2, 2))


def test_batch_advantages_handles_unequal_groups():
    from factory.algo import batch_advantages

    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0, 2.0])
    # dr_grpo per group [1, 0], [3, 1, 2]: means 0.5 and 2 -> [0.5, -0.5, 1, -1, 0]
    torch.testing.assert_close(batch_advantages("dr_grpo", rewards, [2, 3]),
                               torch.tensor([0.5, -0.5, 1.0, -1.0, 0.0]))
    # reinforce_pp ignores the groups: mean 1.4, std sqrt(1.04) = 1.019804
    expected = (rewards - 1.4) / (1.04 ** 0.5 + 1e-6)
    torch.testing.assert_close(batch_advantages("reinforce_pp", rewards, [2, 3]), expected)
    with pytest.raises(ValueError, match="add up"):
        batch_advantages("grpo", rewards, [2, 2])
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        batch_advantages("nope", rewards, [5])


def test_register_advantage_rejects_an_unknown_scope():
    with pytest.raises(ValueError, match="scope"):
        register_advantage("x_scope_test", scope="token")


# ---------------------------------------------------------------- DAPO overlong reward shaping


def test_overlong_penalty_hand_values():
    # L_max 8, L_cache 4: 0 up to 4 tokens, then (4 - L) / 4: 5 -> -0.25, 6 -> -0.5, 8 -> -1; beyond 8 -> -1
    from factory.algo import overlong_penalty

    out = overlong_penalty(torch.tensor([3, 4, 5, 6, 8, 9]), max_len=8, buffer_len=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    scaled = overlong_penalty(torch.tensor([6]), max_len=8, buffer_len=4, factor=0.5)
    torch.testing.assert_close(scaled, torch.tensor([-0.25]))
    assert torch.equal(overlong_penalty(torch.tensor([8, 9]), 8, 0), torch.zeros(2))
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([1]), max_len=8, buffer_len=9)
