import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlactors.algorithms import gae_advantages, grpo_advantages, rloo_advantages, scores_to_token_rewards


def test_scores_go_on_the_last_response_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 1, 0, 1]])
    rewards = scores_to_token_rewards(torch.tensor([1.0, -2.0, 0.5]), mask)
    assert rewards.tolist() == [[0, 0, 1.0, 0], [-2.0, 0, 0, 0], [0, 0, 0, 0.5]]
    assert scores_to_token_rewards(torch.tensor([1.0], dtype=torch.float64), mask[:1]).dtype == torch.float64


def test_scores_without_a_response_token_are_an_error_naming_the_sample():
    mask = torch.tensor([[1, 0], [0, 0], [0, 0]])
    with pytest.raises(ValueError, match=r"\[1, 2\]"):
        scores_to_token_rewards(torch.tensor([1.0, 0.0, 1.0]), mask)


def _gae_loop(rewards, values, mask, gamma, lam):
    """Reference GAE on python lists, carrying values and gae across masked positions."""
    raw = []
    for r_row, v_row, m_row in zip(rewards, values, mask, strict=True):
        next_value, last_gae, row = 0.0, 0.0, [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            gae = r_row[t] + gamma * next_value - v_row[t] + gamma * lam * last_gae
            if m_row[t]:
                next_value, last_gae = v_row[t], gae
            row[t] = last_gae
        raw.append(row)
    returns = [[a + v for a, v in zip(ra, rv, strict=True)] for ra, rv in zip(raw, values, strict=True)]
    selected = [a for ra, rm in zip(raw, mask, strict=True) for a, m in zip(ra, rm, strict=True) if m]
    mean = sum(selected) / len(selected)
    std = math.sqrt(sum((a - mean) ** 2 for a in selected) / (len(selected) - 1) + 1e-8)
    advantages = [[(a - mean) / std if m else 0.0 for a, m in zip(ra, rm, strict=True)] for ra, rm in zip(raw, mask, strict=True)]
    returns = [[x if m else 0.0 for x, m in zip(rr, rm, strict=True)] for rr, rm in zip(returns, mask, strict=True)]
    return advantages, returns


def test_gae_with_gamma_and_lambda_one_returns_the_monte_carlo_return():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    advantages, returns = gae_advantages(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    # Every raw advantage is 1 - 0.5 = 0.5: the returns are 1 and the whitened advantages 0.
    assert torch.allclose(returns, torch.ones(1, 3))
    assert torch.allclose(advantages, torch.zeros(1, 3))


def test_gae_matches_the_loop_including_masked_holes():
    rewards = [[0.1, 0.0, 0.3, 1.0, 9.0], [0.0, -0.5, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]]
    values = [[0.2, 7.0, 0.4, 0.1, 5.0], [0.3, 0.1, -0.2, 3.0, 3.0], [1.0, 1.0, 1.0, 1.0, 1.0]]
    mask = [[1, 0, 1, 1, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    expected_adv, expected_ret = _gae_loop(rewards, values, mask, gamma=0.9, lam=0.8)
    advantages, returns = gae_advantages(
        torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), gamma=0.9, lam=0.8
    )
    assert torch.allclose(advantages, torch.tensor(expected_adv), atol=1e-5)
    assert torch.allclose(returns, torch.tensor(expected_ret), atol=1e-6)


def test_gae_on_an_empty_mask_is_zero_not_nan():
    advantages, returns = gae_advantages(torch.ones(2, 3), torch.ones(2, 3), torch.zeros(2, 3), 1.0, 0.95)
    assert advantages.abs().sum().item() == 0.0 and returns.abs().sum().item() == 0.0


def test_gae_keeps_dtype():
    advantages, returns = gae_advantages(
        torch.rand(2, 4, dtype=torch.bfloat16), torch.rand(2, 4, dtype=torch.bfloat16), torch.ones(2, 4), 1.0, 1.0
    )
    assert advantages.dtype == returns.dtype == torch.bfloat16


def _grpo_loop(scores, group_ids, norm_by_std, epsilon=1e-6):
    out = []
    for score, gid in zip(scores, group_ids, strict=True):
        group = [s for s, g in zip(scores, group_ids, strict=True) if g == gid]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.fmean(group), statistics.stdev(group)
        out.append((score - mean) / (std + epsilon) if norm_by_std else score - mean)
    return out


def _rloo_loop(scores, group_ids):
    out = []
    for i, (score, gid) in enumerate(zip(scores, group_ids, strict=True)):
        others = [s for j, (s, g) in enumerate(zip(scores, group_ids, strict=True)) if g == gid and j != i]
        out.append(score - sum(others) / len(others) if others else score)
    return out


MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 1, 1]])
# Scores are spread over tokens: the estimators sum them.
TOKEN_REWARDS = torch.tensor(
    [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.25, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.75]]
)
SCORES = [1.0, 0.0, 1.0, 0.25, 0.0, 0.75]
GROUP_IDS = [7, 7, 7, -3, -3, 42]  # unsorted, negative, and a group of one


def test_grpo_hand_values():
    advantages = grpo_advantages(TOKEN_REWARDS, MASK, torch.tensor(GROUP_IDS))
    third = math.sqrt(1.0 / 3.0)  # std of [1, 0, 1]
    eighth = math.sqrt(0.25**2 / 2)  # std of [0.25, 0]
    per_sample = [(1 / 3) / (third + 1e-6), (-2 / 3) / (third + 1e-6), (1 / 3) / (third + 1e-6),
                  0.125 / (eighth + 1e-6), -0.125 / (eighth + 1e-6), 0.75 / (1 + 1e-6)]
    expected = torch.tensor(per_sample).unsqueeze(-1) * MASK
    assert torch.allclose(advantages, expected, atol=1e-5)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_the_loop(norm_by_std):
    advantages = grpo_advantages(TOKEN_REWARDS, MASK, torch.tensor(GROUP_IDS), norm_by_std=norm_by_std)
    expected = torch.tensor(_grpo_loop(SCORES, GROUP_IDS, norm_by_std)).unsqueeze(-1) * MASK
    assert torch.allclose(advantages, expected, atol=1e-5)


def test_grpo_group_of_one_keeps_its_score_and_equal_scores_give_zero():
    mask = torch.ones(3, 2)
    rewards = torch.tensor([[0.0, 2.0], [0.0, 1.0], [0.0, 1.0]])
    advantages = grpo_advantages(rewards, mask, torch.tensor([0, 1, 1]))
    assert torch.allclose(advantages[0], torch.full((2,), 2.0 / (1 + 1e-6)))
    assert advantages[1:].abs().sum().item() == 0.0
    assert grpo_advantages(rewards, mask, torch.tensor([0, 1, 1]), norm_by_std=False)[0].tolist() == [2.0, 2.0]


def test_rloo_matches_the_loop_and_a_hand_value():
    advantages = rloo_advantages(TOKEN_REWARDS, MASK, torch.tensor(GROUP_IDS))
    expected = torch.tensor(_rloo_loop(SCORES, GROUP_IDS)).unsqueeze(-1) * MASK
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert math.isclose(advantages[1, 0].item(), 0.0 - (1.0 + 1.0) / 2, abs_tol=1e-6)
    assert math.isclose(advantages[5, 1].item(), 0.75, abs_tol=1e-7)  # group of one: the score itself


def test_outcome_advantages_are_zero_on_padding_and_keep_dtype():
    rewards = TOKEN_REWARDS.to(torch.bfloat16)
    for fn in (grpo_advantages, rloo_advantages):
        advantages = fn(rewards, MASK, torch.tensor(GROUP_IDS))
        assert advantages.dtype == torch.bfloat16
        assert advantages[MASK == 0].abs().sum().item() == 0.0
    empty = grpo_advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0, 0]))
    assert torch.isfinite(empty).all() and empty.abs().sum().item() == 0.0


def test_bad_group_ids_are_rejected():
    with pytest.raises(ValueError, match="integers"):
        grpo_advantages(TOKEN_REWARDS, MASK, torch.tensor([0.0] * 6))
    with pytest.raises(ValueError, match="batch=6"):
        rloo_advantages(TOKEN_REWARDS, MASK, torch.tensor([0, 1]))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.5, 1.0, -1.0])), min_size=1, max_size=16),
       st.booleans())
def test_vectorised_group_statistics_match_the_loops(samples, norm_by_std):
    group_ids = [g for g, _ in samples]
    scores = [s for _, s in samples]
    rewards = torch.tensor(scores, dtype=torch.float64).unsqueeze(-1)
    mask = torch.ones_like(rewards)
    grpo = grpo_advantages(rewards, mask, torch.tensor(group_ids), norm_by_std=norm_by_std).squeeze(-1)
    assert torch.allclose(grpo, torch.tensor(_grpo_loop(scores, group_ids, norm_by_std), dtype=torch.float64))
    rloo = rloo_advantages(rewards, mask, torch.tensor(group_ids)).squeeze(-1)
    assert torch.allclose(rloo, torch.tensor(_rloo_loop(scores, group_ids), dtype=torch.float64))


def test_numpy_group_ids_are_accepted():
    from_numpy = grpo_advantages(TOKEN_REWARDS, MASK, np.array(GROUP_IDS))
    assert torch.equal(from_numpy, grpo_advantages(TOKEN_REWARDS, MASK, torch.tensor(GROUP_IDS)))
