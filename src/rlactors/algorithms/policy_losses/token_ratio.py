"""Losses on a per-token importance ratio `r = exp(clamp(logp - old_logp, -20, 20))`: PPO's clipped
surrogate (veRL's `vanilla`), SAPO, which replaces the clip by a smooth gate, and CISPO, which keeps
the clipped ratio as a detached weight so that no token loses its gradient."""

from __future__ import annotations

import torch

from rlactors.algorithms.masked import LOG_RATIO_CLAMP, masked_fraction, masked_mean, zero_padding
from rlactors.algorithms.policy_losses.result import policy_loss_result


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with clip-higher and dual clip (veRL's `compute_policy_loss_vanilla`).

    `ratio = exp(clamp(logp - old_logp, -20, 20))`,
    `L = max(-A * ratio, -A * clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))`, and where
    `A < 0`, `L = min(-A * clip_ratio_c, L)`. `importance_weights` (e.g. from
    `rollout_importance_weights`) multiply the per-token loss and are detached.

    Returns the per-token loss [batch, response_len] (aggregate it with `aggregate_loss`) and detached
    metrics over this call's mask: `pg_clipfrac` (clipped by the ratio clip), `pg_clipfrac_lower`
    (clipped by the dual clip), `ppo_kl` (masked mean of `old_logp - logp`, clamped as the ratio).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip bound clip_ratio_c must be > 1, got {clip_ratio_c}")
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    ratio_clipped = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(dual_bound, ratio_clipped), ratio_clipped)
    if importance_weights is not None:
        per_token = per_token * importance_weights.detach()
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).to(logp.dtype), mask),
            "pg_clipfrac_lower": masked_mean(((ratio_clipped > dual_bound) & negative).to(logp.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }
    return per_token, metrics


def sapo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tau_positive: float,
    tau_negative: float,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO, a smooth gate in place of the clip (veRL's `compute_policy_loss_sapo`, arXiv 2511.20347).

    `r = exp(clamp(logp - old_logp, -20, 20))`, `tau = tau_positive where A > 0 else tau_negative`,
    `L = -A * sigmoid(tau * (r - 1)) * 4 / tau`. The gate's slope is `4 p (1 - p)` with
    `p = sigmoid(tau * (r - 1))`: 1 at `r = 1` (where the gradient equals PPO's, `-A * r`), decaying
    smoothly away from it (faster for larger tau). The gate's value at `r = 1` is `2 / tau`.
    Aggregate with `seq-mean-token-mean` (`FIXED_LOSS_AGG_MODES`; veRL ignores `loss_agg_mode`).

    Metrics: `ppo_kl` the token mean of the clamped `old_logp - logp`; no clipping, so
    `pg_clipfrac` and `pg_clipfrac_lower` are 0.
    """
    if tau_positive <= 0 or tau_negative <= 0:
        raise ValueError(f"SAPO temperatures must be positive, got {tau_positive} and {tau_negative}")
    valid = mask != 0
    logp, old_logp, advantages = zero_padding(valid, logp, old_logp, advantages)
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    tau = torch.full_like(advantages, tau_negative).masked_fill(advantages > 0, tau_positive)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    per_token = -gate * advantages
    with torch.no_grad():
        ppo_kl = masked_mean(-log_ratio, mask)
    return policy_loss_result(per_token, valid, importance_weights, ppo_kl=ppo_kl)


def cispo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO, clipped importance-sampling weight (veRL's `compute_policy_loss_cispo`, arXiv 2506.13585).

    `r = exp(clamp(logp - old_logp, -20, 20))`, `L = -sg(clamp(r, 1 - clip_ratio_low,
    1 + clip_ratio_high)) * A * logp`: the ratio is a detached weight, so every token keeps a
    gradient `-clamp(r) * A` through `logp` (none is zeroed by the clip, unlike PPO).

    Metrics: `pg_clipfrac` the fraction of tokens whose ratio the clamp changed, `ppo_kl` the token
    mean of the clamped `old_logp - logp`, `pg_clipfrac_lower` 0.
    """
    valid = mask != 0
    logp, old_logp, advantages = zero_padding(valid, logp, old_logp, advantages)
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = -clipped_ratio.detach() * advantages * logp
    with torch.no_grad():
        clipfrac = masked_fraction(ratio != clipped_ratio, mask, logp.dtype)
        ppo_kl = masked_mean(-log_ratio, mask)
    return policy_loss_result(per_token, valid, importance_weights, pg_clipfrac=clipfrac, ppo_kl=ppo_kl)
