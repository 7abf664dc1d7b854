"""Rollout correction: the mismatch between the rollout engine's and the trainer's logprobs.

The maths of veRL's `verl/trainer/ppo/rollout_corr_helper.py` (0.9.1, with IcePop), on tensors.
`rollout_logp` are the rollout engine's logprobs of the sampled tokens (the behaviour policy);
`old_logp` the trainer's: the proximal policy in decoupled mode, the current policy's (detached) in
bypass mode, where veRL passes `log_prob` as `old_log_prob` to these functions. Everything works on
the log ratio `log r = old_logp - rollout_logp`, which is 0 on padding here (padding may hold -inf).

The options (levels, rejection options, veRL's string forms of the thresholds) are parsed and
checked in `rollout_correction_options`. Common to the three functions here:
  - inputs are detached; statistics are computed in float32 or wider, weights returned in the dtype
    of `old_logp`, masks in the dtype of `mask`;
  - metrics are detached 0-dim tensors keyed with veRL's names, without the `rollout_corr/` prefix;
  - like veRL, an all-padding mask raises `ValueError` (there is nothing to correct or measure);
  - exponentials are taken of log ratios clamped to [-20, 20] (veRL's `SAFETY_BOUND`), except in
    the `k3_kl` metric, which veRL leaves unclamped.
Deliberate deviation from veRL, everywhere: the K3 statistic `exp(x) - 1 - x` is computed as
`expm1(x) - x`, which is the same number without the cancellation for small `x` (float32 lost
most digits of a typical 1e-3 log ratio's K3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rlactors.algorithms.masked import LOG_RATIO_CLAMP, masked_max, masked_mean, masked_min, masked_sum
from rlactors.algorithms.rollout_correction_options import (
    IS_LEVELS,
    Threshold,
    check_importance_thresholds,
    rejection_bounds,
)


def _prepare(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old, rollout, log ratio, valid): detached, widened to float32+, 0 on padding; valid is bool."""
    if old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(
            f"shapes differ: old_logp {tuple(old_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    valid = mask != 0
    if not bool(valid.any()):
        raise ValueError("mask must select at least one response token")
    dtype = torch.promote_types(old_logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old_logp.device)
    old = torch.where(valid, old_logp.detach().to(dtype), zero)
    rollout = torch.where(valid, rollout_logp.detach().to(dtype), zero)
    return old, rollout, old - rollout, valid


def _fraction(condition: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fraction of all elements (not only response tokens) where `condition` holds."""
    return condition.to(dtype).mean()


def _std_of_clamped(x: torch.Tensor, valid: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """veRL's metric std: population std over the mask of `x` clamped to [low, high]; 0 for one token."""
    if int(valid.sum()) <= 1:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    clamped = x.clamp(min=low, max=high)
    variance = masked_mean(clamped.square(), valid) - masked_mean(clamped, valid).square()
    return variance.clamp(min=0.0).sqrt()


def _std(x: torch.Tensor) -> torch.Tensor:
    """Unbiased std of a 1-d tensor, 0 for fewer than two values (veRL's guard against NaN)."""
    return x.std() if x.numel() > 1 else torch.zeros((), dtype=x.dtype, device=x.device)


def rollout_importance_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    threshold: float,
    threshold_lower: float | None = None,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights `pi_old / pi_rollout`, truncated (TIS) or band-passed (IcePop), detached.

    veRL's `compute_rollout_correction_weights` + `compute_is_metrics` (0.9.1).
    level "token":     w_t = exp(clamp(log r_t, -20, 20))
    level "sequence":  w_t = exp(clamp(sum_s log r_s, -20, 20)) for every token of the sequence
    TIS (threshold_lower None):  w = min(w, threshold)
    IcePop:                      w = w if threshold_lower <= w <= threshold else 0
    (veRL selects IcePop with `rollout_is_threshold: "lower_upper"`; see
    `rollout_correction_options.parse_is_threshold`.)
    batch_normalize divides by the mean weight, when it exceeds 1e-8: at token level the masked
    mean over tokens, at sequence level the mean over non-empty sequences of each sequence's masked
    mean weight; the factor is reported as `rollout_is_batch_norm_factor`. Weights are 0 on padding.

    Metrics describe the weights before batch normalisation (as veRL). With IcePop,
    `rollout_is_oob_ratio` is the fraction of tokens zeroed. Deviations from veRL: normalisation is
    over this call's batch only (veRL all-reduces when torch.distributed is initialised, which is
    the case in bypass mode, not on the driver in decoupled mode); `rollout_is_eff_sample_size` is
    0, not a ZeroDivisionError, when every weight is 0.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance weight level {level!r}; expected one of {IS_LEVELS}")
    check_importance_thresholds(threshold, threshold_lower)
    _, _, log_ratio, valid = _prepare(old_logp, rollout_logp, mask)
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    seq_log_ratio = None
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    else:
        seq_log_ratio = masked_sum(log_ratio, valid, dim=-1)
        raw = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).unsqueeze(-1).expand_as(log_ratio)
    raw = torch.where(valid, raw, zero)
    if threshold_lower is None:
        weights = raw.clamp(max=threshold)
    else:
        weights = torch.where((raw >= threshold_lower) & (raw <= threshold), raw, zero)
    metrics = _importance_metrics(raw, weights, seq_log_ratio, valid, threshold, threshold_lower)
    if batch_normalize:
        weights, metrics["rollout_is_batch_norm_factor"] = _normalized_to_batch_mean(weights, valid, level)
    return weights.to(old_logp.dtype), metrics


def _importance_metrics(
    raw: torch.Tensor,
    weights: torch.Tensor,
    seq_log_ratio: torch.Tensor | None,
    valid: torch.Tensor,
    threshold: float,
    threshold_lower: float | None,
) -> dict[str, torch.Tensor]:
    """veRL's `compute_is_metrics`: the weights before and after truncation (`raw`, `weights`, 0 on
    padding) described over tokens and sequences; `seq_log_ratio` is the unclamped per-sequence sum
    of the log ratios at sequence level, None at token level."""
    dtype = weights.dtype
    zero = torch.zeros((), dtype=dtype, device=weights.device)
    lower = 1.0 / threshold if threshold_lower is None else threshold_lower
    metrics: dict[str, torch.Tensor] = {"rollout_is_mean": masked_mean(weights, valid)}
    if seq_log_ratio is not None:
        # Over every row, empty ones included (their log ratio sum is 0), from the unclamped sums.
        metrics["rollout_is_max"] = torch.exp(seq_log_ratio.max().clamp(max=LOG_RATIO_CLAMP))
        metrics["rollout_is_min"] = torch.exp(seq_log_ratio.min())
        metrics["rollout_is_ratio_fraction_high"] = _fraction(seq_log_ratio > math.log(threshold), dtype)
        metrics["rollout_is_ratio_fraction_low"] = _fraction(seq_log_ratio < math.log(lower), dtype)
    else:
        metrics["rollout_is_max"] = masked_max(weights, valid)
        metrics["rollout_is_min"] = masked_min(weights, valid)
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((raw > threshold).to(dtype), valid)
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).to(dtype), valid)
    metrics["rollout_is_std"] = _std_of_clamped(weights, valid, 0.0, threshold)
    clamped = weights.clamp(min=0.0, max=threshold)
    second_moment = masked_mean((clamped / (masked_mean(clamped, valid) + 1e-8)).square(), valid)
    metrics["rollout_is_eff_sample_size"] = torch.where(second_moment > 0, 1.0 / second_moment, zero)
    seq_mean = masked_mean(weights, valid, dim=-1)  # every row; an empty one counts as 0
    metrics["rollout_is_seq_mean"] = seq_mean.mean()
    metrics["rollout_is_seq_std"] = _std(seq_mean)
    metrics["rollout_is_seq_max"] = seq_mean.max()
    metrics["rollout_is_seq_min"] = seq_mean.min()
    metrics["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().max()
    raw_seq_mean = masked_mean(raw, valid, dim=-1)
    metrics["rollout_is_seq_fraction_high"] = _fraction(raw_seq_mean > threshold, dtype)
    metrics["rollout_is_seq_fraction_low"] = _fraction(raw_seq_mean < lower, dtype)
    if threshold_lower is not None:
        out_of_band = (raw < threshold_lower) | (raw > threshold)
        metrics["rollout_is_oob_ratio"] = masked_mean(out_of_band.to(dtype), valid)
    return metrics


def _normalized_to_batch_mean(
    weights: torch.Tensor, valid: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights / mean, mean): the mean over tokens at token level, over non-empty sequences of each
    one's mean weight at sequence level. Unchanged, with factor 1, when the mean is not above 1e-8."""
    dtype = weights.dtype
    if level == "token":
        mean = masked_mean(weights, valid)
    else:
        nonempty = valid.any(dim=-1).to(dtype)
        mean = (masked_mean(weights, valid, dim=-1) * nonempty).sum() / nonempty.sum().clamp_min(1e-8)
    if mean > 1e-8:
        return weights / mean, mean
    return weights, torch.ones((), dtype=dtype, device=weights.device)


def rollout_rejection_mask(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    options: Sequence[str],
    thresholds: Sequence[Threshold],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rejection sampling: the mask with tokens or whole sequences outside a divergence bound set to 0.

    veRL's `compute_rollout_rejection_mask` + `compute_rs_metrics` (0.9.1). With x = clamp(log r,
    -20, 20) per token: k1 = -x, k2 = x^2 / 2, k3 = exp(x) - 1 - x. Options (`REJECTION_OPTIONS`):
    `token_kN` thresholds each token, `seq_sum_kN` / `seq_mean_kN` / `seq_max_kN` the masked sum /
    mean / max over the sequence, rejecting all of it (seq_max has no k1). k1 statistics are kept
    when `log(lower) <= stat <= log(upper)`, others when `stat <= upper`. Note that k1 is the log of
    `pi_rollout / pi_old`, so (lower, upper) bound that ratio, the inverse of the IS weight (the
    band is the same only when lower = 1/upper). Options chain: a token survives only if every
    option keeps it. `thresholds[i]` is `(lower, upper)` or a number (k1: lower = 1/upper).

    Metrics, per option `rollout_rs_<option>_{mean,max,min,fraction_high,fraction_low,std,seq_mean,
    seq_std,seq_max,seq_min,seq_max_deviation,seq_fraction_high,masked_fraction,seq_masked_fraction}`
    (k1 adds `seq_fraction_low`), and overall `rollout_rs_masked_fraction` (over tokens) and
    `rollout_rs_seq_masked_fraction` (over all rows, empty ones included, as veRL).
    """
    bounds = rejection_bounds(options, thresholds)
    _, _, log_ratio, valid = _prepare(old_logp, rollout_logp, mask)
    dtype = log_ratio.dtype
    x = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_stats = {"k1": -x, "k2": 0.5 * x.square(), "k3": torch.expm1(x) - x}
    nonempty = valid.any(dim=-1)
    keep_all = valid.clone()
    metrics: dict[str, torch.Tensor] = {}
    for option, lower, upper in bounds:
        stat = token_stats[option[-2:]]
        k1 = lower is not None
        high, low = (math.log(upper), math.log(lower)) if k1 else (upper, 0.0)
        seq_stat = _sequence_statistic(option, stat, valid, nonempty)
        per_token = stat if seq_stat is None else seq_stat.unsqueeze(-1).expand_as(stat)
        keep = (per_token <= high) & (per_token >= low) if k1 else per_token <= high
        prefix = f"rollout_rs_{option}"
        metrics.update(_rejection_metrics(prefix, per_token, seq_stat, keep, valid, low, high, k1))
        keep_all &= keep

    rejected = valid & ~keep_all
    metrics["rollout_rs_masked_fraction"] = masked_mean(rejected.to(dtype), valid)
    metrics["rollout_rs_seq_masked_fraction"] = _fraction(rejected.any(dim=-1), dtype)
    return torch.where(keep_all, mask, torch.zeros_like(mask)), metrics


def _sequence_statistic(
    option: str, stat: torch.Tensor, valid: torch.Tensor, nonempty: torch.Tensor
) -> torch.Tensor | None:
    """The per-sequence statistic a `seq_*` option bounds ([batch]); None for a `token_*` option."""
    if option.startswith("token_"):
        return None
    if option.startswith("seq_sum_"):
        return masked_sum(stat, valid, dim=-1)
    if option.startswith("seq_mean_"):
        return masked_mean(stat, valid, dim=-1)
    seq_max = masked_max(stat, valid, dim=-1)
    return torch.where(nonempty, seq_max, torch.zeros_like(seq_max))  # an empty row's -inf counts as 0


def _rejection_metrics(
    prefix: str,
    per_token: torch.Tensor,
    seq_stat: torch.Tensor | None,
    keep: torch.Tensor,
    valid: torch.Tensor,
    low: float,
    high: float,
    k1: bool,
) -> dict[str, torch.Tensor]:
    """veRL's `compute_rs_metrics` for one option: its statistic (`per_token`, the sequence's value on
    each of its tokens for a `seq_*` option, whose `seq_stat` is then given) against the bounds
    [low, high], and what `keep` rejects. Sequence metrics are over non-empty rows."""
    dtype = per_token.dtype
    nonempty = valid.any(dim=-1)
    seq_values = (seq_stat if seq_stat is not None else masked_mean(per_token, valid, dim=-1))[nonempty]
    metrics = {f"{prefix}_mean": masked_mean(per_token, valid)}
    if seq_stat is not None:
        metrics[f"{prefix}_max"], metrics[f"{prefix}_min"] = seq_values.max(), seq_values.min()
        metrics[f"{prefix}_fraction_high"] = _fraction(seq_values > high, dtype)
        low_fraction = _fraction(seq_values < low, dtype)
    else:
        metrics[f"{prefix}_max"] = masked_max(per_token, valid)
        metrics[f"{prefix}_min"] = masked_min(per_token, valid)
        metrics[f"{prefix}_fraction_high"] = masked_mean((per_token > high).to(dtype), valid)
        low_fraction = masked_mean((per_token < low).to(dtype), valid)
    zero = torch.zeros((), dtype=dtype, device=per_token.device)
    metrics[f"{prefix}_fraction_low"] = low_fraction if k1 else zero  # only k1 has a lower bound
    metrics[f"{prefix}_std"] = _std_of_clamped(per_token, valid, low, high)
    metrics[f"{prefix}_seq_mean"] = seq_values.mean()
    metrics[f"{prefix}_seq_std"] = _std(seq_values)
    metrics[f"{prefix}_seq_max"] = seq_values.max()
    metrics[f"{prefix}_seq_min"] = seq_values.min()
    metrics[f"{prefix}_seq_max_deviation"] = seq_values.abs().max()
    metrics[f"{prefix}_seq_fraction_high"] = _fraction(seq_values > high, dtype)
    if k1:
        metrics[f"{prefix}_seq_fraction_low"] = _fraction(seq_values < low, dtype)
    rejected = valid & ~keep
    metrics[f"{prefix}_masked_fraction"] = masked_mean(rejected.to(dtype), valid)
    metrics[f"{prefix}_seq_masked_fraction"] = _fraction(rejected.any(dim=-1)[nonempty], dtype)
    return metrics


def off_policy_metrics(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor | None, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """veRL's `compute_offpolicy_metrics`: KL, perplexity and chi-square diagnostics.

    With m_old, m_roll the per-sequence masked mean logprobs and means over all rows (empty rows
    included, as veRL: they count as log ppl 0):
      training_ppl = mean(exp(-m_old)), training_log_ppl = mean(-m_old)  (the only two without
      `rollout_logp`), rollout_ppl / rollout_log_ppl likewise, kl = masked mean of
      rollout_logp - old_logp, k3_kl = masked mean of exp(log r) - 1 - log r (unclamped),
      log_ppl_diff{,_max,_min} = mean / max / min of m_roll - m_old, log_ppl_abs_diff = mean |.|,
      ppl_ratio = mean(exp(m_roll - m_old)), chi2_token = masked mean of exp(clamp(log r))^2 - 1,
      chi2_seq = mean(exp(2 clamp(sum log r))) - 1.
    """
    old, rollout, log_ratio, valid = _prepare(old_logp, old_logp if rollout_logp is None else rollout_logp, mask)
    mean_old = masked_mean(old, valid, dim=-1)
    metrics = {"training_ppl": torch.exp(-mean_old).mean(), "training_log_ppl": (-mean_old).mean()}
    if rollout_logp is None:
        return metrics
    mean_rollout = masked_mean(rollout, valid, dim=-1)
    log_ppl_diff = mean_rollout - mean_old
    rho = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    seq_log_ratio = masked_sum(log_ratio, valid, dim=-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics.update(
        kl=masked_mean(-log_ratio, valid),
        k3_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, valid),
        rollout_ppl=torch.exp(-mean_rollout).mean(),
        rollout_log_ppl=(-mean_rollout).mean(),
        log_ppl_diff=log_ppl_diff.mean(),
        log_ppl_abs_diff=log_ppl_diff.abs().mean(),
        log_ppl_diff_max=log_ppl_diff.max(),
        log_ppl_diff_min=log_ppl_diff.min(),
        ppl_ratio=torch.exp(log_ppl_diff).mean(),
        chi2_token=masked_mean(rho.square(), valid) - 1.0,
        chi2_seq=torch.exp(2.0 * seq_log_ratio).mean() - 1.0,
    )
    return metrics
