"""Clip-Cov and KL-Cov (arXiv 2505.22617): the paper finds the policy's entropy falls with the
covariance of a token's advantage and logprob, so these losses treat a few high-covariance tokens
apart, Clip-Cov by removing their gradient, KL-Cov by adding a KL penalty on them. Both select over
this call's tokens, as veRL (the selection depends on the micro-batch split)."""

from __future__ import annotations

import torch

from rlactors.algorithms.masked import masked_fraction, masked_mean, zero_padding
from rlactors.algorithms.policy_losses.result import policy_loss_result


def clip_cov_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_cov_ratio: float,
    clip_cov_lower: float,
    clip_cov_upper: float,
    importance_weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (veRL's `compute_policy_loss_clip_cov`, arXiv 2505.22617): PPO's clipped surrogate
    with the gradient of a few high-covariance tokens removed.

    `r = exp(logp - old_logp)` (no clamp), surrogate `max(-A * r, -A * clamp(r, 1 - clip_ratio_low,
    1 + clip_ratio_high))` (no dual clip). Per token `cov = (A - mean A) * (logp - mean logp)`, means
    over this call's tokens (as veRL, per micro-batch: the selection depends on the split). Among
    the tokens not already clipped by the ratio with `clip_cov_lower < cov < clip_cov_upper`,
    `max(int(clip_cov_ratio * num_tokens), 1)` are drawn uniformly at random (`torch.randperm`
    with `generator`, on the CPU as veRL unless the generator lives elsewhere) and their loss is
    set to 0, so they get no gradient.

    Metrics: `pg_clipfrac` the fraction of tokens so removed (not the ratio clip), `ppo_kl` the
    token mean of `old_logp - logp`, `pg_clipfrac_lower` 0.
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be positive, got {clip_cov_ratio}")
    valid = mask != 0
    logp, old_logp, advantages = zero_padding(valid, logp, old_logp, advantages)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, mask)) * (logp - masked_mean(logp, mask))
        candidates = valid & ~(clipped > unclipped) & (cov > clip_cov_lower) & (cov < clip_cov_upper)
        positions = torch.nonzero(candidates)
        if len(positions) > 0:
            num_clip = max(int(clip_cov_ratio * mask.sum().item()), 1)
            device = generator.device if generator is not None else torch.device("cpu")
            order = torch.randperm(len(positions), generator=generator, device=device).to(positions.device)
            positions = positions[order[:num_clip]]
        removed = torch.zeros_like(valid)
        removed[positions[:, 0], positions[:, 1]] = True
        clipfrac = masked_fraction(removed, mask, logp.dtype)
        ppo_kl = masked_mean(-log_ratio, mask)
    per_token = torch.where(removed, torch.zeros_like(unclipped), torch.maximum(unclipped, clipped))
    return policy_loss_result(per_token, valid, importance_weights, pg_clipfrac=clipfrac, ppo_kl=ppo_kl)


def kl_cov_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kl_cov_ratio: float,
    ppo_kl_coef: float,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (veRL's `compute_policy_loss_kl_cov`, arXiv 2505.22617): the unclipped surrogate
    `-A * r` (`r = exp(logp - old_logp)`, no clamp, no clip) plus `ppo_kl_coef * |logp - old_logp|`
    on the top `max(1, int(kl_cov_ratio * num_tokens))` tokens by `cov = (A - mean A) *
    (logp - mean logp)`. Means and the top-k are over this call's tokens (as veRL, per micro-batch).

    Metrics: `ppo_kl` is veRL's value for this loss, the token mean of `|logp - old_logp|` (abs-KL,
    not the signed KL of the other losses); `pg_clipfrac` and `pg_clipfrac_lower` are 0.
    """
    if not 0 < kl_cov_ratio <= 1:
        raise ValueError(f"kl_cov_ratio must be in (0, 1], got {kl_cov_ratio}")
    valid = mask != 0
    logp, old_logp, advantages = zero_padding(valid, logp, old_logp, advantages)
    log_ratio = logp - old_logp
    abs_kl = log_ratio.abs()
    surrogate = -advantages * torch.exp(log_ratio)
    with torch.no_grad():
        flat_positions = torch.nonzero(valid.reshape(-1)).squeeze(-1)
        penalised = torch.zeros_like(valid)
        if len(flat_positions) > 0:
            token_adv = advantages.reshape(-1)[flat_positions]
            token_logp = logp.reshape(-1)[flat_positions]
            cov = (token_adv - token_adv.mean()) * (token_logp - token_logp.mean())
            num_penalised = max(1, int(len(flat_positions) * kl_cov_ratio))
            top = torch.topk(cov, num_penalised, largest=True).indices
            penalised.view(-1)[flat_positions[top]] = True
        ppo_kl = masked_mean(abs_kl, mask)
    per_token = torch.where(penalised, surrogate + ppo_kl_coef * abs_kl, surrogate)
    return policy_loss_result(per_token, valid, importance_weights, ppo_kl=ppo_kl)
