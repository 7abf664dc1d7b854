import math

import pytest
import torch

from rlactors.algorithms.rollout_correction import (
    off_policy_metrics,
    rollout_importance_weights,
    rollout_rejection_mask,
)
from rlactors.algorithms.rollout_correction_options import (
    REJECTION_OPTIONS,
    parse_is_threshold,
    parse_rejection,
)

LN2 = math.log(2.0)


def _pair(log_ratios, lengths=None):
    """(old_logp, rollout_logp, mask) with old - rollout = log_ratios; padding (past `lengths`) is -inf."""
    log_ratio = torch.tensor(log_ratios, dtype=torch.float64)
    rollout = torch.full_like(log_ratio, -1.5)
    old = rollout + log_ratio
    mask = torch.ones_like(log_ratio, dtype=torch.long)
    for row, length in enumerate(lengths or []):
        mask[row, length:] = 0
    old, rollout = old.masked_fill(mask == 0, -math.inf), rollout.masked_fill(mask == 0, -math.inf)
    return old, rollout, mask


def _random_batch(seed, scale=0.4, batch=7, length=9):
    """Random float64 logprobs, ragged lengths (one empty row), finite random padding."""
    gen = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(batch, length, generator=gen, dtype=torch.float64)
    rollout = old + scale * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[2] = 0
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return old, rollout, mask


def _with_inf_padding(*tensors_and_mask):
    *tensors, mask = tensors_and_mask
    return [t.masked_fill(mask == 0, -math.inf) for t in tensors] + [mask]


def _floats(metrics):
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    return {k: v.item() for k, v in metrics.items()}


def _assert_metrics_match(ours, reference):
    assert set(ours) == set(reference)
    for key, value in reference.items():
        assert math.isclose(ours[key], value, rel_tol=1e-6, abs_tol=1e-12), (key, ours[key], value)


# ---------------------------------------------------------------------------------------------------
# veRL 0.9.1 (verl/trainer/ppo/rollout_corr_helper.py), transcribed literally for comparison.


def _vf_masked_sum(values, mask, axis=None):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def _vf_masked_mean(values, mask, axis=None):
    return _vf_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def _verl_parse_is_threshold(spec):
    if isinstance(spec, int | float):
        upper, lower = float(spec), None
    elif "_" in spec.strip():
        lower_str, upper_str = spec.strip().split("_", 1)
        lower, upper = float(lower_str), float(upper_str)
    else:
        upper, lower = float(spec.strip()), None
    return upper, lower


def _verl_is_metrics(weights, raw, log_ratio_for_metrics, response_mask, rollout_is, upper, lower):
    metrics = {}
    lower = 1.0 / upper if lower is None else lower
    log_upper, log_lower = torch.log(torch.tensor(upper)), torch.log(torch.tensor(lower))
    if rollout_is == "sequence":
        metrics["rollout_is_max"] = torch.exp(torch.clamp(log_ratio_for_metrics.max(), max=20.0)).item()
        metrics["rollout_is_min"] = torch.exp(log_ratio_for_metrics.min()).item()
        metrics["rollout_is_mean"] = _vf_masked_mean(weights, response_mask).item()
        metrics["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > log_upper).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < log_lower).float().mean().item()
    else:
        metrics["rollout_is_mean"] = _vf_masked_mean(weights, response_mask).item()
        metrics["rollout_is_ratio_fraction_high"] = _vf_masked_mean(
            (raw > upper).float(), response_mask
        ).item()
        metrics["rollout_is_ratio_fraction_low"] = _vf_masked_mean(
            (raw < lower).float(), response_mask
        ).item()
        mask_bool = response_mask.bool()
        metrics["rollout_is_max"] = weights.masked_fill(~mask_bool, float("-inf")).max().item()
        metrics["rollout_is_min"] = weights.masked_fill(~mask_bool, float("inf")).min().item()
    if response_mask.sum() > 1:
        w = weights.clamp(min=0.0, max=upper)
        var = _vf_masked_mean(w.square(), response_mask) - _vf_masked_mean(w, response_mask).square()
        metrics["rollout_is_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        metrics["rollout_is_std"] = 0.0
    w = weights.clamp(min=0.0, max=upper)
    normalized = w / (_vf_masked_mean(w, response_mask) + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / _vf_masked_mean(normalized.square(), response_mask).item()
    seq_mean = _vf_masked_mean(weights, response_mask, axis=-1)
    metrics["rollout_is_seq_mean"] = seq_mean.mean().item()
    metrics["rollout_is_seq_std"] = seq_mean.std().item() if seq_mean.numel() > 1 else 0.0
    metrics["rollout_is_seq_max"] = seq_mean.max().item()
    metrics["rollout_is_seq_min"] = seq_mean.min().item()
    metrics["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().max().item()
    raw_seq_mean = _vf_masked_mean(raw, response_mask, axis=-1)
    metrics["rollout_is_seq_fraction_high"] = (raw_seq_mean > upper).float().mean().item()
    metrics["rollout_is_seq_fraction_low"] = (raw_seq_mean < lower).float().mean().item()
    return metrics


def _verl_compute_rollout_correction_weights(
    log_ratio, response_mask, rollout_is, threshold, batch_normalize
):
    upper, lower = _verl_parse_is_threshold(threshold)
    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    else:
        log_ratio_sum = _vf_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        log_ratio_for_metrics = log_ratio_sum
        raw = torch.exp(torch.clamp(log_ratio_sum, min=-20.0, max=20.0)).expand_as(log_ratio)
    raw = raw * response_mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _verl_is_metrics(weights, raw, log_ratio_for_metrics, response_mask, rollout_is, upper, lower)
    if lower is not None:
        oob = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = _vf_masked_mean(oob.float(), response_mask).item()
    weights = weights.detach()
    if batch_normalize:
        if rollout_is == "token":
            mean = _vf_masked_mean(weights, response_mask)
        else:
            seq_weights = _vf_masked_mean(weights, response_mask, axis=-1)
            seq_mask = (response_mask.sum(dim=-1) > 0).to(dtype=weights.dtype)
            mean = (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _verl_parse_rs_thresholds(options, spec):
    raw = [str(spec)] if isinstance(spec, int | float) else [p.strip() for p in spec.split(",") if p.strip()]
    raw = raw * len(options) if len(raw) == 1 else raw
    out = {}
    for option, s in zip(options, raw, strict=True):
        if option.endswith("k1"):
            lower_str, upper_str = s.split("_", 1) if "_" in s else (str(1.0 / float(s)), s)
            out[option] = {"lower": float(lower_str), "upper": float(upper_str)}
        else:
            out[option] = {"lower": None, "upper": float(s)}
    return out


def _verl_rs_metrics(option, stat, response_mask, seq_valid, level, per_seq, upper, lower, apply_lower):
    m, p, mask_bool = {}, f"rollout_rs_{option}", response_mask.bool()
    seq_values = per_seq if per_seq is not None else _vf_masked_mean(stat, response_mask, axis=-1)
    sv = seq_values[seq_valid]
    m[f"{p}_mean"] = _vf_masked_mean(stat, response_mask).item()
    if level == "sequence" and sv.numel() > 0:
        m[f"{p}_max"], m[f"{p}_min"] = sv.max().item(), sv.min().item()
        high = (sv > upper).float().mean().item()
        low = (sv < lower).float().mean().item() if apply_lower else 0.0
    else:
        m[f"{p}_max"] = stat.masked_fill(~mask_bool, float("-inf")).max().item()
        m[f"{p}_min"] = stat.masked_fill(~mask_bool, float("inf")).min().item()
        high = _vf_masked_mean((stat > upper).float(), response_mask).item()
        low = _vf_masked_mean((stat < lower).float(), response_mask).item() if apply_lower else 0.0
    m[f"{p}_fraction_high"], m[f"{p}_fraction_low"] = high, low
    if response_mask.sum() > 1:
        s = stat.clamp(min=lower if apply_lower else 0.0, max=upper)
        var = _vf_masked_mean(s.square(), response_mask) - _vf_masked_mean(s, response_mask).square()
        m[f"{p}_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        m[f"{p}_std"] = 0.0
    m[f"{p}_seq_mean"] = sv.mean().item()
    m[f"{p}_seq_std"] = sv.std().item() if sv.numel() > 1 else 0.0
    m[f"{p}_seq_max"], m[f"{p}_seq_min"] = sv.max().item(), sv.min().item()
    m[f"{p}_seq_max_deviation"] = (sv - 0.0).abs().max().item()
    m[f"{p}_seq_fraction_high"] = (sv > upper).float().mean().item()
    if apply_lower:
        m[f"{p}_seq_fraction_low"] = (sv < lower).float().mean().item()
    return m


def _verl_compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold):
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    specs = _verl_parse_rs_thresholds(options, rollout_rs_threshold)
    safe = torch.clamp(log_ratio, min=-20.0, max=20.0)
    token_k = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    mask_bool, seq_valid = response_mask.bool(), response_mask.sum(dim=-1) > 0
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics = {}

    def seq_max(values):
        neg_inf = torch.tensor(float("-inf"), dtype=values.dtype)
        mx = values.masked_fill(~mask_bool, neg_inf).max(dim=-1).values
        return torch.where(mx == neg_inf, torch.zeros_like(mx), mx)

    for option in options:
        k1, upper, lower = option.endswith("k1"), specs[option]["upper"], specs[option]["lower"]
        lower_log, upper_log = (math.log(lower), math.log(upper)) if k1 else (None, None)
        stat, per_seq = token_k[option[-2:]], None
        if option.startswith("token"):
            per_token = stat
            keep = (stat >= lower_log) & (stat <= upper_log) if k1 else stat <= upper
        else:
            if option.startswith("seq_sum"):
                per_seq = _vf_masked_sum(stat, response_mask, axis=-1)
            elif option.startswith("seq_mean"):
                per_seq = _vf_masked_mean(stat, response_mask, axis=-1)
            else:
                per_seq = seq_max(stat)
            seq_keep = (per_seq >= lower_log) & (per_seq <= upper_log) if k1 else per_seq <= upper
            keep = seq_keep.unsqueeze(-1).expand_as(mask_bool)
            per_token = per_seq.unsqueeze(-1).expand_as(response_mask)
        level = "token" if option.startswith("token") else "sequence"
        m_upper, m_lower = (upper_log, lower_log) if k1 else (upper, 0.0)
        keep_mask = keep.to(dtype=log_ratio.dtype)
        combined = combined * keep_mask
        seq_keep_t = (~((~keep) & mask_bool)).all(dim=-1)
        metrics.update(
            _verl_rs_metrics(
                option, per_token, response_mask, seq_valid, level, per_seq, m_upper, m_lower, k1
            )
        )
        metrics[f"rollout_rs_{option}_masked_fraction"] = _vf_masked_mean(1 - keep_mask, response_mask).item()
        sv = seq_valid.float()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            ((1.0 - seq_keep_t.to(log_ratio.dtype)) * sv).sum() / sv.sum()
        ).item()
    metrics["rollout_rs_masked_fraction"] = _vf_masked_mean(1 - combined, response_mask).item()
    final_keep = (combined > 0.5) & mask_bool
    metrics["rollout_rs_seq_masked_fraction"] = (~final_keep & mask_bool).any(dim=-1).float().mean().item()
    return (response_mask * combined).to(dtype=response_mask.dtype), metrics


def _verl_compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    m = {}
    mean_train = _vf_masked_mean(old_log_prob, response_mask, axis=-1)
    m["training_ppl"] = torch.exp(-mean_train).mean().item()
    m["training_log_ppl"] = (-mean_train).mean().item()
    m["kl"] = _vf_masked_mean(rollout_log_prob - old_log_prob, response_mask).item()
    log_ratio = old_log_prob - rollout_log_prob
    m["k3_kl"] = _vf_masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item()
    mean_rollout = _vf_masked_mean(rollout_log_prob, response_mask, axis=-1)
    m["rollout_ppl"] = torch.exp(-mean_rollout).mean().item()
    m["rollout_log_ppl"] = (-mean_rollout).mean().item()
    diff = mean_rollout - mean_train
    m["log_ppl_diff"], m["log_ppl_abs_diff"] = diff.mean().item(), diff.abs().mean().item()
    m["log_ppl_diff_max"], m["log_ppl_diff_min"] = diff.max().item(), diff.min().item()
    m["ppl_ratio"] = torch.exp(diff).mean().item()
    rho = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    m["chi2_token"] = (_vf_masked_mean(rho.square(), response_mask) - 1.0).item()
    seq_sum = torch.clamp(_vf_masked_sum(log_ratio, response_mask, axis=-1), min=-20.0, max=20.0)
    m["chi2_seq"] = (torch.exp(2.0 * seq_sum).mean() - 1.0).item()
    return m


# ---------------------------------------------------------------------------------------------------
# Importance weights


def test_token_tis_hand_computed():
    # log r = log 3, log 0.4, 0, log 1.5 -> raw weights 3, 0.4, 1, 1.5; capped at 2 -> 2, 0.4, 1, 1.5.
    old, rollout, mask = _pair([[math.log(3.0), math.log(0.4), 0.0, math.log(1.5)]])
    weights, metrics = rollout_importance_weights(old, rollout, mask, "token", 2.0)
    assert torch.allclose(weights, torch.tensor([[2.0, 0.4, 1.0, 1.5]], dtype=torch.float64))
    m = _floats(metrics)
    assert m["rollout_is_mean"] == pytest.approx(4.9 / 4)  # (2 + 0.4 + 1 + 1.5) / 4
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(0.25)  # the raw 3 > 2
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(0.25)  # 0.4 < 1/2
    assert (m["rollout_is_max"], m["rollout_is_min"]) == pytest.approx((2.0, 0.4))
    # E[w^2] = (4 + 0.16 + 1 + 2.25) / 4 = 1.8525, E[w]^2 = 1.225^2 = 1.500625
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(1.8525 - 1.500625))
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1.500625 / 1.8525)  # E[w]^2 / E[w^2]
    assert m["rollout_is_seq_mean"] == pytest.approx(1.225)  # one sequence
    assert m["rollout_is_seq_fraction_high"] == 0.0  # raw sequence mean (3 + 0.4 + 1 + 1.5) / 4 < 2
    assert "rollout_is_oob_ratio" not in m and "rollout_is_batch_norm_factor" not in m


def test_token_icepop_hand_computed():
    # Band [0.5, 2]: the raw 3 and 0.4 are zeroed, 1 and 1.5 kept unchanged.
    old, rollout, mask = _pair([[math.log(3.0), math.log(0.4), 0.0, math.log(1.5)]])
    weights, metrics = rollout_importance_weights(old, rollout, mask, "token", 2.0, threshold_lower=0.5)
    assert torch.allclose(weights, torch.tensor([[0.0, 0.0, 1.0, 1.5]], dtype=torch.float64))
    m = _floats(metrics)
    assert m["rollout_is_oob_ratio"] == pytest.approx(0.5)
    assert (m["rollout_is_max"], m["rollout_is_min"]) == pytest.approx((1.5, 0.0))
    assert m["rollout_is_mean"] == pytest.approx(2.5 / 4)


def test_sequence_weights_and_batch_normalisation_hand_computed():
    # Row 0: log r = log 2 + log 1.5 -> weight 3, capped at 2 on both tokens.
    # Row 1: log r = log 0.5 on its one token -> weight 0.5; padding -> 0.
    old, rollout, mask = _pair([[LN2, math.log(1.5)], [-LN2, 7.0]], lengths=[2, 1])
    weights, metrics = rollout_importance_weights(old, rollout, mask, "sequence", 2.0)
    assert torch.allclose(weights, torch.tensor([[2.0, 2.0], [0.5, 0.0]], dtype=torch.float64))
    m = _floats(metrics)
    assert math.isclose(m["rollout_is_max"], 3.0, rel_tol=1e-6)  # from the unclamped sequence ratio
    assert math.isclose(m["rollout_is_min"], 0.5, rel_tol=1e-6)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)  # one sequence of two above 2
    # Sequence normalisation: mean over sequences of (2, 0.5) = 1.25 -> 1.6 and 0.4.
    normed, metrics = rollout_importance_weights(old, rollout, mask, "sequence", 2.0, batch_normalize=True)
    assert torch.allclose(normed, torch.tensor([[1.6, 1.6], [0.4, 0.0]], dtype=torch.float64))
    assert math.isclose(metrics["rollout_is_batch_norm_factor"].item(), 1.25, rel_tol=1e-6)
    # Token level: weights 2, 1.5, 0.5, normalised by their mean over the 3 tokens, 4 / 3.
    normed, metrics = rollout_importance_weights(old, rollout, mask, "token", 2.0, batch_normalize=True)
    assert torch.allclose(normed, torch.tensor([[1.5, 1.125], [0.375, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_weights_never_exceed_the_cap_and_icepop_is_a_band(seed, level):
    old, rollout, mask = _random_batch(seed, scale=0.8 if level == "token" else 0.2)
    valid = mask.bool()
    log_ratio = torch.where(valid, old - rollout, 0.0)
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-20, 20))
    else:
        raw = torch.exp(log_ratio.sum(-1, keepdim=True).clamp(-20, 20)).expand_as(log_ratio)
    tis, _ = rollout_importance_weights(old, rollout, mask, level, 1.5)
    assert (tis <= 1.5).all() and (tis[~valid] == 0).all()
    assert torch.allclose(tis[valid], raw[valid].clamp(max=1.5))
    ice, _ = rollout_importance_weights(old, rollout, mask, level, 1.5, threshold_lower=0.7)
    inside = valid & (raw >= 0.7) & (raw <= 1.5)
    assert (ice[~inside] == 0).all() and torch.equal(ice[inside], raw[inside])
    assert inside.any() and (valid & ~inside).any()  # both branches exercised


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalised_weights_have_mean_one(seed, level):
    old, rollout, mask = _random_batch(seed)
    weights, metrics = rollout_importance_weights(old, rollout, mask, level, 2.0, batch_normalize=True)
    valid = mask.bool()
    if level == "token":
        mean = weights[valid].mean()
    else:
        nonempty = valid.any(-1)
        mean = torch.stack([weights[i][valid[i]].mean() for i in range(len(mask)) if nonempty[i]]).mean()
        for i in range(len(mask)):  # constant within each sequence
            assert torch.allclose(weights[i][valid[i]], weights[i][valid[i]][:1].expand(int(valid[i].sum())))
    assert math.isclose(mean.item(), 1.0, rel_tol=1e-6)
    assert metrics["rollout_is_batch_norm_factor"].item() > 0


def test_all_zero_icepop_weights_are_not_normalised():
    old, rollout, mask = _pair([[math.log(5.0), math.log(6.0)]])
    weights, metrics = rollout_importance_weights(old, rollout, mask, "token", 2.0, 0.5, batch_normalize=True)
    assert (weights == 0).all()
    assert metrics["rollout_is_batch_norm_factor"].item() == pytest.approx(1.0)
    assert metrics["rollout_is_eff_sample_size"].item() == pytest.approx(0.0)  # veRL divides by zero here


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "0.5_2.0", "0.3_1.5"])
@pytest.mark.parametrize("batch_normalize", [False, True])
def test_importance_weights_match_verl(seed, level, threshold, batch_normalize):
    old, rollout, mask = _random_batch(seed)
    ref_weights, ref_metrics = _verl_compute_rollout_correction_weights(
        old - rollout, mask, level, threshold, batch_normalize
    )
    upper, lower = parse_is_threshold(threshold)
    for o, r, msk in ((old, rollout, mask), _with_inf_padding(old, rollout, mask)):
        weights, metrics = rollout_importance_weights(o, r, msk, level, upper, lower, batch_normalize)
        assert torch.allclose(weights, ref_weights, rtol=1e-6, atol=1e-12)
        _assert_metrics_match(_floats(metrics), ref_metrics)


def test_importance_weights_are_detached_and_padding_never_nan():
    old, rollout, mask = _with_inf_padding(*_random_batch(0))
    old, rollout = old.requires_grad_(True), rollout.requires_grad_(True)
    for level in ("token", "sequence"):
        weights, metrics = rollout_importance_weights(old, rollout, mask, level, 2.0, 0.5, True)
        assert not weights.requires_grad and not weights.isnan().any()
        assert not any(v.requires_grad or v.isnan() for v in metrics.values())


def test_importance_weights_keep_dtype_and_compute_wide():
    old, rollout, mask = _random_batch(0)
    weights, metrics = rollout_importance_weights(old.bfloat16(), rollout.bfloat16(), mask, "token", 2.0)
    assert weights.dtype == torch.bfloat16
    assert metrics["rollout_is_mean"].dtype == torch.float32


def test_parse_is_threshold_follows_verl():
    assert parse_is_threshold(2.0) == (2.0, None)
    assert parse_is_threshold(" 3 ") == (3.0, None)
    assert parse_is_threshold("0.5_2.0") == (2.0, 0.5)
    for bad in ("2.0_0.5", "0_2", "-1", "", "a_b"):
        with pytest.raises(ValueError):
            parse_is_threshold(bad)
    with pytest.raises(TypeError):
        parse_is_threshold(True)


def test_importance_weight_argument_errors():
    old, rollout, mask = _pair([[0.0]])
    with pytest.raises(ValueError):
        rollout_importance_weights(old, rollout, mask, "geometric", 2.0)
    with pytest.raises(ValueError):
        rollout_importance_weights(old, rollout, mask, "token", 0.0)
    with pytest.raises(ValueError):
        rollout_importance_weights(old, rollout, mask, "token", 2.0, threshold_lower=3.0)
    with pytest.raises(ValueError):
        rollout_importance_weights(old, rollout, torch.zeros_like(mask), "token", 2.0)


# ---------------------------------------------------------------------------------------------------
# Rejection masks


def test_token_rejection_hand_computed():
    # token_k1 with (0.5, 4): keeps log 0.5 <= -log r <= log 4, i.e. pi_rollout / pi_old in [0.5, 4]:
    #   r = 3 -> rollout/old = 1/3 < 0.5, rejected; r = 0.3 -> 3.33, kept; r = 1 kept; r = 2.5 -> 0.4, rejected.
    old, rollout, mask = _pair([[math.log(3.0), math.log(0.3), 0.0, math.log(2.5)]])
    new_mask, metrics = rollout_rejection_mask(old, rollout, mask, ["token_k1"], [(0.5, 4.0)])
    assert new_mask.tolist() == [[0, 1, 1, 0]] and new_mask.dtype == mask.dtype
    m = _floats(metrics)
    assert m["rollout_rs_token_k1_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_rs_token_k1_fraction_low"] == pytest.approx(
        0.5
    )  # -log 3 and -log 2.5 are below log 0.5
    assert m["rollout_rs_token_k1_fraction_high"] == pytest.approx(0.0)
    assert m["rollout_rs_token_k1_seq_masked_fraction"] == pytest.approx(1.0)
    assert math.isclose(m["rollout_rs_token_k1_max"], -math.log(0.3), rel_tol=1e-9)
    # token_k2 at 0.1 on log r = 0.3, -0.5, 0: k2 = 0.045, 0.125, 0 -> the middle token is rejected.
    old, rollout, mask = _pair([[0.3, -0.5, 0.0]])
    new_mask, metrics = rollout_rejection_mask(old, rollout, mask, ["token_k2"], [0.1])
    assert new_mask.tolist() == [[1, 0, 1]]
    assert math.isclose(metrics["rollout_rs_token_k2_mean"].item(), (0.045 + 0.125) / 3, rel_tol=1e-6)


def test_sequence_rejection_and_chaining_hand_computed():
    # Row 0: log r = 0.3, -0.5 -> k3 = 0.049859, 0.106531: sum 0.15639, mean 0.078195, max 0.106531.
    # Row 1: log r = 0.1 (then padding) -> k3 = 0.0051709.
    old, rollout, mask = _pair([[0.3, -0.5], [0.1, 9.0]], lengths=[2, 1])
    expect = {"seq_sum_k3": 0.15639, "seq_mean_k3": 0.078195, "seq_max_k3": 0.106531}
    for option, (threshold, kept_row0) in {
        "seq_sum_k3": (0.15, False),
        "seq_mean_k3": (0.08, True),
        "seq_max_k3": (0.1, False),
    }.items():
        new_mask, metrics = rollout_rejection_mask(old, rollout, mask, [option], [threshold])
        assert new_mask.tolist() == [[int(kept_row0)] * 2, [1, 0]], option
        assert math.isclose(metrics[f"rollout_rs_{option}_seq_max"].item(), expect[option], rel_tol=1e-4)
    # seq_mean_k1 (geometric mean of pi_rollout / pi_old): row 0 exp(0.1) = 1.105, row 1 exp(-0.1) = 0.905.
    new_mask, _ = rollout_rejection_mask(old, rollout, mask, ["seq_mean_k1"], [(0.95, 1.2)])
    assert new_mask.tolist() == [[1, 1], [0, 0]]
    # Chained: row 0 falls to seq_max_k3 at 0.1, row 1 to seq_mean_k1 -> nothing is left.
    new_mask, metrics = rollout_rejection_mask(
        old, rollout, mask, ["seq_max_k3", "seq_mean_k1"], [0.1, (0.95, 1.2)]
    )
    assert new_mask.tolist() == [[0, 0], [0, 0]]
    assert metrics["rollout_rs_masked_fraction"].item() == pytest.approx(1.0)
    assert metrics["rollout_rs_seq_masked_fraction"].item() == pytest.approx(1.0)


def _statistic(option, log_ratio, valid):
    """The option's statistic per token (sequence options broadcast), computed row by row."""
    x = log_ratio.clamp(-20, 20)
    token = {"k1": -x, "k2": 0.5 * x**2, "k3": torch.exp(x) - 1 - x}[option[-2:]]
    if option.startswith("token"):
        return token
    rows = []
    for i in range(len(x)):
        values = token[i][valid[i]]
        if values.numel() == 0:
            rows.append(0.0)
        else:
            rows.append(
                {"sum": values.sum(), "mean": values.mean(), "max": values.max()}[option.split("_")[1]]
            )
    return torch.tensor(rows, dtype=x.dtype)[:, None].expand_as(x)


OPTION_THRESHOLDS = {
    "token_k1": (0.8, 1.3),
    "token_k2": 0.05,
    "token_k3": 0.05,
    "seq_sum_k1": (0.5, 2.0),
    "seq_sum_k2": 0.3,
    "seq_sum_k3": 0.3,
    "seq_mean_k1": (0.95, 1.1),
    "seq_mean_k2": 0.06,
    "seq_mean_k3": 0.06,
    "seq_max_k2": 0.15,
    "seq_max_k3": 0.15,
}


@pytest.mark.parametrize("option", REJECTION_OPTIONS)
def test_each_option_masks_exactly_what_lies_beyond_its_threshold(option):
    old, rollout, mask = _random_batch(3)
    valid = mask.bool()
    stat = _statistic(option, torch.where(valid, old - rollout, 0.0), valid)
    threshold = OPTION_THRESHOLDS[option]
    if isinstance(threshold, tuple):
        keep = (stat >= math.log(threshold[0])) & (stat <= math.log(threshold[1]))
    else:
        keep = stat <= threshold
    new_mask, _ = rollout_rejection_mask(old, rollout, mask, [option], [threshold])
    assert torch.equal(new_mask.bool(), valid & keep)
    assert (valid & ~keep).any() and (valid & keep).any()  # the threshold cuts this batch


def test_chained_options_mask_the_union():
    old, rollout, mask = _random_batch(4)
    options = ["token_k2", "seq_mean_k1", "seq_max_k3"]
    thresholds = [OPTION_THRESHOLDS[o] for o in options]
    chained, metrics = rollout_rejection_mask(old, rollout, mask, options, thresholds)
    expected = mask.bool()
    for option, threshold in zip(options, thresholds, strict=True):
        single, _ = rollout_rejection_mask(old, rollout, mask, [option], [threshold])
        expected &= single.bool()
    assert torch.equal(chained.bool(), expected)
    rejected = mask.sum() - expected.sum()
    assert math.isclose(
        metrics["rollout_rs_masked_fraction"].item(), (rejected / mask.sum()).item(), rel_tol=1e-6
    )


VERL_RS_CASES = [
    ("token_k1", "0.8_1.3"),
    ("token_k1", 1.3),  # lower = 1/1.3
    ("token_k2", 0.05),
    ("token_k3", "0.05"),
    ("seq_sum_k1", "0.5_2.0"),
    ("seq_sum_k2,seq_sum_k3", "0.3"),  # one threshold shared by both
    ("seq_mean_k1", "0.95_1.1"),
    ("seq_mean_k2, seq_mean_k3", "0.06,0.05"),
    ("seq_max_k2,seq_max_k3", 0.15),
    ("token_k1,seq_mean_k3,seq_max_k2,token_k1", "0.8_1.3,0.06,0.15"),  # the duplicate is dropped
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("options", "thresholds"), VERL_RS_CASES)
def test_rejection_matches_verl(seed, options, thresholds):
    old, rollout, mask = _random_batch(seed)
    ref_mask, ref_metrics = _verl_compute_rollout_rejection_mask(old - rollout, mask, options, thresholds)
    names, parsed = parse_rejection(options, thresholds)
    for o, r, msk in ((old, rollout, mask), _with_inf_padding(old, rollout, mask)):
        new_mask, metrics = rollout_rejection_mask(o, r, msk, names, parsed)
        assert torch.equal(new_mask, ref_mask)
        _assert_metrics_match(_floats(metrics), ref_metrics)


def test_rejection_is_detached_and_padding_never_nan():
    old, rollout, mask = _with_inf_padding(*_random_batch(1))
    old = old.requires_grad_(True)
    new_mask, metrics = rollout_rejection_mask(
        old, rollout, mask.bool(), *parse_rejection("token_k1,seq_sum_k3", "2,1")
    )
    assert new_mask.dtype == torch.bool and not (new_mask & ~mask.bool()).any()
    assert not any(v.requires_grad or v.isnan() for v in metrics.values())


def test_parse_rejection_follows_verl():
    assert parse_rejection("token_k1, seq_mean_k3,token_k1", "0.5_2.0,0.01") == (
        ["token_k1", "seq_mean_k3"],
        [(0.5, 2.0), 0.01],
    )
    assert parse_rejection("seq_sum_k2,seq_max_k3", 0.2) == (["seq_sum_k2", "seq_max_k3"], [0.2, 0.2])
    with pytest.raises(ValueError):
        parse_rejection("token_k2", "0.1_0.2")  # only k1 takes a pair
    with pytest.raises(ValueError):
        parse_rejection("token_k1,token_k2", "1,2,3")
    with pytest.raises(ValueError):
        parse_rejection("token_k2", None)


def test_rejection_argument_errors():
    old, rollout, mask = _pair([[0.0, 0.1]])
    for options, thresholds in [
        (["seq_max_k1"], [2.0]),  # not a veRL option
        (["token_k2"], [(0.1, 0.2)]),
        (["token_k1"], [(2.0, 0.5)]),  # lower > upper
        (["token_k3"], [-1.0]),
        (["token_k2", "token_k2"], [0.1, 0.1]),
        (["token_k2"], []),
    ]:
        with pytest.raises(ValueError):
            rollout_rejection_mask(old, rollout, mask, options, thresholds)
    with pytest.raises(TypeError):
        rollout_rejection_mask(old, rollout, mask, "token_k2", [0.1])


# ---------------------------------------------------------------------------------------------------
# Off-policy metrics


def test_off_policy_metrics_hand_computed():
    # old = log 0.5, log 0.25; rollout = log 0.25, log 0.25 -> log r = log 2, 0.
    old = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    rollout = torch.full_like(old, math.log(0.25))
    m = _floats(off_policy_metrics(old, rollout, torch.ones_like(old)))
    expected = {
        "kl": -LN2 / 2,  # mean(rollout - old)
        "k3_kl": (2 - 1 - LN2) / 2,  # mean(r - 1 - log r)
        "training_ppl": 2**1.5,  # exp(-(log 0.5 + log 0.25) / 2)
        "training_log_ppl": 1.5 * LN2,
        "rollout_ppl": 4.0,
        "rollout_log_ppl": 2 * LN2,
        "log_ppl_diff": -LN2 / 2,  # mean rollout logp - mean old logp
        "log_ppl_abs_diff": LN2 / 2,
        "log_ppl_diff_max": -LN2 / 2,
        "log_ppl_diff_min": -LN2 / 2,
        "ppl_ratio": 2**-0.5,
        "chi2_token": (4 + 1) / 2 - 1,  # mean(r^2) - 1
        "chi2_seq": 3.0,  # (2 * 1)^2 - 1
    }
    _assert_metrics_match(m, expected)
    only_training = _floats(off_policy_metrics(old, None, torch.ones_like(old)))
    assert set(only_training) == {"training_ppl", "training_log_ppl"}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_off_policy_metrics_match_verl(seed):
    old, rollout, mask = _random_batch(seed)
    reference = _verl_compute_offpolicy_metrics(old, rollout, mask)
    for o, r, msk in ((old, rollout, mask), _with_inf_padding(old, rollout, mask)):
        _assert_metrics_match(_floats(off_policy_metrics(o.requires_grad_(True), r, msk)), reference)
