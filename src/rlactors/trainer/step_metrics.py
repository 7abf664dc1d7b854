"""One optimizer step's metrics, from what its micro-batches return on every rank.

A trainer loss function returns, beside the loss, one detached scalar per metric and micro-batch.
Three kinds, told apart by name:
- loss shares (`*_loss`): summed over micro-batches and ranks, they add up to the mini-batch's loss;
- token-weighted sums (`TOKEN_MEAN_METRICS`): summed, then divided by the mini-batch's tokens;
- maxima (`MAX_METRICS`): the largest over micro-batches and ranks.

Invariant: every rank holds the same keys (the same loss on the same fields), since the
all-reduces stack the values in sorted key order.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from rlactors.trainer.policy_objective import BYPASS_METRICS, POLICY_METRICS
from rlactors.trainer.routing_replay import ROUTING_METRICS

# Metrics that are token means: ranks return token-weighted sums, divided by the mini-batch's tokens.
TOKEN_MEAN_METRICS = frozenset({*POLICY_METRICS, *BYPASS_METRICS, "entropy", "vf_clipfrac", "rollout_trainer_kl",
                                "rollout_logprob_abs_diff_mean", *ROUTING_METRICS,
                                # a reward model's, whose plans count pairs (`plan_preference_pairs`)
                                "preference_accuracy", "score_margin"})
MAX_METRICS = frozenset({"rollout_logprob_abs_diff_max"})  # maxima over micro-batches and ranks


def new_sums(device: torch.device) -> dict[str, torch.Tensor]:
    """An empty accumulator for one optimizer step: every metric starts at 0 on `device`."""
    return defaultdict(lambda: torch.zeros((), device=device))


def accumulate(sums: dict[str, torch.Tensor], micro_sums: dict[str, torch.Tensor]) -> None:
    """Add one micro-batch's metrics to `sums` (the larger value for `MAX_METRICS`)."""
    for key, value in micro_sums.items():
        value = value.detach().float()
        sums[key] = torch.maximum(sums[key], value) if key in MAX_METRICS else sums[key] + value


def reduce_over_ranks(sums: dict[str, torch.Tensor], num_tokens: int) -> dict[str, float]:
    """The step's metrics over all ranks (a collective): sums and maxima all-reduced, token-weighted
    sums divided by the mini-batch's `num_tokens`."""
    keys = sorted(set(sums) - MAX_METRICS)
    reduced = torch.stack([sums[k] for k in keys])
    dist.all_reduce(reduced)
    step = dict(zip(keys, reduced.tolist(), strict=True))
    maxima = sorted(MAX_METRICS.intersection(sums))
    if maxima:
        peaks = torch.stack([sums[k] for k in maxima])
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        step |= dict(zip(maxima, peaks.tolist(), strict=True))
    for key in TOKEN_MEAN_METRICS.intersection(step):
        step[key] /= max(num_tokens, 1)
    return step


def total_loss(step: dict[str, float]) -> float:
    """The mini-batch's loss: the sum of its loss terms (a non-finite one skips the step)."""
    return sum(value for key, value in step.items() if key.endswith("_loss"))
