"""The actor's policy term by config name (`rlactors.trainer.policy_objective`), without Ray: each
name reaches its function with the config's parameters and the aggregation its definition fixes;
bypass mode compares the current policy with the rollout's."""

import typing

import pytest
import torch

from rlactors import algorithms
from rlactors.config import AlgorithmConfig
from rlactors.config.algorithm import POLICY_LOSSES
from rlactors.trainer.policy_objective import policy_loss


def _tensors(seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (4, 6)
    old = -torch.rand(shape, generator=generator, dtype=torch.float64) - 0.5
    logp = (old + 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64)).requires_grad_(True)
    rollout = old + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = torch.ones(shape, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return logp, old, rollout, advantages, mask


COUNTS = dict(global_num_tokens=40, global_num_sequences=5, norm_tokens=6)


@pytest.mark.parametrize("name", typing.get_args(POLICY_LOSSES))
def test_every_policy_loss_name_reaches_its_function_with_the_config_s_parameters(name):
    algorithm = AlgorithmConfig(policy_loss=name, loss_agg_mode="token-sum", clip_ratio_low=0.1, clip_ratio_high=0.3,
                                tau_positive=2.0, tau_negative=3.0, kl_cov_ratio=0.3, ppo_kl_coef=0.5)
    logp, old, rollout, advantages, mask = _tensors()
    weights = torch.full_like(mask, 0.5)
    torch.manual_seed(1)  # Clip-Cov draws its tokens from the default generator
    loss, sums = policy_loss(algorithm, logp, old, rollout, advantages, mask, weights, COUNTS)
    function = algorithms.POLICY_LOSSES[name]
    params = {"vanilla": (0.1, 0.3, 3.0), "gspo": (0.1, 0.3), "sapo": (2.0, 3.0), "cispo": (0.1, 0.3),
              "geo_mean": (0.1, 0.3), "gpg": (), "clip_cov": (0.1, 0.3, 0.0002, 1.0, 5.0), "kl_cov": (0.3, 0.5),
              "dppo_tv": (0.1, 0.3, 3.0), "dppo_kl": (0.1, 0.3, 3.0)}[name]
    inputs = (logp, advantages, mask) if name == "gpg" else (logp, old, advantages, mask)
    torch.manual_seed(1)
    per_token, stats = function(*inputs, *params, importance_weights=weights)
    mode = algorithms.FIXED_LOSS_AGG_MODES.get(name, "token-sum")
    torch.testing.assert_close(loss, algorithms.aggregate_loss(per_token, mask, mode, **COUNTS))
    assert set(sums) == {"pg_loss", "ppo_kl", "pg_clipfrac", "pg_clipfrac_lower"}
    torch.testing.assert_close(sums["ppo_kl"], stats["ppo_kl"] * mask.sum())


def test_bypass_mode_takes_the_rollout_logprobs_as_old_and_its_loss_type():
    logp, old, rollout, advantages, mask = _tensors(seed=2)
    correction = dict(bypass_mode=True, importance_level="token", importance_threshold=1.2)
    ppo = AlgorithmConfig(rollout_correction=correction)
    loss, sums = policy_loss(ppo, logp, old, rollout, advantages, mask, None, COUNTS)
    expected, _ = algorithms.ppo_policy_loss(logp, rollout, advantages, mask)  # no weights on top of the ratio
    torch.testing.assert_close(loss, algorithms.aggregate_loss(expected, mask, "token-mean", **COUNTS))
    weights, _ = algorithms.rollout_importance_weights(logp.detach(), rollout, mask, "token", 1.2)
    torch.testing.assert_close(sums["rollout_corr/rollout_is_mean"], (weights * mask).sum())
    reinforce = AlgorithmConfig(rollout_correction=correction | dict(loss_type="reinforce"))
    loss, _ = policy_loss(reinforce, logp, old, rollout, advantages, mask, None, COUNTS)
    expected, _ = algorithms.reinforce_policy_loss(logp, rollout, advantages, mask, importance_weights=weights)
    torch.testing.assert_close(loss, algorithms.aggregate_loss(expected, mask, "token-mean", **COUNTS))
    (gradient,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(gradient, -advantages * weights * mask / 40)  # REINFORCE: d/dlogp = -A * w


def test_bypass_rejection_takes_rejected_tokens_out_of_the_policy_loss_alone():
    logp, old, rollout, advantages, mask = _tensors(seed=3)
    rollout = rollout.clone()
    rollout[0] = logp.detach()[0] - 3.0  # sequence 0 far off the rollout policy: rejected whole
    correction = dict(bypass_mode=True, rejection="seq_max_k2", rejection_threshold=1.0)
    loss, sums = policy_loss(AlgorithmConfig(rollout_correction=correction), logp, old, rollout, advantages, mask,
                             None, COUNTS)
    kept = mask.clone()
    kept[0] = 0
    expected, _ = algorithms.ppo_policy_loss(logp, rollout, advantages, kept)
    torch.testing.assert_close(loss, algorithms.aggregate_loss(expected, kept, "token-mean", **COUNTS))
    assert float(sums["rollout_corr/rollout_rs_masked_fraction"]) == 6.0
    empty, empty_sums = policy_loss(AlgorithmConfig(rollout_correction=correction), logp, old, rollout, advantages,
                                    torch.zeros_like(mask), None, COUNTS)
    assert float(empty.detach()) == 0.0 and all(float(v.detach()) == 0.0 for v in empty_sums.values())
