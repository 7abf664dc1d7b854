"""Every policy loss, and `POLICY_LOSSES`, the registry a trainer dispatches on (veRL's `loss_mode`).

Each function equals veRL's (`verl/trainer/ppo/core_algos.py`, `compute_policy_loss_<name>`) and
has one contract:

    per_token, metrics = fn(logp, old_logp, advantages, mask, <hyperparameters>, importance_weights=None)

`per_token` is the [batch, response_len] loss matrix (aggregate it with `losses.aggregate_loss`);
`metrics` holds exactly `pg_clipfrac`, `pg_clipfrac_lower` and `ppo_kl`, detached 0-dim tensors
computed over this call's mask (0 where veRL reports 0 or nothing). `importance_weights` (e.g.
`rollout_importance_weights`, veRL's `rollout_is_weights`) multiply the per-token loss and
are detached. `gpg_policy_loss` takes no `old_logp`, `reinforce_policy_loss` the rollout's logprobs
in its place.

Deviations shared by all functions but `ppo_policy_loss`: padded positions of the inputs are ignored
(replaced by 0 before any arithmetic, so -inf or NaN there never reaches a result or a gradient) and
padded positions of `per_token` are 0 (`result.policy_loss_result`); veRL leaves whatever the
arithmetic gives there (its aggregation ignores it). `ppo_policy_loss` is veRL's arithmetic as is:
its `per_token` holds NaN on padding where the logprobs there are -inf, which `aggregate_loss`
ignores, in the value and in the gradient.

Aggregation: veRL 0.9.1 aggregates most of these with the configured `loss_agg_mode` (GSPO too; its
paper's setting is `seq-mean-token-mean`), but SAPO always uses `seq-mean-token-mean` and GMPO
(`geo_mean`) one loss per sequence averaged over rows.
`FIXED_LOSS_AGG_MODES` lists those: the trainer must aggregate them with that mode whatever
`loss_agg_mode` says.

One module per family:

    token_ratio      ppo_policy_loss (vanilla), sapo_policy_loss, cispo_policy_loss: a per-token
                     ratio, clipped, gated or used as a clipped weight
    sequence_ratio   gspo_policy_loss, geo_mean_policy_loss (GMPO): one ratio per sequence
    covariance       clip_cov_policy_loss, kl_cov_policy_loss: the tokens with the largest
                     advantage-logprob covariance are treated apart
    dppo             dppo_tv_policy_loss, dppo_kl_policy_loss: a band on a divergence of the
                     sampled token's probability, with a truncated weight
    policy_gradient  gpg_policy_loss, reinforce_policy_loss: `-A * logp`, no trust region
    result           the ending shared by all but PPO: weights, zeroed padding, the three metrics
"""

from __future__ import annotations

from rlactors.algorithms.policy_losses.covariance import clip_cov_policy_loss, kl_cov_policy_loss
from rlactors.algorithms.policy_losses.dppo import dppo_kl_policy_loss, dppo_tv_policy_loss
from rlactors.algorithms.policy_losses.policy_gradient import gpg_policy_loss, reinforce_policy_loss
from rlactors.algorithms.policy_losses.sequence_ratio import geo_mean_policy_loss, gspo_policy_loss
from rlactors.algorithms.policy_losses.token_ratio import cispo_policy_loss, ppo_policy_loss, sapo_policy_loss

# veRL `policy_loss.loss_mode` -> function. REINFORCE is veRL's `bypass_mode` with
# `loss_type=reinforce`, not a loss mode, so it is not listed.
POLICY_LOSSES = {
    "vanilla": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "sapo": sapo_policy_loss,
    "cispo": cispo_policy_loss,
    "geo_mean": geo_mean_policy_loss,
    "gpg": gpg_policy_loss,
    "clip_cov": clip_cov_policy_loss,
    "kl_cov": kl_cov_policy_loss,
    "dppo_tv": dppo_tv_policy_loss,
    "dppo_kl": dppo_kl_policy_loss,
}

# Losses veRL aggregates with a fixed mode whatever `loss_agg_mode` says: the trainer must pass
# this mode to `aggregate_loss` for them (with the mini-batch's global counts).
FIXED_LOSS_AGG_MODES = {
    "sapo": "seq-mean-token-mean",
    "geo_mean": "seq-mean-token-mean",
}

__all__ = [
    "FIXED_LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "dppo_kl_policy_loss",
    "dppo_tv_policy_loss",
    "geo_mean_policy_loss",
    "gpg_policy_loss",
    "gspo_policy_loss",
    "kl_cov_policy_loss",
    "ppo_policy_loss",
    "reinforce_policy_loss",
    "sapo_policy_loss",
]
