"""Advantage estimators and outcome-reward placement.

All functions run under `torch.no_grad()`: advantages are targets, never differentiated. Inputs are
[batch, response_len] tensors with a response mask; `group_ids` is a [batch] integer tensor that
names the prompt each sample answers (samples of one prompt share a `group_id`). Statistics are
computed in float32 or wider and returned in the dtype of the rewards.
"""

from __future__ import annotations

import torch

from rlactors.algorithms.masked import masked_whiten

GRPO_STD_EPS = 1e-6


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
