"""The actor's objective on one micro-batch (`actor_loss`): the policy term, `algorithm.policy_loss`
(or bypass mode's own loss), plus the KL term and minus the entropy bonus, each aggregated with
the mini-batch's global counts.

Decoupled rollout correction arrives as the batch's `importance_weights` field (computed over the
whole batch by the batch builder); bypass mode compares the current policy with the rollout's here,
micro-batch by micro-batch, as veRL's `compute_policy_loss_bypass_mode` does.
"""

from __future__ import annotations

from collections.abc import Container

import torch

from rlactors.algorithms import (
    FIXED_LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    chunked_entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_sum,
    parse_rejection,
    ppo_policy_loss,
    reinforce_policy_loss,
    rollout_importance_weights,
    rollout_rejection_mask,
)
from rlactors.config import AlgorithmConfig, RolloutCorrectionConfig
from rlactors.trainer.batch import IMPORTANCE_WEIGHTS, ROLLOUT_LOGPROBS, MicroBatch

# Per-token metrics every policy loss returns (means over the call's mask).
POLICY_METRICS = ("ppo_kl", "pg_clipfrac", "pg_clipfrac_lower")
# Bypass mode's metrics (token means too), named as veRL's under `rollout_corr/`.
BYPASS_METRICS = ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction")


def actor_fields(algorithm: AlgorithmConfig, token_fields: Container[str], from_update: bool) -> list[str]:
    """The batch's token fields `actor_loss` reads: `old_logprobs` unless bypass mode or
    `from_update` stand others in for them; the advantages; the rollout logprobs in those two cases
    (bypass mode's old logprobs, `from_update`'s gap to measure); the importance weights where the
    batch has them (decoupled rollout correction); the reference logprobs where the KL term is on."""
    bypass = algorithm.rollout_correction.bypass_mode
    return ["old_logprobs"] * (not from_update and not bypass) + ["advantages"] + \
        [ROLLOUT_LOGPROBS] * (from_update or bypass) + [IMPORTANCE_WEIGHTS] * (IMPORTANCE_WEIGHTS in token_fields) + \
        ["ref_logprobs"] * algorithm.use_kl_loss


def actor_loss(algorithm: AlgorithmConfig, logits: torch.Tensor, micro: MicroBatch, counts: dict, from_update: bool
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the actor's mini-batch loss from its response `logits`, and its
    metrics as `policy_loss`'s sums plus `kl_loss` and the token-weighted `entropy`.

    `from_update`: the batch has no old logprobs; the update's own, detached, stand in for them,
    and the gap to the rollout's is measured (`rollout_trainer_kl`, `rollout_logprob_abs_diff_max`).
    The entropy's graph is kept only when its bonus trains."""
    fields, mask = micro.fields, micro.mask
    logp = logprobs_from_logits(logits, micro.labels)
    old = logp.detach() if from_update else fields.get("old_logprobs")
    loss, sums = policy_loss(algorithm, logp, old, fields.get(ROLLOUT_LOGPROBS), fields["advantages"], mask,
                             fields.get(IMPORTANCE_WEIGHTS), counts)
    if from_update:
        gap = (fields[ROLLOUT_LOGPROBS] - old) * mask
        sums |= {"rollout_trainer_kl": gap.sum(), "rollout_logprob_abs_diff_max": gap.abs().max(),
                 "rollout_logprob_abs_diff_mean": gap.abs().sum()}
    if algorithm.use_kl_loss:
        kl = aggregate_loss(kl_penalty(logp, fields["ref_logprobs"], algorithm.kl_loss_type), mask,
                            algorithm.loss_agg_mode, **counts)
        loss = loss + algorithm.kl_loss_coef * kl
        sums["kl_loss"] = kl
    with torch.set_grad_enabled(algorithm.entropy_coef != 0 and torch.is_grad_enabled()):
        entropy = chunked_entropy_from_logits(logits)
        if algorithm.entropy_coef != 0:
            loss = loss - algorithm.entropy_coef * aggregate_loss(entropy, mask, algorithm.loss_agg_mode, **counts)
    sums["entropy"] = masked_sum(entropy.detach(), mask)
    return loss, sums


def loss_parameters(algorithm: AlgorithmConfig) -> tuple:
    """The config values `algorithm.policy_loss`'s function takes after its tensors, in order."""
    a = algorithm
    clip = (a.clip_ratio_low, a.clip_ratio_high)
    return {
        "vanilla": (*clip, a.clip_ratio_c),
        "gspo": clip,
        "sapo": (a.tau_positive, a.tau_negative),
        "cispo": clip,
        "geo_mean": clip,
        "gpg": (),
        "clip_cov": (*clip, a.clip_cov_ratio, a.clip_cov_lower, a.clip_cov_upper),
        "kl_cov": (a.kl_cov_ratio, a.ppo_kl_coef),
        "dppo_tv": (*clip, a.clip_ratio_c),  # divergence bounds and the truncation cap, as veRL reads them
        "dppo_kl": (*clip, a.clip_ratio_c),
    }[a.policy_loss]


def per_token_policy_loss(algorithm: AlgorithmConfig, logp: torch.Tensor, old_logp: torch.Tensor,
                          advantages: torch.Tensor, mask: torch.Tensor, importance_weights: torch.Tensor | None
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`algorithm.policy_loss` per token (`algorithms.POLICY_LOSSES`), with its parameters from the
    config. GPG takes no old logprobs. Clip-Cov draws from torch's default generator, seeded per rank
    and saved in the trainer's checkpoints."""
    name = algorithm.policy_loss
    tensors = (logp, advantages, mask) if name == "gpg" else (logp, old_logp, advantages, mask)
    return POLICY_LOSSES[name](*tensors, *loss_parameters(algorithm), importance_weights=importance_weights)


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
