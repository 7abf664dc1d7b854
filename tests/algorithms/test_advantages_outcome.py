"""The outcome-only estimators of `rlactors.algorithms.advantages` (REINFORCE++, OPO, GPG, pass@k,
ReMax) against veRL 0.9.1's, transcribed below."""

import math
import statistics
from collections import defaultdict

import numpy as np
import pytest
import torch

from rlactors.algorithms import grpo_advantages
from rlactors.algorithms.advantages import (
    gpg_advantages,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
)

# ---------------------------------------------------------------------------------------------
# veRL 0.9.1 references, transcribed from verl/trainer/ppo/core_algos.py and
# verl/utils/torch_functional.py (loops over a dict of groups included). `index` is veRL's
# np.ndarray of uid strings; `config` is a plain dict (veRL calls `config.get` / `config.gamma`).


def _verl_masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def _verl_masked_mean(values, mask, axis=None):
    s = _verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def _verl_masked_var(values, mask, unbiased=True):
    mean = _verl_masked_mean(values, mask)
    centered_values = values - mean
    variance = _verl_masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("At least one element in the mask has to be 1.")
        if mask_sum == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def _verl_masked_whiten(values, mask, shift_mean=True):
    mean, var = _verl_masked_mean(values, mask), _verl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def _verl_reinforce_plus_plus(token_level_rewards, response_mask, config):
    gamma = config["gamma"]
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running_return = 0
        for t in reversed(range(token_level_rewards.shape[1])):
            new_running_return = token_level_rewards[:, t] + gamma * running_return
            returns[:, t] = new_running_return * response_mask[:, t]
            running_return = new_running_return * response_mask[:, t] + running_return * (1 - response_mask[:, t])
        advantages = _verl_masked_whiten(returns, response_mask)
        advantages = advantages * response_mask
    return advantages, returns


def _verl_reinforce_plus_plus_baseline(token_level_rewards, response_mask, index, epsilon=1e-6, config=None):
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
        scores = _verl_masked_whiten(scores, response_mask) * response_mask
    return scores, scores


def _verl_opo(token_level_rewards, response_mask, index, epsilon=1e-6, config=None):
    response_length = response_mask.sum(dim=-1)
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2len = defaultdict(list)
    id2bsl = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
            id2len[index[i]].append(response_length[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2bsl[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                score_tensor = torch.stack(id2score[idx])
                len_tensor = torch.stack(id2len[idx])
                id2bsl[idx] = (len_tensor * score_tensor).sum() / len_tensor.sum()
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            scores[i] = scores[i] - id2bsl[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def _verl_gpg(token_level_rewards, response_mask, index, epsilon=1e-6, f_norm=1.0, alpha=1.0, config=None):
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    id2std = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        m = torch.count_nonzero(scores)
        alpha = bsz / m.clamp(min=1)
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            elif len(id2score[idx]) > 1:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            scores[i] = alpha * (scores[i] - id2mean[index[i]]) / (f_norm)
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def _verl_grpo_passk(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True,
                     config=None):
    assert config is not None
    norm_adv_by_std_in_grpo = config.get("norm_adv_by_std_in_grpo", True)
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    id2scores = defaultdict(list)
    id2indices = defaultdict(list)
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            idx = index[i]
            id2scores[idx].append(scores[i])
            id2indices[idx].append(i)
        for idx in id2scores:
            rewards = torch.stack(id2scores[idx])
            if rewards.numel() < 2:
                raise ValueError(f"Pass@k requires at least 2 samples per group. Got {rewards.numel()} for group {idx}.")
            topk, topk_idx = torch.topk(rewards, 2)
            r_max, r_second_max = topk[0], topk[1]
            i_max = id2indices[idx][topk_idx[0].item()]
            advantage = r_max - r_second_max
            if norm_adv_by_std_in_grpo:
                std = torch.std(rewards)
                advantage = advantage / (std + epsilon)
            advantages[i_max] = advantage
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def _verl_remax(token_level_rewards, reward_baselines, response_mask, config=None):
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


# ---------------------------------------------------------------------------------------------


def _random_batch(seed, group_sizes, length=7):
    """float64 rewards on every position (padding included), masks with holes and padding, some
    all-zero scores (GPG's nonzero count, pass@k ties), uneven shuffled groups."""
    gen = torch.Generator().manual_seed(seed)
    group_ids = torch.repeat_interleave(torch.arange(len(group_sizes)) * 10 - 7, torch.tensor(group_sizes))
    group_ids = group_ids[torch.randperm(group_ids.numel(), generator=gen)]
    batch = group_ids.numel()
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    rewards[torch.rand(batch, generator=gen) < 0.3] = 0.0
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).to(torch.int64)
    holes = (torch.rand(batch, length, generator=gen) < 0.2) & (torch.arange(length) > 0)
    mask[holes] = 0
    index = np.array([f"uid-{g}" for g in group_ids.tolist()], dtype=object)
    return rewards, mask, group_ids, index


def _close(actual, expected):
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=1e-6, atol=1e-10)


SIZES = (1, 2, 3, 5, 4, 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_equals_verl(seed, gamma):
    rewards, mask, _, _ = _random_batch(seed, SIZES)
    advantages, returns = reinforce_plus_plus_advantages(rewards, mask, gamma)
    expected_adv, expected_ret = _verl_reinforce_plus_plus(rewards.clone(), mask, {"gamma": gamma})
    _close(advantages, expected_adv)
    _close(returns, expected_ret)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "ours, verl",
    [
        (reinforce_plus_plus_baseline_advantages, _verl_reinforce_plus_plus_baseline),
        (opo_advantages, _verl_opo),
        (gpg_advantages, _verl_gpg),
    ],
    ids=["rf++-baseline", "opo", "gpg"],
)
def test_group_estimators_equal_verl(seed, ours, verl):
    rewards, mask, group_ids, index = _random_batch(seed, SIZES)
    expected, _ = verl(rewards.clone(), mask, index)
    _close(ours(rewards, mask, group_ids), expected)


@pytest.mark.parametrize("f_norm", [1.0, 2.5])
def test_gpg_f_norm_equals_verl(f_norm):
    rewards, mask, group_ids, index = _random_batch(3, SIZES)
    expected, _ = _verl_gpg(rewards.clone(), mask, index, f_norm=f_norm, alpha=123.0)  # veRL ignores alpha
    _close(gpg_advantages(rewards, mask, group_ids, f_norm=f_norm), expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_equals_verl(seed, norm_by_std):
    rewards, mask, group_ids, index = _random_batch(seed, (2, 3, 5, 4, 2))
    rewards[:4] = rewards[:4].round()  # integer scores: ties for the best happen
    expected, _ = _verl_grpo_passk(rewards.clone(), mask, index, config={"norm_adv_by_std_in_grpo": norm_by_std})
    _close(grpo_passk_advantages(rewards, mask, group_ids, norm_by_std=norm_by_std), expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_remax_equals_verl_on_response_tokens(seed):
    rewards, mask, _, _ = _random_batch(seed, SIZES)
    baselines = torch.randn(rewards.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    advantages, returns = remax_advantages(rewards, baselines, mask)
    expected_adv, expected_ret = _verl_remax(rewards, baselines, mask)
    on = mask != 0
    _close(advantages[on], expected_adv[on])
    _close(returns[on], expected_ret[on])
    # veRL leaves the reward-to-go on holes; here padding is 0.
    assert advantages[~on].abs().sum().item() == 0.0 and returns[~on].abs().sum().item() == 0.0


# --- hand-computed cases and defining properties ---------------------------------------------


def test_reinforce_plus_plus_hand_values():
    rewards = torch.tensor([[0.0, 9.0, 0.0, 1.0], [0.0, 2.0, -math.inf, -math.inf]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])
    advantages, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # Row 0: G3 = 1, G2 = 0 + 0.5 * 1 = 0.5, the hole (its 9 ignored) carries 0.5, G0 = 0.5 * 0.5.
    # Row 1: G1 = 2, G0 = 0.5 * 2 = 1; padding (even -inf) is 0.
    assert returns.tolist() == [[0.25, 0.0, 0.5, 1.0], [1.0, 2.0, 0.0, 0.0]]
    # Whitened over the 5 response tokens 0.25, 0.5, 1, 1, 2: mean 0.95, squared deviations
    # 0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025 = 1.8, unbiased variance 1.8 / 4 = 0.45.
    scale = 1 / math.sqrt(0.45 + 1e-8)
    expected = torch.tensor([[-0.7, 0.0, -0.45, 0.05], [0.05, 1.05, 0.0, 0.0]]) * scale
    torch.testing.assert_close(advantages, expected * mask, rtol=1e-6, atol=1e-6)


def _discounted_sum(rewards, mask, gamma):
    """G_t = sum over response tokens s >= t of gamma^(response tokens in [t, s)) * r_s."""
    out = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        for t in range(rewards.shape[1]):
            if mask[i, t]:
                steps = 0
                for s in range(t, rewards.shape[1]):
                    if mask[i, s]:
                        out[i, t] += gamma**steps * rewards[i, s]
                        steps += 1
    return out


def test_reinforce_plus_plus_returns_are_the_discounted_reverse_cumsum_and_advantages_are_whitened():
    rewards, mask, _, _ = _random_batch(5, SIZES)
    advantages, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.8)
    _close(returns, _discounted_sum(rewards, mask, 0.8))
    on = mask != 0
    assert abs(advantages[on].mean().item()) < 1e-9
    assert math.isclose(advantages[on].std().item(), 1.0, rel_tol=1e-6)
    _, undiscounted = reinforce_plus_plus_advantages(rewards, mask, gamma=1.0)
    _close(undiscounted, (rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask)


TWO_GROUPS_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0]])
TWO_GROUPS_IDS = torch.tensor([4, 4, 9])  # a group of two and a group of one


def test_reinforce_plus_plus_baseline_hand_values_and_batch_whitening():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    advantages = reinforce_plus_plus_baseline_advantages(rewards, TWO_GROUPS_MASK, TWO_GROUPS_IDS)
    # Scores 1, 0 (group mean 0.5) and 0.5 alone (mean 0): centred 0.5, -0.5, 0.5. Over the 4
    # response tokens 0.5, 0.5, -0.5, 0.5: mean 0.25, unbiased variance 0.75 / 3 = 0.25, std 0.5.
    expected = torch.tensor([[0.5, 0.5, 0.0], [-1.5, 0.0, 0.0], [0.5, 0.0, 0.0]])
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-6)
    rewards, mask, group_ids, _ = _random_batch(6, SIZES)
    advantages = reinforce_plus_plus_baseline_advantages(rewards, mask, group_ids)
    on = mask != 0
    assert abs(advantages[on].mean().item()) < 1e-9
    assert math.isclose(advantages[on].std().item(), 1.0, rel_tol=1e-6)


def test_opo_hand_values_and_length_weighted_baseline():
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    advantages = opo_advantages(rewards, mask, torch.tensor([0, 0, 0, 1]))
    # Group 0: scores 1, 0, 0 with lengths 1, 3, 2: baseline 1 * 1 / 6; group 1 alone keeps 0.5.
    expected = torch.tensor([5 / 6, -1 / 6, -1 / 6, 0.5]).unsqueeze(-1) * mask
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-7)
    rewards, mask, group_ids, _ = _random_batch(7, SIZES)
    advantages = opo_advantages(rewards, mask, group_ids)
    per_sample, lengths = advantages[:, 0], mask.sum(-1).to(torch.float64)  # token 0 is always a response token
    for gid in group_ids.unique():
        members = group_ids == gid
        if members.sum() > 1:  # the length-weighted advantages of a group sum to 0
            assert abs((lengths[members] * per_sample[members]).sum().item()) < 1e-9
        else:  # a group of one keeps its score
            assert per_sample[members].item() == rewards[members].sum().item()


def test_gpg_hand_values_and_scaling():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    advantages = gpg_advantages(rewards, mask, torch.tensor([3, 3, 3, 8]))
    # Two of four scores are nonzero: alpha = 4 / 2 = 2. Group 3: scores 1, 0, 0, mean 1/3;
    # group 8 alone keeps its score: 2 * 0.5.
    expected = torch.tensor([4 / 3, -2 / 3, -2 / 3, 1.0]).unsqueeze(-1) * mask
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gpg_advantages(rewards, mask, torch.tensor([3, 3, 3, 8]), f_norm=4.0), expected / 4)
    # GPG is Dr.GRPO's score - group mean scaled by batch / #nonzero scores.
    rewards, mask, group_ids, _ = _random_batch(8, SIZES)
    alpha = rewards.shape[0] / torch.count_nonzero(rewards.sum(-1)).item()
    assert alpha > 1
    dr_grpo = grpo_advantages(rewards, mask, group_ids, norm_by_std=False)
    _close(gpg_advantages(rewards, mask, group_ids), alpha * dr_grpo)
    assert gpg_advantages(torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([0, 0])).abs().sum().item() == 0.0


def test_grpo_passk_hand_values():
    rewards = torch.tensor([[0.2, 0.0], [1.0, 0.0], [0.0, 0.5], [0.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 0], [1, 1], [1, 1], [1, 1], [1, 0]])
    group_ids = torch.tensor([1, 1, 1, 2, 2])
    # Group 1: scores 0.2, 1.0, 0.5; the best (sample 1) gets 1.0 - 0.5, divided by the group's
    # unbiased std (+1e-6). Group 2 has no correct sample: best = second best = 0, advantage 0.
    std = statistics.stdev([0.2, 1.0, 0.5])
    expected = torch.tensor([0.0, 0.5 / (std + 1e-6), 0.0, 0.0, 0.0]).unsqueeze(-1) * mask
    torch.testing.assert_close(grpo_passk_advantages(rewards, mask, group_ids), expected, rtol=1e-6, atol=1e-7)
    unnormalised = grpo_passk_advantages(rewards, mask, group_ids, norm_by_std=False)
    torch.testing.assert_close(unnormalised, torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0]).unsqueeze(-1) * mask)


def test_grpo_passk_rewards_only_the_best_sample_of_a_group_with_a_correct_one():
    gen = torch.Generator().manual_seed(9)
    group_ids = torch.arange(6).repeat_interleave(4)
    scores = (torch.rand(24, generator=gen) < 0.3).to(torch.float64)
    scores[:4] = 0.0  # group 0: no correct sample
    scores[4:8] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # group 1: one correct sample
    scores[8:12] = 1.0  # group 2: all correct (a tie for the best)
    advantages = grpo_passk_advantages(scores.unsqueeze(-1), torch.ones(24, 1), group_ids, norm_by_std=False)[:, 0]
    for gid in range(6):
        members = (group_ids == gid).nonzero().flatten()
        adv, group_scores = advantages[members], scores[members]
        assert (adv != 0).sum() <= 1
        if group_scores.max() == 0 or (group_scores == group_scores.max()).sum() > 1:
            assert adv.abs().sum() == 0  # nobody is uniquely best: nothing to learn
        else:
            best = group_scores.argmax()
            assert adv[best] == group_scores[best] - group_scores.sort().values[-2]
    assert advantages[5].item() == 1.0


def test_grpo_passk_needs_two_samples_per_group():
    with pytest.raises(ValueError, match=r"groups \[5\]"):
        grpo_passk_advantages(torch.ones(3, 2), torch.ones(3, 2), torch.tensor([1, 1, 5]))


def test_remax_hand_values_and_baseline_subtraction():
    rewards = torch.tensor([[0.5, 7.0, 0.0, 1.0], [0.0, 1.0, -math.inf, 0.0]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])
    advantages, returns = remax_advantages(rewards, torch.tensor([0.75, 1.0]), mask)
    # Row 0: reward-to-go over response tokens (the hole's 7 ignored): 1.5, -, 1, 1; minus 0.75.
    # Row 1: the outcome reward 1 sits on the last token: every return is 1, minus the greedy 1.
    assert returns.tolist() == [[1.5, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    assert advantages.tolist() == [[0.75, 0.0, 0.25, 0.25], [0.0, 0.0, 0.0, 0.0]]
    rewards, mask, _, _ = _random_batch(10, SIZES)
    baselines = torch.randn(rewards.shape[0], dtype=torch.float64)
    advantages, returns = remax_advantages(rewards, baselines, mask)
    _close(advantages, (returns - baselines.unsqueeze(-1)) * mask)
    with pytest.raises(ValueError, match="baseline_scores"):
        remax_advantages(rewards, baselines[:3], mask)


def _all_estimators(rewards, mask, group_ids):
    yield reinforce_plus_plus_advantages(rewards, mask, 0.9)
    yield reinforce_plus_plus_baseline_advantages(rewards, mask, group_ids)
    yield opo_advantages(rewards, mask, group_ids)
    yield gpg_advantages(rewards, mask, group_ids)
    yield grpo_passk_advantages(rewards, mask, group_ids)
    yield remax_advantages(rewards, torch.ones(rewards.shape[0], dtype=rewards.dtype), mask)


def test_outcome_estimators_keep_dtype_and_zero_padding():
    rewards, mask, group_ids, _ = _random_batch(11, (2, 3, 4))
    for out in _all_estimators(rewards.to(torch.bfloat16), mask, group_ids):
        for tensor in out if isinstance(out, tuple) else (out,):
            assert tensor.dtype == torch.bfloat16
            assert torch.isfinite(tensor).all() and tensor[mask == 0].abs().sum().item() == 0.0


def test_per_token_estimators_ignore_whatever_padding_holds():
    rewards, mask, _, _ = _random_batch(12, SIZES)
    poisoned = torch.where(mask != 0, rewards, -math.inf)
    for clean, dirty in zip(
        reinforce_plus_plus_advantages(rewards, mask, 0.9) + remax_advantages(rewards, torch.zeros(len(mask)), mask),
        reinforce_plus_plus_advantages(poisoned, mask, 0.9) + remax_advantages(poisoned, torch.zeros(len(mask)), mask),
        strict=True,
    ):
        assert torch.equal(clean, dirty)
