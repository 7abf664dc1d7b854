"""The maths of RL post-training: pure functions on tensors (torch and numpy only).

No Ray, no I/O, no config objects: every knob is an explicit argument. Tensors are
[batch, response_len], padded, with a response mask (1 on response tokens, 0 on padding); padded
positions may hold anything, even -inf. Results keep the input dtype; statistics that need it are
computed in float32 or wider. Definitions follow veRL so results compare across frameworks; every
deliberate deviation is stated in the function's docstring.

    rlactors                        veRL
    ------------------------------  ----------------------------------------------------------------
    masked_sum / masked_mean        verl.utils.torch_functional.masked_sum / masked_mean
    masked_var / masked_whiten      verl.utils.torch_functional.masked_var / masked_whiten
    gae_advantages                  core_algos.compute_gae_advantage_return
    grpo_advantages                 core_algos.compute_grpo_outcome_advantage
    rloo_advantages                 core_algos.compute_rloo_outcome_advantage
    reinforce_plus_plus_advantages  core_algos.compute_reinforce_plus_plus_outcome_advantage
    reinforce_plus_plus_baseline_advantages
                                    core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage
    opo_advantages                  core_algos.compute_opo_outcome_advantage
    gpg_advantages                  core_algos.compute_gpg_outcome_advantage (alpha = batch / #nonzero scores)
    grpo_passk_advantages           core_algos.compute_grpo_passk_outcome_advantage
    remax_advantages                core_algos.compute_remax_outcome_advantage
    rollout_importance_weights      rollout_corr_helper.compute_rollout_correction_weights + compute_is_metrics
    rollout_rejection_mask          rollout_corr_helper.compute_rollout_rejection_mask + compute_rs_metrics
    off_policy_metrics              rollout_corr_helper.compute_offpolicy_metrics
    parse_is_threshold              rollout_corr_helper._parse_rollout_is_threshold (IcePop "lower_upper")
    parse_rejection                 rollout_corr_helper._parse_rollout_rs_thresholds (+ rollout_rs parsing)
    scores_to_token_rewards         the reward manager's placement of a score on the last valid token
    aggregate_loss                  core_algos.agg_loss (global token / sequence counts, no dp_size)
    ppo_policy_loss                 core_algos.compute_policy_loss_vanilla (returns per-token loss)
    gspo_policy_loss                core_algos.compute_policy_loss_gspo (aggregate with seq-mean-token-mean)
    sapo_policy_loss                core_algos.compute_policy_loss_sapo (aggregate with seq-mean-token-mean)
    cispo_policy_loss               core_algos.compute_policy_loss_cispo
    geo_mean_policy_loss            core_algos.compute_policy_loss_geo_mean (GMPO; per-sequence loss on every token)
    gpg_policy_loss                 core_algos.compute_policy_loss_gpg
    clip_cov_policy_loss            core_algos.compute_policy_loss_clip_cov
    kl_cov_policy_loss              core_algos.compute_policy_loss_kl_cov
    dppo_tv_policy_loss             core_algos.compute_policy_loss_dppo_tv
    dppo_kl_policy_loss             core_algos.compute_policy_loss_dppo_kl
    reinforce_policy_loss           core_algos.compute_policy_loss_reinforce (bypass_mode, loss_type=reinforce)
    POLICY_LOSSES                   core_algos.get_policy_loss_fn (loss_mode name -> function)
    FIXED_LOSS_AGG_MODES            losses whose aggregation ignores loss_agg_mode in veRL
    value_loss                      core_algos.compute_value_loss (returns per-token loss)
    sft_loss                        sft trainer's masked NLL, token-mean
    bradley_terry_loss              reward model trainer's pairwise loss (-log sigmoid(chosen - rejected))
    kl_penalty                      core_algos.kl_penalty (incl. straight-through "k1+", "k3+")
    apply_kl_in_reward              ray_trainer.apply_kl_penalty
    AdaptiveKLController /          core_algos.AdaptiveKLController / FixedKLController
      FixedKLController, adaptive_kl_coef
    entropy_from_logits             verl.utils.torch_functional.entropy_from_logits
    chunked_entropy_from_logits     verl.utils.torch_functional.entropy_from_logits_with_chunking
    logprobs_from_logits            verl.utils.torch_functional.logprobs_from_logits

One policy update on a micro-batch (counts over the whole mini-batch, see `losses`):

    logp = logprobs_from_logits(logits.float(), labels, chunk_size=1024)
    pg, metrics = ppo_policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28, 3.0,
                                  importance_weights=rollout_importance_weights(old_logp, rollout_logp, mask,
                                                                                "token", 2.0)[0])
    counts = dict(global_num_tokens=n_tokens, global_num_sequences=n_sequences, norm_tokens=max_len)
    loss = aggregate_loss(pg, mask, mode, **counts)
    loss = loss + kl_coef * aggregate_loss(kl_penalty(logp, ref_logp, "low_var_kl"), mask, mode, **counts)
    loss = loss - entropy_coef * aggregate_loss(chunked_entropy_from_logits(logits), mask, mode, **counts)
    (loss * num_ranks).backward()   # FSDP averages gradients over ranks
"""

from rlactors.algorithms.advantages import (
    gae_advantages,
    gpg_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    scores_to_token_rewards,
)
from rlactors.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    adaptive_kl_coef,
    apply_kl_in_reward,
    kl_penalty,
)
from rlactors.algorithms.logits import chunked_entropy_from_logits, entropy_from_logits, logprobs_from_logits
from rlactors.algorithms.losses import (
    LOSS_AGG_MODES,
    aggregate_loss,
    bradley_terry_loss,
    num_nonempty_sequences,
    sft_loss,
    value_loss,
)
from rlactors.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlactors.algorithms.policy_losses import (
    FIXED_LOSS_AGG_MODES,
    POLICY_LOSSES,
    cispo_policy_loss,
    clip_cov_policy_loss,
    dppo_kl_policy_loss,
    dppo_tv_policy_loss,
    geo_mean_policy_loss,
    gpg_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    ppo_policy_loss,
    reinforce_policy_loss,
    sapo_policy_loss,
)
from rlactors.algorithms.rollout_correction import (
    off_policy_metrics,
    rollout_importance_weights,
    rollout_rejection_mask,
)
from rlactors.algorithms.rollout_correction_options import (
    IS_LEVELS,
    REJECTION_OPTIONS,
    parse_is_threshold,
    parse_rejection,
)

__all__ = [
    "FIXED_LOSS_AGG_MODES",
    "IS_LEVELS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "REJECTION_OPTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "adaptive_kl_coef",
    "aggregate_loss",
    "bradley_terry_loss",
    "apply_kl_in_reward",
    "chunked_entropy_from_logits",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "dppo_kl_policy_loss",
    "dppo_tv_policy_loss",
    "entropy_from_logits",
    "gae_advantages",
    "geo_mean_policy_loss",
    "gpg_advantages",
    "gpg_policy_loss",
    "grpo_advantages",
    "grpo_passk_advantages",
    "gspo_policy_loss",
    "kl_cov_policy_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "num_nonempty_sequences",
    "off_policy_metrics",
    "opo_advantages",
    "parse_is_threshold",
    "parse_rejection",
    "ppo_policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "reinforce_policy_loss",
    "remax_advantages",
    "rloo_advantages",
    "rollout_importance_weights",
    "rollout_rejection_mask",
    "sapo_policy_loss",
    "scores_to_token_rewards",
    "sft_loss",
    "value_loss",
]
