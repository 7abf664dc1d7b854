"""Losses on one importance ratio per sequence: GSPO (the exponentiated mean log ratio, clipped as
PPO's) and GMPO (the geometric mean of the token ratios, each clipped in log space)."""

from __future__ import annotations

import torch

from rlactors.algorithms.masked import masked_fraction, masked_mean, masked_sum, zero_padding
from rlactors.algorithms.policy_losses.result import policy_loss_result

GSPO_LOG_RATIO_MAX = 10.0  # veRL clamps GSPO's per-token log-ratio from above only
GMPO_WEIGHT_EPS = 1e-10  # log(w + eps) in GMPO's geometric mean of the importance weights


def gspo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO, sequence-level clipped ratio (veRL's `compute_policy_loss_gspo`, arXiv 2507.18071).

    `s_i = mean over the tokens of sequence i of (logp - old_logp)` (no clamp), then per token
    `r_t = exp(min(s_i.detach() + logp_t - logp_t.detach(), 10))`: every token of a sequence has
    the same value `exp(s_i)` and `d r_t / d logp_t = r_t`. The loss is PPO's clipped surrogate on
    `r_t`, `max(-A * r, -A * clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high))`, without dual clip.
    veRL 0.9.1 aggregates it with `loss_agg_mode`; the paper's `seq-mean-token-mean` makes the
    gradient per token the sequence-level one divided by |y_i|.

    Metrics: `pg_clipfrac` the fraction of tokens where the clipped branch is larger, `ppo_kl` the
    token mean of `old_logp - logp` (not clamped), `pg_clipfrac_lower` 0.
    """
    valid = mask != 0
    logp, old_logp, advantages = zero_padding(valid, logp, old_logp, advantages)
    log_ratio = logp - old_logp
    lengths = mask.to(logp.dtype).sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / lengths
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clipfrac = masked_fraction(clipped > unclipped, mask, logp.dtype)
        ppo_kl = masked_mean(-log_ratio, mask)
    return policy_loss_result(per_token, valid, importance_weights, pg_clipfrac=clipfrac, ppo_kl=ppo_kl)


def geo_mean_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO, geometric mean of the clipped token ratios (veRL's `compute_policy_loss_geo_mean`,
    arXiv 2507.20673).

    Per token `d = logp - old_logp` (no clamp) is clipped pessimistically in log space:
    `d' = sign(A) * min(sign(A) * d, sign(A) * clamp(d, -clip_ratio_low, clip_ratio_high))` (only the
    upper bound binds where A > 0, only the lower one where A < 0, and d' = 0 where A = 0). Per
    sequence `R_i = exp(sum d' / (|y_i| + 1e-8))`, the geometric mean of the clipped ratios,
    `Abar_i = sum A / (|y_i| + 1e-8)` and `L_i = -Abar_i * R_i`. Importance weights enter as their
    geometric mean over the sequence, `exp(sum log(w + 1e-10) / (|y_i| + 1e-8))`, multiplying `L_i`.

    The returned matrix holds `L_i` on every token of sequence i; aggregate it with
    `seq-mean-token-mean` (`FIXED_LOSS_AGG_MODES`; veRL ignores `loss_agg_mode`). veRL takes
    `torch.mean` over all rows; here rows with no response token do not count (deviation: the loss
    does not depend on micro-batch filler; equal to veRL when no row is all padding, up to the
    relative 1e-8 of the token mean).

    Metrics: `pg_clipfrac` / `pg_clipfrac_lower` the fractions of tokens with A > 0 / A < 0 whose
    `d` lies outside [-clip_ratio_low, clip_ratio_high], `ppo_kl` the token mean of `old_logp - logp`.
    """
    valid = mask != 0
    logp, old_logp, advantages = zero_padding(valid, logp, old_logp, advantages)
    log_ratio = logp - old_logp
    sign = torch.sign(advantages)
    bounded = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * bounded)
    seq_ratio = torch.exp(masked_mean(clipped_log_ratio, mask, dim=-1))
    seq_loss = -masked_mean(advantages, mask, dim=-1) * seq_ratio
    if importance_weights is not None:
        log_weights = torch.log(importance_weights.detach() + GMPO_WEIGHT_EPS)
        seq_loss = seq_loss * torch.exp(masked_mean(log_weights, mask, dim=-1))
    per_token = seq_loss.unsqueeze(-1).expand_as(logp)
    with torch.no_grad():
        outside = log_ratio != bounded
        clipfrac = masked_fraction(outside & (advantages > 0), mask, logp.dtype)
        clipfrac_lower = masked_fraction(outside & (advantages < 0), mask, logp.dtype)
        ppo_kl = masked_mean(-log_ratio, mask)
    return policy_loss_result(per_token, valid, None, clipfrac, clipfrac_lower, ppo_kl)
