"""Entropy and token logprobs from logits [..., vocab].

Both are computed in float32 (or wider) and returned in the dtype of the logits. The chunked forms
process `chunk_size` rows (tokens) at a time: the float32 softmax of the whole [tokens, vocab]
tensor is never alive at once. When gradients are needed each chunk is recomputed in backward
(activation checkpointing), so training keeps only the logits themselves alive, not a second
vocab-sized copy per token. Chunked and unchunked results are the same computation on the same rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def _work(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    logits = _work(logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def _logprob_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = _work(logits)
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _over_row_chunks(
    fn: Callable[..., torch.Tensor], logits: torch.Tensor, extra: torch.Tensor | None, chunk_size: int
) -> torch.Tensor:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    rows = logits.reshape(-1, logits.shape[-1])
    extra_rows = None if extra is None else extra.reshape(-1)
    recompute = torch.is_grad_enabled() and logits.requires_grad
    outputs = []
    for start in range(0, rows.shape[0], chunk_size):
        args = [rows[start : start + chunk_size]]
        if extra_rows is not None:
            args.append(extra_rows[start : start + chunk_size])
        outputs.append(checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args))
    if not outputs:  # zero tokens: keep the shape and dtype
        return fn(rows, *([] if extra_rows is None else [extra_rows])).reshape(logits.shape[:-1])
    return torch.cat(outputs).reshape(logits.shape[:-1])


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution of each row: `logsumexp(l) - sum(softmax(l) * l)`.

    Shape [..., vocab] -> [...]. Deviation from veRL: computed in float32 even for bf16 logits
    (veRL's plain version computes in the logits' dtype; its chunked version in float32).
    """
    return _entropy_rows(logits).to(logits.dtype)


def chunked_entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """`entropy_from_logits`, `chunk_size` tokens at a time (veRL's `entropy_from_logits_with_chunking`)."""
    return _over_row_chunks(_entropy_rows, logits, None, chunk_size).to(logits.dtype)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Log-probability of each label: `log_softmax(logits)[..., label]`, shape [...].

    `logits` are [..., vocab] and `labels` [...] integer token ids (the logits at position t predict
    the token at t + 1: shift before calling). `chunk_size=None` computes all rows at once.
    For PPO ratios pass float32 logits: bf16 logprobs are too coarse for `exp(logp - old_logp)`.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} without the vocab dim")
    if chunk_size is None:
        return _logprob_rows(logits, labels).to(logits.dtype)
    return _over_row_chunks(_logprob_rows, logits, labels, chunk_size).to(logits.dtype)
