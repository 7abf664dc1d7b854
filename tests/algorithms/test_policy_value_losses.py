import math

import pytest
import torch

from rlactors.algorithms import (
    aggregate_loss,
    ppo_policy_loss,
    rollout_importance_weights,
    sft_loss,
    value_loss,
)

# One token per PPO branch; clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.
#   advantage, ratio,    per-token loss, clipped by the ratio clip, clipped by the dual clip
CASES = [
    (1.0, 1.0, -1.0, False, False),  # inside the trust region
    (1.0, 1.5, -1.28, True, False),  # clip-higher: capped at 1 + 0.28
    (1.0, 0.5, -0.5, False, False),  # A > 0 and ratio low: the unclipped term is the max
    (-1.0, 1.5, 1.5, False, False),  # A < 0 and ratio high: unclipped, under the dual bound 3
    (-1.0, 0.5, 0.8, True, False),  # A < 0 and ratio low: floored at 1 - 0.2
    (-1.0, 5.0, 3.0, False, True),  # dual clip: min(-A * 3, 5)
    (2.0, math.exp(30.0), -2.56, True, False),  # log-ratio clamped at 20, then clipped
]


def _case_tensors():
    advantages = torch.tensor([[a for a, *_ in CASES]], dtype=torch.float64)
    old_logp = torch.full_like(advantages, -2.0)
    logp = (old_logp + torch.tensor([[math.log(r) for _, r, *_ in CASES]], dtype=torch.float64)).requires_grad_(True)
    return logp, old_logp, advantages


def test_policy_loss_per_token_values_and_metrics():
    logp, old_logp, advantages = _case_tensors()
    mask = torch.ones_like(advantages)
    per_token, metrics = ppo_policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28, 3.0)
    assert torch.allclose(per_token, torch.tensor([[loss for _, _, loss, _, _ in CASES]], dtype=torch.float64))
    n = len(CASES)
    assert math.isclose(metrics["pg_clipfrac"].item(), sum(c for *_, c, _ in CASES) / n, rel_tol=1e-6)
    assert math.isclose(metrics["pg_clipfrac_lower"].item(), sum(d for *_, d in CASES) / n, rel_tol=1e-6)
    log_ratios = [min(math.log(r), 20.0) for _, r, *_ in CASES]
    assert math.isclose(metrics["ppo_kl"].item(), -sum(log_ratios) / n, rel_tol=1e-6)
    assert all(not value.requires_grad for value in metrics.values())


def test_policy_gradient_flows_only_through_unclipped_tokens():
    logp, old_logp, advantages = _case_tensors()
    per_token, _ = ppo_policy_loss(logp, old_logp, advantages, torch.ones_like(advantages), 0.2, 0.28, 3.0)
    per_token.sum().backward()
    # d(-A * ratio)/d logp = -A * ratio where the unclipped branch is active, 0 where a clip is.
    expected = [0.0 if clipped or dual else -a * r for a, r, _, clipped, dual in CASES]
    assert torch.allclose(logp.grad, torch.tensor([expected], dtype=torch.float64))


def test_padding_is_ignored_by_metrics_and_aggregation():
    logp = torch.tensor([[-1.0, float("-inf")]])
    old_logp = torch.tensor([[-1.5, 0.0]])
    advantages = torch.tensor([[1.0, 1.0]])
    mask = torch.tensor([[1, 0]])
    per_token, metrics = ppo_policy_loss(logp, old_logp, advantages, mask)
    assert math.isclose(metrics["ppo_kl"].item(), -0.5, rel_tol=1e-6)
    assert metrics["pg_clipfrac"].item() == 1.0  # exp(0.5) > 1.2
    assert math.isclose(aggregate_loss(per_token, mask, "token-mean").item(), -1.2, rel_tol=1e-6)
    _, empty_metrics = ppo_policy_loss(logp, old_logp, advantages, torch.zeros_like(mask))
    assert all(value.item() == 0.0 for value in empty_metrics.values())


def test_truncated_importance_weights_multiply_the_loss_and_are_detached():
    old_logp = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout_logp = (old_logp - torch.tensor([[math.log(2.0), math.log(0.5), 0.0]])).requires_grad_(True)
    weights, _ = rollout_importance_weights(old_logp, rollout_logp, torch.ones(1, 3), "token", 1.5)  # TIS
    assert torch.allclose(weights, torch.tensor([[1.5, 0.5, 1.0]]))
    assert not weights.requires_grad
    logp = old_logp.clone().requires_grad_(True)
    advantages = torch.tensor([[1.0, -2.0, 0.5]])
    weighted, _ = ppo_policy_loss(logp, old_logp, advantages, torch.ones(1, 3), importance_weights=weights)
    assert torch.allclose(weighted, torch.tensor([[-1.5, 1.0, -0.5]]))
    weighted.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.5, 1.0, -0.5]]))  # ratio 1: grad = -A * w
    with pytest.raises(ValueError, match="threshold must be positive"):
        rollout_importance_weights(old_logp, rollout_logp, torch.ones(1, 3), "token", 0.0)


def test_dual_clip_bound_must_exceed_one():
    logp, old_logp, advantages = _case_tensors()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(logp, old_logp, advantages, torch.ones_like(advantages), clip_ratio_c=1.0)


def test_policy_loss_keeps_dtype():
    x = torch.zeros(2, 3, dtype=torch.bfloat16)
    per_token, metrics = ppo_policy_loss(x, x, x + 1, torch.ones(2, 3))
    assert per_token.dtype == torch.bfloat16 and metrics["ppo_kl"].dtype == torch.bfloat16


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 1.0, 0.2, 9.0]], requires_grad=True)
    old_values = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    per_token, metrics = value_loss(values, old_values, returns, mask, clip_range=0.5)
    # 1: (1-0)^2=1 vs (0.5-0)^2=0.25; 2: (1-2)^2=1 vs (0.5-2)^2=2.25 (clipped wins); 3: inside the range.
    assert torch.allclose(per_token[:, :3], torch.tensor([[0.5, 1.125, 0.32]]))
    assert math.isclose(metrics["vf_clipfrac"].item(), 1 / 3, rel_tol=1e-6)
    aggregate_loss(per_token, mask, "token-mean").backward()
    # Gradient (v - R) / 3 on the unclipped branch, 0 where the clipped branch is the max.
    assert torch.allclose(values.grad, torch.tensor([[1 / 3, 0.0, -0.8 / 3, 0.0]]))


def test_sft_loss_is_masked_token_mean_nll():
    logp = torch.tensor([[-1.0, -2.0, float("-inf")], [-0.5, float("nan"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert math.isclose(sft_loss(logp, mask).item(), (1.0 + 2.0 + 0.5) / 3, rel_tol=1e-6)
    assert math.isclose(sft_loss(logp, mask, global_num_tokens=7).item(), 3.5 / 7, rel_tol=1e-6)
    assert sft_loss(logp, torch.zeros_like(mask)).item() == 0.0
