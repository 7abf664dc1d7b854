"""How a training call cuts a batch into mini-batches, rank shards and micro-batches.

The plan of a training call is computed once, centrally, from the sequence lengths alone:

    mini-batch k        = the k-th contiguous slice of the batch (one optimizer step)
    rank shard          = longest-first assignment to the rank holding the fewest tokens so far
    micro-batches       = each shard sorted by length, filled up to `max_tokens_per_micro_batch`
                          padded tokens; every rank gets the same number of micro-batches (FSDP's
                          collectives run once per forward/backward on every rank), padding the
                          count with empty micro-batches when a rank has too few sequences

A reward model's preference pairs (`plan_preference_pairs`) are planned the same way with each pair
(sequences 2p and 2p+1, chosen then rejected) as one unit, so both halves of a pair share a
micro-batch; its counts are pairs.

Each plan carries the global counts of its mini-batch (model tokens, sequences with a model token),
so losses normalise by the whole mini-batch whatever the number of ranks or micro-batches.
Pure functions on sequence lengths: no tensors, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MiniBatchPlan:
    """One optimizer step: `micro_batches[rank]` lists that rank's micro-batches (sequence indices of
    the batch; an empty list is a filler micro-batch). Counts are over the whole mini-batch."""

    micro_batches: list[list[list[int]]]
    num_tokens: int  # model tokens (observation tokens do not train), all ranks
    num_sequences: int  # sequences with at least one model token, all ranks

    def for_rank(self, rank: int) -> MiniBatchPlan:
        return MiniBatchPlan([self.micro_batches[rank]], self.num_tokens, self.num_sequences)


def split_across_ranks(indices: list[int], lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Longest sequence first, each to the rank with the fewest tokens so far (ties: lowest rank)."""
    shards: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        shards[rank].append(i)
        loads[rank] += lengths[i]
    return shards


def pack_micro_batches(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequences, longest first, so each micro-batch's padded size (count x its longest
    length) stays within `max_tokens`. A sequence longer than the budget gets a micro-batch alone."""
    micro_batches: list[list[int]] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        current = micro_batches[-1] if micro_batches else None
        # Sorted longest first: the first sequence of a micro-batch is its longest.
        if current is not None and (len(current) + 1) * lengths[current[0]] <= max_tokens:
            current.append(i)
        else:
            micro_batches.append([i])
    return micro_batches


def equalize_micro_batch_counts(per_rank: list[list[list[int]]]) -> list[list[list[int]]]:
    """Split the largest micro-batches of ranks with fewer micro-batches than the busiest rank, and
    add empty fillers where no micro-batch can be split, so every rank runs the same count."""
    target = max(len(m) for m in per_rank)
    result = []
    for micro_batches in per_rank:
        micro_batches = [list(m) for m in micro_batches]
        while len(micro_batches) < target:
            largest = max(range(len(micro_batches)), key=lambda k: len(micro_batches[k]), default=None)
            if largest is None or len(micro_batches[largest]) < 2:
                micro_batches.append([])
                continue
            whole = micro_batches[largest]
            micro_batches[largest : largest + 1] = [whole[: len(whole) // 2], whole[len(whole) // 2 :]]
        result.append(micro_batches)
    return result


def plan_mini_batches(
    sequence_lengths: list[int],
    num_model_tokens: list[int],
    num_mini_batches: int,
    num_ranks: int,
    max_tokens_per_micro_batch: int,
) -> list[MiniBatchPlan]:
    """The plan of one pass over a batch (see the module docstring): shards and micro-batches from
    `sequence_lengths` (every token costs memory), the loss normalisers from `num_model_tokens`
    (per sequence, the response tokens that train)."""
    num_sequences = len(sequence_lengths)
    if len(num_model_tokens) != num_sequences:
        raise ValueError(f"{len(num_model_tokens)} model-token counts for {num_sequences} sequences")
    if num_mini_batches < 1 or num_ranks < 1:
        raise ValueError(f"num_mini_batches ({num_mini_batches}) and num_ranks ({num_ranks}) must be >= 1")
    if num_sequences < num_mini_batches:
        raise ValueError(f"a batch of {num_sequences} sequences cannot make {num_mini_batches} mini-batches")
    bounds = [round(k * num_sequences / num_mini_batches) for k in range(num_mini_batches + 1)]
    plans = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        indices = list(range(start, end))
        shards = split_across_ranks(indices, sequence_lengths, num_ranks)
        per_rank = [pack_micro_batches(s, sequence_lengths, max_tokens_per_micro_batch) for s in shards]
        plans.append(MiniBatchPlan(
            micro_batches=equalize_micro_batch_counts(per_rank),
            num_tokens=sum(num_model_tokens[i] for i in indices),
            num_sequences=sum(1 for i in indices if num_model_tokens[i] > 0),
        ))
    return plans


def plan_preference_pairs(sequence_lengths: list[int], num_mini_batches: int, num_ranks: int,
                          max_tokens_per_micro_batch: int) -> list[MiniBatchPlan]:
    """`plan_mini_batches` over preference pairs: sequences 2p (chosen) and 2p+1 (rejected) travel
    together, in that order, so a micro-batch holds whole pairs. A pair costs twice its longer
    sequence (both rows pad to it); `num_tokens` and `num_sequences` count the mini-batch's pairs,
    the Bradley-Terry loss's normaliser."""
    if len(sequence_lengths) % 2:
        raise ValueError(f"preference pairs need an even number of sequences, got {len(sequence_lengths)}")
    pair_lengths = [2 * max(sequence_lengths[i], sequence_lengths[i + 1]) for i in range(0, len(sequence_lengths), 2)]
    plans = plan_mini_batches(pair_lengths, [1] * len(pair_lengths), num_mini_batches, num_ranks,
                              max_tokens_per_micro_batch)
    return [MiniBatchPlan([[[i for pair in sorted(micro) for i in (2 * pair, 2 * pair + 1)] for micro in rank]
                           for rank in plan.micro_batches], plan.num_tokens, plan.num_sequences) for plan in plans]
