"""Advantage estimators, all of them, and outcome-reward placement: GAE, GRPO, RLOO, REINFORCE++,
REINFORCE++-baseline, OPO, GPG, pass@k, ReMax.

All functions run under `torch.no_grad()`: advantages are targets, never differentiated. Inputs are
[batch, response_len] tensors with a response mask; `group_ids` is a [batch] integer tensor that
names the prompt each sample answers (samples of one prompt share a `group_id`). Statistics are
computed in float32 or wider and returned in the dtype of the rewards, 0 on padding. A sample's
score is `token_rewards.sum(-1)` over every position, as in veRL. Definitions are veRL 0.9.1's
(`verl/trainer/ppo/core_algos.py`); each deviation is stated in the function's docstring.
Estimators that whiten or count over the batch (REINFORCE++, REINFORCE++-baseline, GPG) must be
called on the whole batch, not on micro-batches.
"""

from __future__ import annotations

import torch

from rlactors.algorithms.masked import masked_whiten

GRPO_STD_EPS = 1e-6
PASSK_STD_EPS = 1e-6


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 sums over a group or a long response lose too much; compute in float32 at least.
    return torch.promote_types(dtype, torch.float32)


def _check_shapes(name: str, tensor: torch.Tensor, mask: torch.Tensor) -> None:
    if tensor.dim() != 2 or tensor.shape != mask.shape:
        raise ValueError(
            f"{name} must be [batch, response_len] like the mask {tuple(mask.shape)}, got {tuple(tensor.shape)}"
        )


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar score on its last response token (the last 1 of its mask).

    With a mask that excludes observation tokens (multi-turn), that is the last model token: the
    last action the policy took, even when an observation follows it. Returns [batch, response_len]
    rewards in the dtype of `scores`, zero elsewhere. A sequence without any masked-in token would
    lose its score, so it is an error naming the sample indices.
    """
    if scores.dim() != 1 or mask.dim() != 2 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must be [batch] and mask [batch, response_len], got {tuple(scores.shape)} and {tuple(mask.shape)}")
    selected = mask != 0
    empty = (~selected.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"samples {empty} have no response token that trains (all-zero mask): "
                         "their score has nowhere to go")
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last_index = torch.where(selected, positions, -1).max(dim=-1).values
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    rewards.scatter_(1, last_index.unsqueeze(-1), scores.unsqueeze(-1))
    return rewards


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation; returns `(advantages, returns)`, both [batch, response_len].

    Reverse loop: `delta_t = r_t + gamma * V_{t+1} - V_t`, `gae_t = delta_t + gamma * lam * gae_{t+1}`.
    A masked position (e.g. a tool-output token inside a multi-turn response) carries the next value
    and the running gae through unchanged, as veRL's `compute_gae_advantage_return` does.
    `returns = advantages + values` before whitening; advantages are then whitened over the mask, so
    call this on the whole batch, before splitting it into micro-batches.

    Deviation from veRL: padded positions of both outputs are set to 0 (veRL leaves the carried values
    there). No loss reads them.
    """
    _check_shapes("values", values, mask)
    _check_shapes("token_rewards", token_rewards, mask)
    out_dtype = values.dtype
    work = _work_dtype(out_dtype)
    rewards, values_w = token_rewards.to(work), values.to(work)
    selected = mask != 0
    next_values = torch.zeros(values.shape[0], dtype=work, device=values.device)
    last_gae = torch.zeros_like(next_values)
    advantages = torch.zeros_like(values_w)
    for t in reversed(range(values.shape[-1])):
        delta = rewards[:, t] + gamma * next_values - values_w[:, t]
        gae = delta + gamma * lam * last_gae
        next_values = torch.where(selected[:, t], values_w[:, t], next_values)
        last_gae = torch.where(selected[:, t], gae, last_gae)
        advantages[:, t] = last_gae
    returns = advantages + values_w
    advantages = masked_whiten(advantages, selected)
    zero = torch.zeros((), dtype=work, device=values.device)
    advantages = torch.where(selected, advantages, zero)
    returns = torch.where(selected, returns, zero)
    return advantages.to(out_dtype), returns.to(out_dtype)


def _group_index(group_ids: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, int]:
    """Map arbitrary integer group ids to 0..num_groups-1; returns (index per sample, num_groups)."""
    group_ids = torch.as_tensor(group_ids)
    if group_ids.dim() != 1 or group_ids.shape[0] != batch_size:
        raise ValueError(f"group_ids must be a [batch] tensor with batch={batch_size}, got shape {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must hold integers, got dtype {group_ids.dtype}")
    unique_ids, index = torch.unique(group_ids, return_inverse=True)
    return index, unique_ids.numel()


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, unbiased group std, group size), each [batch]."""
    index, num_groups = _group_index(group_ids.to(scores.device), scores.shape[0])
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, index, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add_(0, index, scores)
    means = sums / counts
    squares = torch.zeros_like(counts).index_add_(0, index, (scores - means[index]) ** 2)
    stds = torch.sqrt(squares / (counts - 1).clamp(min=1))
    return means[index], stds[index], counts[index]


@torch.no_grad()
def grpo_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = GRPO_STD_EPS,
) -> torch.Tensor:
    """GRPO outcome advantage, broadcast over response tokens: [batch, response_len], 0 on padding.

    `score = token_rewards.sum(-1)`; per group, `(score - mean) / (std + epsilon)` with the unbiased
    std, or `score - mean` when `norm_by_std=False` (Dr.GRPO). A group of one sample uses mean 0 and
    std 1, so its advantage is its own score (veRL's `compute_grpo_outcome_advantage`).
    """
    _check_shapes("token_rewards", token_rewards, mask)
    scores = token_rewards.to(_work_dtype(token_rewards.dtype)).sum(dim=-1)
    means, stds, counts = _group_stats(scores, torch.as_tensor(group_ids))
    singleton = counts == 1
    means = torch.where(singleton, torch.zeros_like(means), means)
    stds = torch.where(singleton, torch.ones_like(stds), stds)
    advantages = (scores - means) / (stds + epsilon) if norm_by_std else scores - means
    return (advantages.unsqueeze(-1) * mask.to(advantages.dtype)).to(token_rewards.dtype)


@torch.no_grad()
def rloo_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO outcome advantage: score minus the mean score of the *other* samples of its group.

    Computed as veRL's `compute_rloo_outcome_advantage` does: `n / (n - 1) * (score - group_mean)`,
    which equals the leave-one-out form. A group of one sample keeps its raw score as advantage.
    Broadcast over response tokens, 0 on padding.
    """
    _check_shapes("token_rewards", token_rewards, mask)
    scores = token_rewards.to(_work_dtype(token_rewards.dtype)).sum(dim=-1)
    means, _, counts = _group_stats(scores, torch.as_tensor(group_ids))
    leave_one_out = (scores - means) * counts / (counts - 1).clamp(min=1)
    advantages = torch.where(counts > 1, leave_one_out, scores)
    return (advantages.unsqueeze(-1) * mask.to(advantages.dtype)).to(token_rewards.dtype)


# ------------------------------------------------------------ outcome-only estimators


def _scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    _check_shapes("token_rewards", token_rewards, mask)
    return token_rewards.to(_work_dtype(token_rewards.dtype)).sum(dim=-1)


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[batch] -> [batch, response_len]: the value on every response token, 0 on padding."""
    zero = torch.zeros((), dtype=per_sample.dtype, device=per_sample.device)
    return torch.where(mask != 0, per_sample.unsqueeze(-1), zero).to(dtype)


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns, whitened over the batch; returns `(advantages, returns)`.

    `G_t = r_t + gamma * G_next` over response tokens, where `G_next` is the return of the next
    response token: a masked position (an observation inside a multi-turn response) carries the
    running return through unchanged and adds nothing, as veRL 0.9.1 does (older veRL reset it at
    every masked position). Returns are 0 on padding; `advantages = masked_whiten(returns)` over
    every response token of the batch (token-weighted), 0 on padding. No critic, no group baseline.
    veRL's default is `gamma = 1.0` (`algorithm.gamma`).
    """
    _check_shapes("token_rewards", token_rewards, mask)
    work = _work_dtype(token_rewards.dtype)
    rewards = token_rewards.to(work)
    selected = mask != 0
    running = torch.zeros(rewards.shape[0], dtype=work, device=rewards.device)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[-1])):
        running = torch.where(selected[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(selected[:, t], running, 0.0)
    advantages = torch.where(selected, masked_whiten(returns, selected), 0.0)
    return advantages.to(token_rewards.dtype), returns.to(token_rewards.dtype)


@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++-baseline: score minus its group's mean, then whitened over the whole batch.

    `a = score - mean_group(score)` (a group of one keeps its score: mean 0), broadcast over
    response tokens, then `masked_whiten` over every response token of the batch: the batch mean
    and unbiased std are token-weighted, so a long response counts as many times as it has tokens.
    0 on padding. veRL's `epsilon` argument is unused there, so it is not an argument here.
    """
    scores = _scores(token_rewards, mask)
    means, _, counts = _group_stats(scores, torch.as_tensor(group_ids))
    centred = scores - torch.where(counts > 1, means, torch.zeros_like(means))
    selected = mask != 0
    per_token = _broadcast(centred, selected, centred.dtype)
    advantages = torch.where(selected, masked_whiten(per_token, selected), 0.0)
    return advantages.to(token_rewards.dtype)


@torch.no_grad()
def opo_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """OPO: score minus its group's length-weighted mean score, broadcast over response tokens.

    `b_group = sum(len_i * score_i) / sum(len_i)` with `len_i = mask.sum(-1)` (response tokens of
    sample i), `a_i = score_i - b_group`, so `sum(len_i * a_i)` is 0 over a group. A group of one
    keeps its score (baseline 0). No std normalisation. 0 on padding.

    veRL's `epsilon` argument is unused there, so it is not an argument here. Deviation: a group of
    several samples with no response token at all gets baseline 0 where veRL divides 0 by 0 (NaN on
    positions that no loss reads).
    """
    scores = _scores(token_rewards, mask)
    index, num_groups = _group_index(torch.as_tensor(group_ids).to(scores.device), scores.shape[0])
    lengths = mask.to(scores.dtype).sum(dim=-1)
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, index, torch.ones_like(scores))
    total_len = torch.zeros_like(counts).index_add_(0, index, lengths)
    weighted = torch.zeros_like(counts).index_add_(0, index, lengths * scores)
    baseline = torch.where((counts > 1) & (total_len > 0), weighted / total_len.clamp(min=1), 0.0)
    return _broadcast(scores - baseline[index], mask, token_rewards.dtype)


@torch.no_grad()
def gpg_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, f_norm: float = 1.0
) -> torch.Tensor:
    """GPG: `alpha * (score - mean_group(score)) / f_norm`, broadcast over response tokens.

    `alpha = batch / max(1, #samples whose score is nonzero)`, counted over the batch passed in
    (veRL counts nonzero *scores*, not nonzero advantages). A group of one keeps its score (mean 0);
    there is no std normalisation. 0 on padding.

    veRL's signature also takes `epsilon=1e-6` and `alpha=1.0`, but never uses epsilon and always
    overwrites alpha with the batch ratio above, so neither is an argument here. veRL's trainer
    never passes `f_norm`, so 1.0 is what runs there.
    """
    scores = _scores(token_rewards, mask)
    means, _, counts = _group_stats(scores, torch.as_tensor(group_ids))
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    centred = scores - torch.where(counts > 1, means, torch.zeros_like(means))
    return _broadcast(alpha * centred / f_norm, mask, token_rewards.dtype)


@torch.no_grad()
def grpo_passk_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = PASSK_STD_EPS,
) -> torch.Tensor:
    """GRPO pass@k: only each group's best sample gets an advantage, `best - second_best`.

    Per group, `a = max(score) - second_max(score)` on the sample holding the max and 0 on every
    other sample; divided by `std + epsilon` (unbiased std of the group's scores) when
    `norm_by_std`. When the max is tied the advantage is 0 whichever sample holds it (the first one
    does here; veRL's `topk` picks one). A group where no sample is correct (all scores equal)
    gets 0 everywhere. Broadcast over response tokens, 0 on padding.

    A group of one sample has no second best: a ValueError naming its group ids, as in veRL.
    veRL reads `norm_adv_by_std_in_grpo` from the algorithm config (default True) and ignores its
    argument of that name; here it is the argument `norm_by_std`.
    """
    scores = _scores(token_rewards, mask)
    group_ids = torch.as_tensor(group_ids)
    means, stds, counts = _group_stats(scores, group_ids)
    singleton = counts < 2
    if singleton.any():
        lonely = sorted(set(group_ids.to("cpu")[singleton.to("cpu")].tolist()))
        raise ValueError(f"pass@k needs at least 2 samples per group; groups {lonely} have one")
    index, num_groups = _group_index(group_ids.to(scores.device), scores.shape[0])
    best = torch.full((num_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    best = best.scatter_reduce(0, index, scores, reduce="amax")
    positions = torch.arange(scores.shape[0], device=scores.device)
    candidates = torch.where(scores == best[index], positions, scores.shape[0])
    first_best = torch.full((num_groups,), scores.shape[0], device=scores.device).scatter_reduce(
        0, index, candidates, reduce="amin"
    )
    is_best = positions == first_best[index]
    second = torch.full_like(best, -torch.inf).scatter_reduce(
        0, index, torch.where(is_best, -torch.inf, scores), reduce="amax"
    )
    gap = best[index] - second[index]
    if norm_by_std:
        gap = gap / (stds + epsilon)
    return _broadcast(torch.where(is_best, gap, 0.0), mask, token_rewards.dtype)


@torch.no_grad()
def remax_advantages(
    token_rewards: torch.Tensor, baseline_scores: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: return minus the greedy rollout's score; returns `(advantages, returns)`.

    `returns_t = sum_{s >= t} r_s * mask_s` (undiscounted reward-to-go over response tokens; with an
    outcome reward every token's return is the score), `advantages_t = returns_t - baseline_scores`,
    where `baseline_scores` [batch] is the score of the greedy (do_sample=False) rollout of each
    sample's prompt. No whitening.

    Deviation from veRL: both outputs are 0 on padding. veRL leaves the reward-to-go on masked
    positions before a later response token (an observation inside a multi-turn response), in the
    returns and, without the baseline, in the advantages. No loss reads them.
    """
    _check_shapes("token_rewards", token_rewards, mask)
    if baseline_scores.shape != (mask.shape[0],):
        raise ValueError(f"baseline_scores must be [batch] with batch={mask.shape[0]}, got {tuple(baseline_scores.shape)}")
    work = _work_dtype(token_rewards.dtype)
    selected = mask != 0
    rewards = torch.where(selected, token_rewards.to(work), 0.0)
    returns = rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = torch.where(selected, returns - baseline_scores.to(work).unsqueeze(-1), 0.0)
    returns = torch.where(selected, returns, 0.0)
    return advantages.to(token_rewards.dtype), returns.to(token_rewards.dtype)
