"""DPPO (arXiv 2602.04879): a truncated importance weight in place of PPO's dual clip, and a band on
a divergence of the sampled token's probability from the old policy in place of the ratio clip.
The two variants differ only in that divergence (`_dppo_loss` holds what they share)."""

from __future__ import annotations

import torch

from rlactors.algorithms.masked import LOG_RATIO_CLAMP, masked_mean, zero_padding
from rlactors.algorithms.policy_losses.result import policy_loss_result

DPPO_KL_EPS = 1e-8  # inside the log of DPPO's binary KL


def _dppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    truncation_cap: float,
    importance_weights: torch.Tensor | None,
    in_band,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and metrics both DPPO variants share. `in_band(prob, old_prob, logp, old_logp,
    positive)` says, per token, whether its divergence stayed in the band (`positive` is A > 0);
    it runs without gradient, so `keep` is a detached 0/1 factor."""
    if truncation_cap <= 0:
        raise ValueError(f"DPPO truncation cap must be positive, got {truncation_cap}")
    valid = mask != 0
    logp, old_logp, advantages = zero_padding(valid, logp, old_logp, advantages)
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        prob, old_prob = torch.exp(logp), torch.exp(old_logp)
        keep = in_band(prob, old_prob, logp, old_logp, advantages > 0).to(logp.dtype)
        truncated_ratio = torch.clamp(ratio, max=truncation_cap)
        clipfrac = masked_mean(1.0 - keep, mask)
        clipfrac_lower = masked_mean((ratio > truncation_cap).to(logp.dtype) * keep, mask)
        ppo_kl = masked_mean(-log_ratio, mask)
    per_token = -advantages * truncated_ratio * logp * keep
    return policy_loss_result(per_token, valid, importance_weights, clipfrac, clipfrac_lower, ppo_kl)


def dppo_tv_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_divergence_low: float,
    clip_divergence_high: float,
    truncation_cap: float,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV (veRL's `compute_policy_loss_dppo_tv`, arXiv 2602.04879).

    `L = -A * sg(min(r, truncation_cap)) * logp * keep`, `r = exp(clamp(logp - old_logp, -20, 20))`:
    a truncated importance weight in place of the dual clip (veRL's `clip_ratio_c`) and a detached
    0/1 `keep` dropping tokens whose divergence from the old policy left the band in the direction
    the advantage pushes. Here the divergence is the change `p - p_old` of the sampled token's
    probability: where A > 0 keep `p - p_old <= clip_divergence_high`, elsewhere keep
    `p - p_old >= -clip_divergence_low`. The thresholds bound a divergence, not the ratio (veRL
    reads them from `clip_ratio_low` / `clip_ratio_high`).

    Metrics: `pg_clipfrac` the fraction of tokens dropped, `pg_clipfrac_lower` the fraction of
    tokens kept with `r > truncation_cap`, `ppo_kl` the token mean of the clamped `old_logp - logp`.
    """

    def keep(prob, old_prob, logp, old_logp, positive):
        change = prob - old_prob
        return torch.where(positive, change <= clip_divergence_high, change >= -clip_divergence_low)

    return _dppo_loss(logp, old_logp, advantages, mask, truncation_cap, importance_weights, keep)


def dppo_kl_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_divergence_low: float,
    clip_divergence_high: float,
    truncation_cap: float,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL (veRL's `compute_policy_loss_dppo_kl`, arXiv 2602.04879).

    As `dppo_tv_policy_loss` (same loss, truncation and metrics) with the band on the binary KL of
    the sampled token, `KL = p_old * (logp_old - logp) + (1 - p_old) * log((1 - p_old + 1e-8) /
    (1 - p + 1e-8))`: where A > 0 keep `KL <= clip_divergence_high or p <= p_old`, elsewhere keep
    `KL <= clip_divergence_low or p >= p_old`.
    """

    def keep(prob, old_prob, logp, old_logp, positive):
        log_term = torch.log((1.0 - old_prob + DPPO_KL_EPS) / (1.0 - prob + DPPO_KL_EPS))
        binary_kl = old_prob * (old_logp - logp) + (1 - old_prob) * log_term
        keep_positive = (binary_kl <= clip_divergence_high) | (prob <= old_prob)
        keep_negative = (binary_kl <= clip_divergence_low) | (prob >= old_prob)
        return torch.where(positive, keep_positive, keep_negative)

    return _dppo_loss(logp, old_logp, advantages, mask, truncation_cap, importance_weights, keep)
