"""Plain policy gradients, `-A * logp` with no ratio and no trust region: GPG, and REINFORCE, the
loss of veRL's bypass mode (`loss_type=reinforce`), whose only correction is the importance
weights it is given."""

from __future__ import annotations

import torch

from rlactors.algorithms.masked import masked_mean, zero_padding
from rlactors.algorithms.policy_losses.result import policy_loss_result


def gpg_policy_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG, plain policy gradient (veRL's `compute_policy_loss_gpg`): `L = -logp * A`.

    No ratio and no old policy (veRL's function takes `old_log_prob` and ignores it). veRL returns
    no metrics: all three are 0.
    """
    valid = mask != 0
    logp, advantages = zero_padding(valid, logp, advantages)
    return policy_loss_result(-logp * advantages, valid, importance_weights)


def reinforce_policy_loss(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE (veRL's `compute_policy_loss_reinforce`, the `bypass_mode` loss with
    `loss_type=reinforce`): `L = -A * logp`, times the detached importance weights
    (rollout-to-trainer correction, e.g. `rollout_importance_weights(logp, rollout_logp, mask, "token", cap)`).

    `rollout_logp` only feeds the metric `ppo_kl`, the token mean of `rollout_logp - logp`.
    `pg_clipfrac` and `pg_clipfrac_lower` are 0.
    """
    valid = mask != 0
    logp, rollout_logp, advantages = zero_padding(valid, logp, rollout_logp, advantages)
    with torch.no_grad():
        ppo_kl = masked_mean(rollout_logp - logp, mask)
    return policy_loss_result(-advantages * logp, valid, importance_weights, ppo_kl=ppo_kl)
