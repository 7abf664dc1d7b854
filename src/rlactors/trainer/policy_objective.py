"""The policy term of the actor's update: `algorithm.policy_loss` (or bypass mode's own loss) on one
micro-batch, aggregated with the mini-batch's global counts.

Decoupled rollout correction arrives as the batch's `importance_weights` field (computed over the
whole batch by the batch builder); bypass mode compares the current policy with the rollout's here,
micro-batch by micro-batch, as veRL's `compute_policy_loss_bypass_mode` does.
"""

from __future__ import annotations

import torch

from rlactors.algorithms import (
    FIXED_LOSS_AGG_MODES,
    aggregate_loss,
    cispo_policy_loss,
    clip_cov_policy_loss,
    dppo_kl_policy_loss,
    dppo_tv_policy_loss,
    geo_mean_policy_loss,
    gpg_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    parse_rejection,
    ppo_policy_loss,
    reinforce_policy_loss,
    rollout_importance_weights,
    rollout_rejection_mask,
    sapo_policy_loss,
)
from rlactors.config import AlgorithmConfig, RolloutCorrectionConfig

# Per-token metrics every policy loss returns (means over the call's mask).
POLICY_METRICS = ("ppo_kl", "pg_clipfrac", "pg_clipfrac_lower")
# Bypass mode's metrics (token means too), named as veRL's under `rollout_corr/`.
BYPASS_METRICS = ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction")


def per_token_policy_loss(algorithm: AlgorithmConfig, logp: torch.Tensor, old_logp: torch.Tensor,
                          advantages: torch.Tensor, mask: torch.Tensor, importance_weights: torch.Tensor | None
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`algorithm.policy_loss` per token, with its parameters from the config. Clip-Cov draws from
    torch's default generator, seeded per rank and saved in the trainer's checkpoints."""
    a, name = algorithm, algorithm.policy_loss
    weights = dict(importance_weights=importance_weights)
    if name == "vanilla":
        return ppo_policy_loss(logp, old_logp, advantages, mask, a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c,
                               **weights)
    if name == "gspo":
        return gspo_policy_loss(logp, old_logp, advantages, mask, a.clip_ratio_low, a.clip_ratio_high, **weights)
    if name == "sapo":
        return sapo_policy_loss(logp, old_logp, advantages, mask, a.tau_positive, a.tau_negative, **weights)
    if name == "cispo":
        return cispo_policy_loss(logp, old_logp, advantages, mask, a.clip_ratio_low, a.clip_ratio_high, **weights)
    if name == "geo_mean":
        return geo_mean_policy_loss(logp, old_logp, advantages, mask, a.clip_ratio_low, a.clip_ratio_high, **weights)
    if name == "gpg":
        return gpg_policy_loss(logp, advantages, mask, **weights)
    if name == "clip_cov":
        return clip_cov_policy_loss(logp, old_logp, advantages, mask, a.clip_ratio_low, a.clip_ratio_high,
                                    a.clip_cov_ratio, a.clip_cov_lower, a.clip_cov_upper, **weights)
    if name == "kl_cov":
        return kl_cov_policy_loss(logp, old_logp, advantages, mask, a.kl_cov_ratio, a.ppo_kl_coef, **weights)
    if name == "dppo_tv":
        return dppo_tv_policy_loss(logp, old_logp, advantages, mask, a.clip_ratio_low, a.clip_ratio_high,
                                   a.clip_ratio_c, **weights)
    if name == "dppo_kl":
        return dppo_kl_policy_loss(logp, old_logp, advantages, mask, a.clip_ratio_low, a.clip_ratio_high,
                                   a.clip_ratio_c, **weights)
    raise ValueError(f"unknown algorithm.policy_loss {name!r}")


def policy_loss(algorithm: AlgorithmConfig, logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, importance_weights: torch.Tensor | None, counts: dict
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the mini-batch's policy loss, and its metrics as token-weighted
    sums (`POLICY_METRICS`, and `BYPASS_METRICS` in bypass mode) beside `pg_loss`.

    In bypass mode `old_logp` is ignored: the rollout's logprobs are the old ones, and rejected tokens
    leave this micro-batch's mask (the normaliser stays the mini-batch's count, as in veRL)."""
    correction = algorithm.rollout_correction
    sums: dict[str, torch.Tensor] = {}
    if correction.bypass_mode:
        loss_mask, weights, sums = bypass_correction(logp.detach(), rollout_logp, mask, correction)
        if correction.loss_type == "reinforce":
            per_token, stats = reinforce_policy_loss(logp, rollout_logp, advantages, loss_mask, importance_weights=weights)
        else:  # PPO's ratio against the rollout policy is the correction: no weights on top
            per_token, stats = ppo_policy_loss(logp, rollout_logp, advantages, loss_mask, algorithm.clip_ratio_low,
                                               algorithm.clip_ratio_high, algorithm.clip_ratio_c)
        mode = algorithm.loss_agg_mode
    else:
        loss_mask = mask
        per_token, stats = per_token_policy_loss(algorithm, logp, old_logp, advantages, mask, importance_weights)
        mode = FIXED_LOSS_AGG_MODES.get(algorithm.policy_loss, algorithm.loss_agg_mode)
    pg_loss = aggregate_loss(per_token, loss_mask, mode, **counts)
    sums |= {"pg_loss": pg_loss, **{key: stats[key] * loss_mask.sum() for key in POLICY_METRICS}}
    return pg_loss, sums


def bypass_correction(current_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                      correction: RolloutCorrectionConfig) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Bypass mode's rejection mask, importance weights of the current policy against the rollout's,
    and their token-weighted sums (divided by the mini-batch's tokens: a rejected token counts as
    weight 0 in the mean weight)."""
    kept = mask.to(current_logp.dtype)
    if not mask.any():  # an empty filler micro-batch (ranks run the same count): nothing to weigh
        return kept, None, {key: kept.sum() for key in BYPASS_METRICS}
    if correction.rejection is not None:
        options, thresholds = parse_rejection(correction.rejection, correction.rejection_threshold)
        kept, _ = rollout_rejection_mask(current_logp, rollout_logp, mask, options, thresholds)
        kept = kept.to(current_logp.dtype) * mask
    weights = None
    if correction.importance_level is not None:
        weights, _ = rollout_importance_weights(current_logp, rollout_logp, mask, correction.importance_level,
                                                correction.importance_threshold,
                                                correction.importance_threshold_lower, correction.batch_normalize)
    selected = mask != 0
    sums = {
        "rollout_corr/rollout_is_mean": (torch.where(kept != 0, weights, 0.0).sum() if weights is not None
                                         else kept.sum()),
        "rollout_corr/rollout_rs_masked_fraction": (selected & (kept == 0)).sum().to(current_logp.dtype),
    }
    return kept, weights, sums
