"""Loss aggregation into a scalar, and the value, SFT and Bradley-Terry (reward model) losses.

Loss functions (these, and every policy loss in `policy_losses`) return a [batch, response_len]
per-token loss matrix plus detached metrics; one function, `aggregate_loss`, turns any such matrix
into the scalar to backpropagate. Keeping the two apart lets the trainer add terms (policy, KL,
entropy) per token or per aggregate with one set of global counts.

How to make the loss independent of the micro-batch split and of the number of ranks
------------------------------------------------------------------------------------
A mini-batch (the samples of one optimizer step) is split over `num_ranks` data-parallel ranks and,
on each rank, over micro-batches. Before the first micro-batch, count over the whole mini-batch
(all-reduce a SUM over ranks of the local counts):

    global_num_tokens    = sum of mask over the mini-batch
    global_num_sequences = number of sequences of the mini-batch with at least one response token
                           (`num_nonempty_sequences(mask)`, summed)

and pass them to every `aggregate_loss` call of that step. Each call then returns that micro-batch's
share of the mini-batch loss, so the micro-batch losses of all ranks SUM to exactly the loss of the
whole mini-batch on one device. Accumulate gradients by plain `backward()` per micro-batch (no
division by the number of micro-batches). FSDP/DDP *average* gradients over ranks; to get the sum,
either multiply each micro-batch loss by `num_ranks` (what veRL's `dp_size` argument does) or set
FSDP2's gradient divide factor to 1. `seq-mean-token-sum-norm` also needs a constant `norm_tokens`
(e.g. the maximum response length), never the padded width of a micro-batch, which varies.
"""

from __future__ import annotations

import torch

from rlactors.algorithms.masked import MEAN_EPS, masked_mean, masked_sum

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def num_nonempty_sequences(mask: torch.Tensor) -> torch.Tensor:
    """Number of rows of `mask` holding at least one response token (the sequence count of the
    `seq-mean-*` modes; all-padding rows, e.g. micro-batch filler, do not count)."""
    return (mask != 0).any(dim=-1).sum()


def _count(value: int | float | torch.Tensor | None, default: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    count = default if value is None else torch.as_tensor(value, device=like.device)
    # An empty mini-batch has nothing to average: divide by 1 so the loss is 0, not NaN.
    return count.to(like.dtype).clamp(min=1)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_num_tokens: int | float | torch.Tensor | None = None,
    global_num_sequences: int | float | torch.Tensor | None = None,
    norm_tokens: int | float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [batch, response_len] to a scalar (in the dtype of `loss_mat`).

    modes (veRL's `agg_loss`):
      token-mean               sum of token losses / global_num_tokens
      token-sum                sum of token losses
      seq-mean-token-sum       sum over sequences of (token sum) / global_num_sequences
      seq-mean-token-mean      sum over sequences of (token mean) / global_num_sequences
      seq-mean-token-sum-norm  sum over sequences of (token sum / norm_tokens) / global_num_sequences
                               (Dr.GRPO; `norm_tokens` is required, a constant such as the maximum
                               response length)
    `global_num_tokens` defaults to `mask.sum()` and `global_num_sequences` to
    `num_nonempty_sequences(mask)`: right for a batch taken whole, wrong for a micro-batch (see the
    module docstring). Counts below 1 are treated as 1, so an all-zero mask gives 0.

    Deviation from veRL: no `dp_size` factor (the caller scales for gradient averaging, see the
    module docstring); otherwise the values equal veRL's with `dp_size=1`.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must have the same shape")
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    if mode == "token-mean":
        num_tokens = _count(global_num_tokens, mask.to(loss_mat.dtype).sum(), loss_mat)
        return masked_sum(loss_mat, mask) / num_tokens
    num_sequences = _count(global_num_sequences, num_nonempty_sequences(mask), loss_mat)
    token_sums = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / num_sequences
    if mode == "seq-mean-token-mean":
        token_means = token_sums / (mask.to(loss_mat.dtype).sum(dim=-1) + MEAN_EPS)
        return token_means.sum() / num_sequences
    if norm_tokens is None or norm_tokens <= 0:
        raise ValueError(f"mode 'seq-mean-token-sum-norm' needs a positive constant norm_tokens, got {norm_tokens!r}")
    return token_sums.sum() / norm_tokens / num_sequences


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (veRL's `compute_value_loss`), per token:
    `0.5 * max((v - R)^2, (clamp(v, v_old - c, v_old + c) - R)^2)`.

    `values` are the critic's current predictions, `old_values` those recorded at rollout time.
    Returns the per-token loss (aggregate it with `aggregate_loss`) and `vf_clipfrac`, the masked
    fraction of tokens where the clipped branch is larger.
    """
    clipped_values = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean((clipped_loss > unclipped_loss).to(values.dtype), mask)}
    return per_token, metrics


def sft_loss(
    logp: torch.Tensor, mask: torch.Tensor, global_num_tokens: int | float | torch.Tensor | None = None
) -> torch.Tensor:
    """Masked negative log-likelihood, token-mean: `-sum(logp * mask) / global_num_tokens`.

    `logp` are the logprobs of the target tokens (`logprobs_from_logits`); split batches pass the
    global token count as for `aggregate_loss`.
    """
    return aggregate_loss(-logp, mask, "token-mean", global_num_tokens=global_num_tokens)


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, global_num_pairs: int | float | torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A reward model's preference loss: `-sum(log sigmoid(chosen - rejected)) / global_num_pairs`.

    `chosen_scores[i]` and `rejected_scores[i]` are the model's scores of the two responses of pair
    i. Split batches pass the pair count of the whole mini-batch (default: this call's), so the
    shares of all micro-batches sum to the mini-batch's loss, as `aggregate_loss`'s do. Metrics,
    detached sums over this call's pairs: `preference_accuracy` (pairs scored the right way round)
    and `score_margin` (chosen minus rejected).
    """
    if chosen_scores.shape != rejected_scores.shape or chosen_scores.dim() != 1:
        raise ValueError(f"chosen and rejected scores must be 1-D and alike, got {tuple(chosen_scores.shape)} "
                         f"and {tuple(rejected_scores.shape)}")
    margin = chosen_scores.float() - rejected_scores.float()
    count = _count(global_num_pairs, torch.tensor(float(margin.numel()), device=margin.device), margin)
    loss = -torch.nn.functional.logsigmoid(margin).sum() / count
    with torch.no_grad():
        metrics = {"preference_accuracy": (margin > 0).float().sum(), "score_margin": margin.sum()}
    return loss, metrics
