import math

import pytest
import torch

from rlactors.algorithms import aggregate_loss, ppo_policy_loss
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
    reinforce_policy_loss,
    sapo_policy_loss,
)

LN2 = math.log(2.0)
METRIC_KEYS = {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def close(x, expected, rel=1e-6):
    x = x.detach() if torch.is_tensor(x) else x
    return math.isclose(float(x), expected, rel_tol=rel, abs_tol=1e-12)


# ---------------------------------------------------------------------------------------------
# veRL 0.9.1 (verl/trainer/ppo/core_algos.py), transcribed literally with the config replaced by
# arguments and `global_batch_info` left empty. Each returns (scalar loss, {metric: float}).
# ---------------------------------------------------------------------------------------------


def _verl_masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def _verl_masked_mean(values, mask, axis=None):
    return _verl_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def _verl_agg_loss(loss_mat, loss_mask, loss_agg_mode):
    if loss_agg_mode == "token-mean":
        return _verl_masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        return _verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        return _verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    raise ValueError(loss_agg_mode)


def _metrics(**values):
    return {k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in values.items()}


def _verl_gspo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, w, clip_ratio_low, clip_ratio_high
):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if w is not None:
        pg_losses = pg_losses * w
    pg_loss = _verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    pg_clipfrac = _verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=0.0)


def _verl_sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, w, tau_pos, tau_neg):
    tau_pos = torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device)

    def gate_function(x, tau):
        return torch.sigmoid(tau * (x - 1.0)) * (4.0 / tau)

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(condition=advantages > 0, input=tau_pos, other=tau_neg)
    pg_losses = -gate_function(ratio, taus) * advantages
    if w is not None:
        pg_losses = pg_losses * w
    pg_loss = _verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, _metrics(pg_clipfrac=0.0, ppo_kl=ppo_kl, pg_clipfrac_lower=0.0)


def _verl_cispo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, w, clip_ratio_low, clip_ratio_high
):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = _verl_masked_mean((ratio != clipped_ratio).float(), response_mask)
    if w is not None:
        pg_losses = pg_losses * w
    pg_loss = _verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=0.0)


def _verl_geo_mean(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, w, cliprange_low, cliprange_high
):
    negative_approx_kl = log_prob - old_log_prob
    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = torch.min(
        sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp
    )
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    if w is not None:
        seq_is_weights = torch.exp(
            (torch.log(w + 1e-10) * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
        )
        pg_losses = pg_losses * seq_is_weights
    pg_loss = torch.mean(pg_losses)
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    pg_clipfrac = _verl_masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = _verl_masked_mean((clipped * (advantages < 0)).float(), response_mask)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


def _verl_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, w):
    pg_losses = -log_prob * advantages
    if w is not None:
        pg_losses = pg_losses * w
    return _verl_agg_loss(pg_losses, response_mask, loss_agg_mode), {}


def _verl_reinforce(rollout_log_prob, log_prob, advantages, response_mask, loss_agg_mode, w):
    pg_losses = -advantages * log_prob * w if w is not None else -advantages * log_prob
    pg_loss = _verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    kl_divergence = _verl_masked_mean(-(log_prob - rollout_log_prob), response_mask)
    return pg_loss, _metrics(ppo_kl=kl_divergence)


def _verl_clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, w, cliprange_low, cliprange_high,
                   clip_cov_ratio, clip_cov_lb, clip_cov_ub):  # fmt: skip
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - _verl_masked_mean(advantages, response_mask)) * (
        log_prob - _verl_masked_mean(log_prob.detach(), response_mask)
    )
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), device=cov_all.device, dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_clipfrac = _verl_masked_mean((corr == 0).float(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    if w is not None:
        pg_losses = pg_losses * w
    pg_loss = _verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl)


def _verl_kl_cov(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, w, kl_cov_ratio, ppo_kl_coef
):
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    ppo_kl_abs = _verl_masked_mean(negative_approx_kl.abs(), response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    k = min(kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            rows, cols = large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
            pg_losses[rows, cols] = pg_losses_kl[rows, cols]
    if w is not None:
        pg_losses = pg_losses * w
    pg_loss = _verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, _metrics(ppo_kl=ppo_kl_abs)


def _verl_dppo(kind, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, w, clip_divergence_low,
               clip_divergence_high, clip_ratio_c):  # fmt: skip
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob = torch.exp(log_prob)
    old_prob = torch.exp(old_log_prob)
    if kind == "tv":
        valid_positive_mask = (prob - old_prob) <= clip_divergence_high
        valid_negative_mask = (prob - old_prob) >= -clip_divergence_low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        valid_positive_mask = (binary_kl <= clip_divergence_high) | (prob <= old_prob)
        valid_negative_mask = (binary_kl <= clip_divergence_low) | (prob >= old_prob)
    valid_mask = torch.where(advantages > 0, valid_positive_mask, valid_negative_mask).detach().float()
    pg_losses = -advantages * truncated_ratio * log_prob * valid_mask
    if w is not None:
        pg_losses = pg_losses * w
    pg_loss = _verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    pg_clipfrac = _verl_masked_mean((1.0 - valid_mask).float(), response_mask)
    pg_clipfrac_lower = _verl_masked_mean((ratio > clip_ratio_c).float() * valid_mask, response_mask)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


# name -> (ours(logp, old, adv, mask, w), veRL(old, logp, adv, mask, mode, w)); hyperparameters chosen so
# that every branch (clip, truncation, band, covariance selection) is exercised on the random batch.
CASES = {
    "gspo": (
        lambda lp, old, a, m, w: gspo_policy_loss(lp, old, a, m, 0.05, 0.1, importance_weights=w),
        lambda old, lp, a, m, mode, w: _verl_gspo(old, lp, a, m, mode, w, 0.05, 0.1),
    ),
    "sapo": (
        lambda lp, old, a, m, w: sapo_policy_loss(lp, old, a, m, 1.0, 1.05, importance_weights=w),
        lambda old, lp, a, m, mode, w: _verl_sapo(old, lp, a, m, mode, w, 1.0, 1.05),
    ),
    "cispo": (
        lambda lp, old, a, m, w: cispo_policy_loss(lp, old, a, m, 0.2, 0.28, importance_weights=w),
        lambda old, lp, a, m, mode, w: _verl_cispo(old, lp, a, m, mode, w, 0.2, 0.28),
    ),
    "geo_mean": (
        lambda lp, old, a, m, w: geo_mean_policy_loss(lp, old, a, m, 0.2, 0.28, importance_weights=w),
        lambda old, lp, a, m, mode, w: _verl_geo_mean(old, lp, a, m, mode, w, 0.2, 0.28),
    ),
    "gpg": (
        lambda lp, old, a, m, w: gpg_policy_loss(lp, a, m, importance_weights=w),
        lambda old, lp, a, m, mode, w: _verl_gpg(old, lp, a, m, mode, w),
    ),
    "reinforce": (
        lambda lp, old, a, m, w: reinforce_policy_loss(lp, old, a, m, importance_weights=w),
        lambda old, lp, a, m, mode, w: _verl_reinforce(old, lp, a, m, mode, w),
    ),
    "clip_cov": (
        lambda lp, old, a, m, w: clip_cov_policy_loss(
            lp, old, a, m, 0.2, 0.28, 0.2, 0.02, 5.0, importance_weights=w
        ),
        lambda old, lp, a, m, mode, w: _verl_clip_cov(old, lp, a, m, mode, w, 0.2, 0.28, 0.2, 0.02, 5.0),
    ),
    "kl_cov": (
        lambda lp, old, a, m, w: kl_cov_policy_loss(lp, old, a, m, 0.2, 0.5, importance_weights=w),
        lambda old, lp, a, m, mode, w: _verl_kl_cov(old, lp, a, m, mode, w, 0.2, 0.5),
    ),
    "dppo_tv": (
        lambda lp, old, a, m, w: dppo_tv_policy_loss(lp, old, a, m, 0.05, 0.08, 1.5, importance_weights=w),
        lambda old, lp, a, m, mode, w: _verl_dppo("tv", old, lp, a, m, mode, w, 0.05, 0.08, 1.5),
    ),
    "dppo_kl": (
        lambda lp, old, a, m, w: dppo_kl_policy_loss(lp, old, a, m, 0.01, 0.02, 1.5, importance_weights=w),
        lambda old, lp, a, m, mode, w: _verl_dppo("kl", old, lp, a, m, mode, w, 0.01, 0.02, 1.5),
    ),
}


def _random_batch(seed, pad_value=None):
    """float64 [5, 8] batch with ragged padding (no all-padding row); finite padding unless `pad_value`."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([8, 5, 3, 1, 6])
    mask = (torch.arange(8)[None, :] < lengths[:, None]).to(torch.float64)
    logp = -3.0 * torch.rand(5, 8, generator=g, dtype=torch.float64) - 0.01
    old_logp = (logp + 0.4 * torch.randn(5, 8, generator=g, dtype=torch.float64)).clamp(max=-0.01)
    advantages = torch.randn(5, 1, generator=g, dtype=torch.float64) + 0.3 * torch.randn(
        5, 8, generator=g, dtype=torch.float64
    )
    weights = 0.5 + torch.rand(5, 8, generator=g, dtype=torch.float64)
    if pad_value is not None:
        pad = mask == 0
        logp, old_logp, advantages, weights = (
            x.masked_fill(pad, pad_value) for x in (logp, old_logp, advantages, weights)
        )
    return logp, old_logp, advantages, mask, weights


def _modes(name):
    return (
        [FIXED_LOSS_AGG_MODES[name]]
        if name in FIXED_LOSS_AGG_MODES
        else ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
    )


@pytest.mark.parametrize(
    ("name", "mode", "weighted"),
    [(name, mode, weighted) for name in CASES for mode in _modes(name) for weighted in (False, True)],
)
def test_equals_verl_on_random_batches(name, mode, weighted):
    ours_fn, verl_fn = CASES[name]
    for seed in range(3):
        logp, old_logp, advantages, mask, weights = _random_batch(seed)
        w = weights if weighted else None
        ours_logp = logp.clone().requires_grad_(True)
        verl_logp = logp.clone().requires_grad_(True)
        torch.manual_seed(seed)  # Clip-Cov draws from the default generator, as veRL
        per_token, metrics = ours_fn(ours_logp, old_logp, advantages, mask, w)
        torch.manual_seed(seed)
        verl_loss, verl_metrics = verl_fn(old_logp, verl_logp, advantages, mask, mode, w)
        loss = aggregate_loss(per_token, mask, mode)
        assert close(loss, verl_loss.item()), (seed, loss.item(), verl_loss.item())
        for key in METRIC_KEYS:
            assert close(metrics[key], verl_metrics.get(key, 0.0)), (seed, key)
        loss.backward()
        verl_loss.backward()
        assert torch.allclose(ours_logp.grad, verl_logp.grad, rtol=1e-6, atol=1e-12), seed


@pytest.mark.parametrize("name", CASES)
def test_uniform_contract_and_padding(name):
    ours_fn, _ = CASES[name]
    logp, old_logp, advantages, mask, weights = _random_batch(7)
    torch.manual_seed(0)
    per_token, metrics = ours_fn(logp, old_logp, advantages, mask, weights)
    assert per_token.shape == logp.shape and set(metrics) == METRIC_KEYS
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    assert torch.all(per_token[mask == 0] == 0)
    # -inf / NaN on padding changes nothing and reaches no result or gradient.
    for pad_value in (float("-inf"), float("nan")):
        dirty = [x.clone() for x in _random_batch(7, pad_value)]
        dirty[0].requires_grad_(True)
        torch.manual_seed(0)
        dirty_tokens, dirty_metrics = ours_fn(dirty[0], dirty[1], dirty[2], mask, dirty[4])
        aggregate_loss(dirty_tokens, mask, "seq-mean-token-mean").backward()
        assert torch.equal(dirty_tokens.detach(), per_token)
        assert torch.isfinite(dirty_tokens).all() and torch.isfinite(dirty[0].grad).all()
        assert all(torch.isfinite(v) for v in dirty_metrics.values())
    # An empty mask: zero loss, zero metrics.
    empty_tokens, empty_metrics = ours_fn(logp, old_logp, advantages, torch.zeros_like(mask), None)
    assert aggregate_loss(empty_tokens, torch.zeros_like(mask), "token-mean").item() == 0.0
    assert all(v.item() == 0.0 for v in empty_metrics.values())


def test_registry_and_fixed_modes():
    assert POLICY_LOSSES["vanilla"] is ppo_policy_loss
    assert set(POLICY_LOSSES) == {
        "vanilla",
        "gspo",
        "sapo",
        "cispo",
        "geo_mean",
        "gpg",
        "clip_cov",
        "kl_cov",
        "dppo_tv",
        "dppo_kl",
    }
    assert FIXED_LOSS_AGG_MODES == dict.fromkeys(("sapo", "geo_mean"), "seq-mean-token-mean")


# --- GSPO --------------------------------------------------------------------------------------


def test_gspo_by_hand():
    # Row 0: log-ratios [ln 2, 0] -> s = exp(ln 2 / 2) = sqrt 2 on both tokens; A = 1, capped at 1 + 0.28.
    # Row 1: one token, ratio 1, A = -1 -> loss 1 (its padding holds -inf).
    logp = t([[-1.0 + LN2, -1.0], [-0.5, float("-inf")]])
    old_logp = t([[-1.0, -1.0], [-0.5, 0.0]])
    advantages = t([[1.0, 1.0], [-1.0, -1.0]])
    mask = t([[1, 1], [1, 0]])
    per_token, metrics = gspo_policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28)
    assert torch.allclose(per_token, t([[-1.28, -1.28], [1.0, 0.0]]))
    assert close(metrics["pg_clipfrac"], 2 / 3) and close(metrics["ppo_kl"], -LN2 / 3)
    assert close(aggregate_loss(per_token, mask, "seq-mean-token-mean"), (-1.28 + 1.0) / 2)


def test_gspo_ratio_is_per_sequence_and_gradient_is_the_sequence_one_over_length():
    logp, old_logp, advantages, mask, _ = _random_batch(3)
    advantages = advantages[:, :1].expand_as(logp).contiguous()  # one advantage per sequence
    logp.requires_grad_(True)
    per_token, _ = gspo_policy_loss(logp, old_logp, advantages, mask, 100.0, 100.0)  # nothing clipped
    ratio = per_token / -advantages
    lengths = mask.sum(-1)
    seq_ratio = torch.exp(((logp - old_logp) * mask).sum(-1) / lengths)
    assert torch.allclose(ratio[mask == 1], seq_ratio[:, None].expand_as(logp)[mask == 1])
    aggregate_loss(per_token, mask, "seq-mean-token-mean").backward()
    # d/dlogp_t of mean_i(-A_i s_i) = -A_i s_i / |y_i| / B: the sequence gradient spread over its tokens.
    expected = (-advantages[:, 0] * seq_ratio / lengths / len(lengths))[:, None] * mask
    assert torch.allclose(logp.grad, expected.detach())


# --- SAPO --------------------------------------------------------------------------------------


def test_sapo_by_hand():
    # ratio 1, A = 1, tau 1: gate sigmoid(0) * 4 = 2 -> loss -2
    # ratio 1, A = -1, tau 1.05: gate 0.5 * 4 / 1.05 = 1.904762 -> loss 1.904762
    # ratio e, A = 2, tau 1: gate 4 * sigmoid(e - 1) = 4 * 0.847907 = 3.391630 -> loss -6.783259
    logp = t([[-1.0, -1.0, 0.0]])
    old_logp = t([[-1.0, -1.0, -1.0]])
    advantages = t([[1.0, -1.0, 2.0]])
    per_token, metrics = sapo_policy_loss(logp, old_logp, advantages, torch.ones(1, 3), 1.0, 1.05)
    assert torch.allclose(per_token, t([[-2.0, 2.0 / 1.05, -8.0 / (1 + math.exp(1 - math.e))]]))
    assert torch.allclose(per_token, t([[-2.0, 1.904762, -6.783259]]), rtol=1e-6)
    assert (
        metrics["pg_clipfrac"] == 0 and metrics["pg_clipfrac_lower"] == 0 and close(metrics["ppo_kl"], -1 / 3)
    )


def test_sapo_gate_is_smooth_with_ppo_slope_at_ratio_one():
    log_ratio = torch.linspace(-1.0, 1.0, 41, dtype=torch.float64)
    for advantage, tau in ((1.5, 1.0), (-0.7, 1.05), (2.0, 3.0)):
        logp = log_ratio.clone().requires_grad_(True)[None]
        advantages = torch.full_like(logp, advantage)
        taus = (tau, 9.0) if advantage > 0 else (9.0, tau)
        per_token, _ = sapo_policy_loss(
            logp, torch.zeros_like(logp), advantages, torch.ones_like(logp), *taus
        )
        (grad,) = torch.autograd.grad(per_token.sum(), logp)
        ratio = torch.exp(log_ratio)
        p = torch.sigmoid(tau * (ratio - 1))
        # dL/dlogp = -A * gate'(r) * r with gate'(r) = 4 p (1 - p): never zero, no clip region.
        assert torch.allclose(grad[0], -advantage * 4 * p * (1 - p) * ratio)
        assert close(grad[0, 20], -advantage)  # ratio 1: gate slope 1, the PPO gradient -A
        assert torch.all(grad[0].abs() > 0) and torch.all(grad[0].abs() <= abs(advantage) * ratio + 1e-12)


# --- CISPO -------------------------------------------------------------------------------------


def test_cispo_by_hand():
    # ratio 2 -> clipped to 1.28, A = 1: -1.28 * (-2 + ln 2); ratio 0.5 -> 0.8, A = -1: -0.8 * (-2 - ln 2);
    # ratio 1, A = 0.5: -0.5 * -2 = 1.
    old_logp = t([[-2.0, -2.0, -2.0]])
    logp = old_logp + t([[LN2, -LN2, 0.0]])
    advantages = t([[1.0, -1.0, 0.5]])
    per_token, metrics = cispo_policy_loss(logp, old_logp, advantages, torch.ones(1, 3), 0.2, 0.28)
    assert torch.allclose(per_token, t([[1.28 * (2 - LN2), -0.8 * (2 + LN2), 1.0]]))
    assert (
        close(metrics["pg_clipfrac"], 2 / 3)
        and close(metrics["ppo_kl"], 0.0)
        and metrics["pg_clipfrac_lower"] == 0
    )


def test_cispo_gradient_is_clipped_weight_times_advantage_and_never_zero():
    logp, old_logp, advantages, mask, _ = _random_batch(4)
    logp.requires_grad_(True)
    per_token, _ = cispo_policy_loss(logp, old_logp, advantages, mask, 0.1, 0.1)
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    weight = torch.exp(logp.detach() - old_logp).clamp(0.9, 1.1)
    assert torch.allclose(grad, -weight * advantages * mask)
    assert ((weight == 0.9) | (weight == 1.1))[mask == 1].any()  # clipped tokens keep their gradient


# --- GMPO (geo_mean) ---------------------------------------------------------------------------


def test_geo_mean_by_hand():
    # Row 0, A = 1: log-ratios [0.5, -0.1] -> only the upper bound binds: [0.2, -0.1], mean 0.05 -> -e^0.05.
    # Row 1, A = -1: [-0.5, 0.1] -> only the lower bound binds: [-0.2, 0.1], mean -0.05 -> +e^-0.05.
    logp = t([[0.5, -0.1], [-0.5, 0.1]]) - 1.0
    old_logp = torch.full_like(logp, -1.0)
    advantages = t([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones_like(logp)
    per_token, metrics = geo_mean_policy_loss(logp, old_logp, advantages, mask, 0.2, 0.2)
    assert torch.allclose(per_token, t([[-math.exp(0.05)] * 2, [math.exp(-0.05)] * 2]))
    assert close(
        aggregate_loss(per_token, mask, "seq-mean-token-mean"), (math.exp(-0.05) - math.exp(0.05)) / 2
    )
    assert close(metrics["pg_clipfrac"], 0.25) and close(metrics["pg_clipfrac_lower"], 0.25)
    assert close(metrics["ppo_kl"], 0.0)


def test_geo_mean_is_geometric_mean_of_ratios_and_weights_and_ignores_empty_rows():
    logp, old_logp, advantages, mask, weights = _random_batch(5)
    advantages = advantages[:, :1].expand_as(logp).contiguous()
    per_token, _ = geo_mean_policy_loss(
        logp, old_logp, advantages, mask, 100.0, 100.0, importance_weights=weights
    )
    for i in range(len(mask)):
        n = int(mask[i].sum())
        ratios, w = torch.exp(logp[i, :n] - old_logp[i, :n]), weights[i, :n]
        expected = -advantages[i, 0] * ratios.prod() ** (1 / n) * w.prod() ** (1 / n)
        assert torch.allclose(per_token[i, :n], expected.expand(n))
    # An all-padding row (micro-batch filler) does not count; veRL's torch.mean would count it.
    padded = [torch.cat([x, torch.zeros(1, 8, dtype=x.dtype)]) for x in (logp, old_logp, advantages, mask)]
    filler_tokens, _ = geo_mean_policy_loss(*padded, 0.2, 0.28)
    plain_tokens, _ = geo_mean_policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28)
    assert close(
        aggregate_loss(filler_tokens, padded[3], "seq-mean-token-mean"),
        aggregate_loss(plain_tokens, mask, "seq-mean-token-mean"),
    )
    verl_filler, _ = _verl_geo_mean(padded[1], padded[0], padded[2], padded[3], None, None, 0.2, 0.28)
    assert close(verl_filler * 6 / 5, aggregate_loss(plain_tokens, mask, "seq-mean-token-mean").item())


# --- GPG and REINFORCE -------------------------------------------------------------------------


def test_gpg_and_reinforce_by_hand():
    logp = t([[-1.0, -2.0, float("-inf")]]).requires_grad_(True)
    advantages = t([[1.0, -0.5, 3.0]])
    mask = t([[1, 1, 0]])
    weights = t([[2.0, 0.5, 1.0]])
    per_token, metrics = gpg_policy_loss(logp, advantages, mask, importance_weights=weights)
    # -logp * A * w: [1 * 1 * 2, -(2 * 0.5) * 0.5, padding 0]
    assert torch.allclose(per_token, t([[2.0, -0.5, 0.0]]))
    assert all(v.item() == 0 for v in metrics.values())
    per_token.sum().backward()
    assert torch.allclose(logp.grad, t([[-2.0, 0.25, 0.0]]))  # -A * w, nothing from an old policy
    rollout_logp = t([[-1.5, -1.0, 0.0]])
    reinforce_tokens, reinforce_metrics = reinforce_policy_loss(
        logp, rollout_logp, advantages, mask, importance_weights=weights
    )
    assert torch.equal(reinforce_tokens, per_token)
    assert close(reinforce_metrics["ppo_kl"], ((-1.5 + 1.0) + (-1.0 + 2.0)) / 2)  # mean of rollout - logp


# --- Clip-Cov ----------------------------------------------------------------------------------


def test_clip_cov_by_hand():
    # Ratio 1 everywhere (no ratio clip). A - mean A = [2, 0, 0, -2], logp - mean logp = [1, 0, -1, 0]
    # -> cov = [2, 0, 0, 0]; only token 0 lies in (1, 5) and int(0.25 * 4) = 1 token is removed.
    logp = t([[-1.0, -2.0, -3.0, -2.0]])
    advantages = t([[2.0, 0.0, 0.0, -2.0]])
    per_token, metrics = clip_cov_policy_loss(
        logp, logp, advantages, torch.ones(1, 4), 0.2, 0.2, 0.25, 1.0, 5.0
    )
    assert torch.allclose(per_token, t([[0.0, 0.0, 0.0, 2.0]]))
    assert (
        close(metrics["pg_clipfrac"], 0.25)
        and close(metrics["ppo_kl"], 0.0)
        and metrics["pg_clipfrac_lower"] == 0
    )


def test_clip_cov_zeroes_the_gradient_of_exactly_the_selected_tokens():
    logp, old_logp, advantages, mask, _ = _random_batch(6)
    logp.requires_grad_(True)
    lower, upper = 0.02, 5.0
    per_token, metrics = clip_cov_policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28, 0.2, lower, upper,
                                              generator=torch.Generator().manual_seed(1))  # fmt: skip
    (grad,) = torch.autograd.grad(aggregate_loss(per_token, mask, "token-sum"), logp)
    ppo_tokens, _ = ppo_policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28, clip_ratio_c=1e9)
    (ppo_grad,) = torch.autograd.grad(aggregate_loss(ppo_tokens, mask, "token-sum"), logp)
    selected = (grad == 0) & (ppo_grad != 0)
    assert torch.equal(grad[~selected], ppo_grad[~selected])
    assert selected.sum() == int(0.2 * mask.sum()) == round(metrics["pg_clipfrac"].item() * mask.sum().item())
    lp = logp.detach()
    cov = (advantages - advantages[mask == 1].mean()) * (lp - lp[mask == 1].mean())
    assert torch.all((cov[selected] > lower) & (cov[selected] < upper))
    # The draw follows the generator: the same seed selects the same tokens.
    again, _ = clip_cov_policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28, 0.2, lower, upper,
                                    generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert torch.equal(again, per_token)
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        clip_cov_policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28, 0.0, lower, upper)


# --- KL-Cov ------------------------------------------------------------------------------------


def test_kl_cov_by_hand():
    # cov = [2, 0, 0, 0] as for Clip-Cov; int(0.25 * 4) = 1 token (token 0) gets + 0.5 * |0.1|.
    logp = t([[-1.0, -2.0, -3.0, -2.0]])
    log_ratio = t([[0.1, 0.2, -0.3, 0.1]])
    advantages = t([[2.0, 0.0, 0.0, -2.0]])
    per_token, metrics = kl_cov_policy_loss(logp, logp - log_ratio, advantages, torch.ones(1, 4), 0.25, 0.5)
    expected = -advantages * torch.exp(log_ratio) + t([[0.05, 0.0, 0.0, 0.0]])
    assert torch.allclose(per_token, expected)
    assert close(metrics["ppo_kl"], 0.7 / 4)  # abs-KL: mean |log ratio|
    assert metrics["pg_clipfrac"] == 0 and metrics["pg_clipfrac_lower"] == 0


def test_kl_cov_penalises_only_the_top_covariance_tokens():
    logp, old_logp, advantages, mask, _ = _random_batch(8)
    coef = 0.7
    per_token, _ = kl_cov_policy_loss(logp, old_logp, advantages, mask, 0.2, coef)
    surrogate = -advantages * torch.exp(logp - old_logp)
    extra = (per_token - surrogate) * mask
    penalised = extra.abs() > 1e-12
    assert torch.allclose(extra[penalised], coef * (logp - old_logp).abs()[penalised])
    valid = mask == 1
    cov = (advantages - advantages[valid].mean()) * (logp - logp[valid].mean())
    k = int(0.2 * mask.sum())
    assert penalised.sum() == k and cov[penalised].min() >= cov[valid & ~penalised].max()
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        kl_cov_policy_loss(logp, old_logp, advantages, mask, 0.0, coef)


# --- DPPO --------------------------------------------------------------------------------------

P_OLD = 0.5


def _dppo_tokens(probs, old_probs, advantages):
    logp = torch.log(t([probs])).requires_grad_(True)
    return logp, torch.log(t([old_probs])), t([advantages]), torch.ones(1, len(probs))


def test_dppo_tv_by_hand():
    # p_old = 0.5; band 0.15 either way. A > 0: p 0.6 (+0.1 kept), 0.7 (+0.2 dropped), 0.3 (kept: only a
    # rise is bounded). A < 0: 0.3 (-0.2 dropped), 0.45 (kept). Last: p_old 0.02 -> p 0.6, A < 0, kept,
    # ratio 30 truncated to 20 (counted in pg_clipfrac_lower).
    logp, old_logp, advantages, mask = _dppo_tokens(
        [0.6, 0.7, 0.3, 0.3, 0.45, 0.6], [P_OLD] * 5 + [0.02], [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
    )
    per_token, metrics = dppo_tv_policy_loss(logp, old_logp, advantages, mask, 0.15, 0.15, 20.0)
    log = math.log
    expected = [-1.2 * log(0.6), 0.0, -0.6 * log(0.3), 0.0, 0.9 * log(0.45), 20 * log(0.6)]
    assert torch.allclose(per_token, t([expected]))
    assert close(metrics["pg_clipfrac"], 2 / 6) and close(metrics["pg_clipfrac_lower"], 1 / 6)
    # Gradient: -A * min(r, cap) on kept tokens, 0 on dropped ones (the weight is not differentiated).
    per_token.sum().backward()
    assert torch.allclose(logp.grad, t([[-1.2, 0.0, -0.6, 0.0, 0.9, 20.0]]))


def test_dppo_kl_by_hand():
    # p_old = 0.5: KL(0.6) = 0.5 ln(0.5/0.6) + 0.5 ln(0.5/0.4) = 0.020411; KL(0.8) = KL(0.2) = 0.223144.
    # Band 0.05. A > 0: 0.6 kept, 0.8 dropped, 0.2 kept (p fell). A < 0: 0.2 dropped, 0.8 kept (p rose).
    logp, old_logp, advantages, mask = _dppo_tokens(
        [0.6, 0.8, 0.2, 0.2, 0.8], [P_OLD] * 5, [1.0, 1.0, 1.0, -1.0, -1.0]
    )
    per_token, metrics = dppo_kl_policy_loss(logp, old_logp, advantages, mask, 0.05, 0.05, 20.0)
    log = math.log
    expected = [-1.2 * log(0.6), 0.0, -0.4 * log(0.2), 0.0, 1.6 * log(0.8)]
    assert torch.allclose(per_token, t([expected]))
    assert close(metrics["pg_clipfrac"], 2 / 5) and metrics["pg_clipfrac_lower"] == 0
    # Just inside / outside the band: the threshold decides at KL(0.6) = 0.020411.
    for threshold, kept in ((0.0205, True), (0.0203, False)):
        tokens, _ = dppo_kl_policy_loss(
            logp[:, :1], old_logp[:, :1], advantages[:, :1], mask[:, :1], 0.0, threshold, 20.0
        )
        assert (tokens.item() != 0) == kept


@pytest.mark.parametrize("loss", [dppo_tv_policy_loss, dppo_kl_policy_loss])
def test_dppo_masks_tokens_outside_the_band(loss):
    logp, old_logp, advantages, mask, _ = _random_batch(9)
    logp.requires_grad_(True)
    per_token, metrics = loss(logp, old_logp, advantages, mask, 0.03, 0.03, 1.5)
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    weight = torch.exp(logp.detach() - old_logp).clamp(max=1.5)
    dropped = (grad == 0) & (mask == 1)
    assert 0 < dropped.sum() < mask.sum()
    assert torch.allclose(grad[~dropped], (-advantages * weight)[~dropped] * mask[~dropped])
    assert close(metrics["pg_clipfrac"], (dropped.sum() / mask.sum()).item())
    p, p_old = torch.exp(logp.detach()), torch.exp(old_logp)
    if loss is dppo_tv_policy_loss:  # dropped = moved past the band in the advantage's direction
        outside = torch.where(advantages > 0, p - p_old > 0.03, p - p_old < -0.03)
        assert torch.equal(dropped, outside & (mask == 1))
    with pytest.raises(ValueError, match="cap"):
        loss(logp, old_logp, advantages, mask, 0.03, 0.03, 0.0)
