"""Policy losses beyond PPO: GSPO, SAPO, CISPO, GMPO, GPG, Clip-Cov, KL-Cov, DPPO and REINFORCE.

Each function equals veRL's (`verl/trainer/ppo/core_algos.py`, `compute_policy_loss_<name>`) and
has one contract, so that a trainer can dispatch on veRL's `loss_mode` name (`POLICY_LOSSES`):

    per_token, metrics = fn(logp, old_logp, advantages, mask, <hyperparameters>, importance_weights=None)

`per_token` is the [batch, response_len] loss matrix (aggregate it with `losses.aggregate_loss`);
`metrics` holds exactly `pg_clipfrac`, `pg_clipfrac_lower` and `ppo_kl`, detached 0-dim tensors
computed over this call's mask (0 where veRL reports 0 or nothing). `importance_weights` (e.g.
`rollout_importance_weights`, veRL's `rollout_is_weights`) multiply the per-token loss and
are detached.

Deviations shared by all functions: padded positions of the inputs are ignored (replaced by 0 before
any arithmetic, so -inf or NaN there never reaches a result or a gradient) and padded positions of
`per_token` are 0; veRL leaves whatever the arithmetic gives there (its aggregation ignores it).

Aggregation: veRL 0.9.1 aggregates most of these with the configured `loss_agg_mode` (GSPO too; its
paper's setting is `seq-mean-token-mean`), but SAPO always uses `seq-mean-token-mean` and GMPO
(`geo_mean`) one loss per sequence averaged over rows.
`FIXED_LOSS_AGG_MODES` lists those: the trainer must aggregate them with that mode whatever
`loss_agg_mode` says.
"""

from __future__ import annotations

import torch

from rlactors.algorithms.losses import ppo_policy_loss
from rlactors.algorithms.masked import LOG_RATIO_CLAMP, masked_mean, masked_sum

GSPO_LOG_RATIO_MAX = 10.0  # veRL clamps GSPO's per-token log-ratio from above only
GMPO_WEIGHT_EPS = 1e-10  # log(w + eps) in GMPO's geometric mean of the importance weights
DPPO_KL_EPS = 1e-8  # inside the log of DPPO's binary KL


def _on_tokens(x: torch.Tensor, valid: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """`x` on response tokens, `fill` on padding (selected, so -inf there leaks into nothing)."""
    return torch.where(valid, x, torch.full((), fill, dtype=x.dtype, device=x.device))


def _clean(valid: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [_on_tokens(t, valid) for t in tensors]


def _fraction(condition: torch.Tensor, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return masked_mean(condition.to(like.dtype), mask)


def _finish(per_token, valid, importance_weights, pg_clipfrac=None, pg_clipfrac_lower=None, ppo_kl=None):
    """Apply the detached weights, zero the padding and fill the metrics veRL does not report with 0."""
    if importance_weights is not None:
        per_token = per_token * _on_tokens(importance_weights.detach(), valid)
    per_token = _on_tokens(per_token, valid)
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    values = {"pg_clipfrac": pg_clipfrac, "pg_clipfrac_lower": pg_clipfrac_lower, "ppo_kl": ppo_kl}
    metrics = {name: (zero if value is None else value).detach() for name, value in values.items()}
    return per_token, metrics


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
    logp, old_logp, advantages = _clean(valid, logp, old_logp, advantages)
    log_ratio = logp - old_logp
    lengths = mask.to(logp.dtype).sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / lengths
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clipfrac = _fraction(clipped > unclipped, mask, logp)
        ppo_kl = masked_mean(-log_ratio, mask)
    return _finish(per_token, valid, importance_weights, pg_clipfrac=clipfrac, ppo_kl=ppo_kl)


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
    logp, old_logp, advantages = _clean(valid, logp, old_logp, advantages)
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    tau = torch.full_like(advantages, tau_negative).masked_fill(advantages > 0, tau_positive)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    per_token = -gate * advantages
    with torch.no_grad():
        ppo_kl = masked_mean(-log_ratio, mask)
    return _finish(per_token, valid, importance_weights, ppo_kl=ppo_kl)


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
    logp, old_logp, advantages = _clean(valid, logp, old_logp, advantages)
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = -clipped_ratio.detach() * advantages * logp
    with torch.no_grad():
        clipfrac = _fraction(ratio != clipped_ratio, mask, logp)
        ppo_kl = masked_mean(-log_ratio, mask)
    return _finish(per_token, valid, importance_weights, pg_clipfrac=clipfrac, ppo_kl=ppo_kl)


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
    logp, old_logp, advantages = _clean(valid, logp, old_logp, advantages)
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
        clipfrac = _fraction(outside & (advantages > 0), mask, logp)
        clipfrac_lower = _fraction(outside & (advantages < 0), mask, logp)
        ppo_kl = masked_mean(-log_ratio, mask)
    return _finish(per_token, valid, None, clipfrac, clipfrac_lower, ppo_kl)


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
    logp, advantages = _clean(valid, logp, advantages)
    return _finish(-logp * advantages, valid, importance_weights)


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
    logp, rollout_logp, advantages = _clean(valid, logp, rollout_logp, advantages)
    with torch.no_grad():
        ppo_kl = masked_mean(rollout_logp - logp, mask)
    return _finish(-advantages * logp, valid, importance_weights, ppo_kl=ppo_kl)


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
    logp, old_logp, advantages = _clean(valid, logp, old_logp, advantages)
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
        clipfrac = _fraction(removed, mask, logp)
        ppo_kl = masked_mean(-log_ratio, mask)
    per_token = torch.where(removed, torch.zeros_like(unclipped), torch.maximum(unclipped, clipped))
    return _finish(per_token, valid, importance_weights, pg_clipfrac=clipfrac, ppo_kl=ppo_kl)


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
    logp, old_logp, advantages = _clean(valid, logp, old_logp, advantages)
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
    return _finish(per_token, valid, importance_weights, ppo_kl=ppo_kl)


def _dppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    truncation_cap: float,
    importance_weights: torch.Tensor | None,
    in_band,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if truncation_cap <= 0:
        raise ValueError(f"DPPO truncation cap must be positive, got {truncation_cap}")
    valid = mask != 0
    logp, old_logp, advantages = _clean(valid, logp, old_logp, advantages)
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
    return _finish(per_token, valid, importance_weights, clipfrac, clipfrac_lower, ppo_kl)


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
