"""The training batch, its records and the padded tensors of a micro-batch.

A `TrainBatch` holds ragged per-sequence data: token id lists and, per response token, named float
tensors (`rollout_logprobs`, `old_logprobs`, `ref_logprobs`, `advantages`, `returns`, `values`...).
Nothing is padded until a micro-batch is built, and a micro-batch is padded only to its own longest
sequence: sequences are grouped by length under a token budget (dynamic batching).

How a training call is cut into mini-batches, rank shards and micro-batches is planned from
the sequence lengths alone (`rlactors.trainer.plan`).

Multi-turn responses interleave model tokens and observation tokens (tool or environment output);
the `loss_mask` token field is 1 on the former, 0 on the latter. Everything that trains reads the
response mask AND-ed with it (`padded_field`, `MicroBatch.mask`), so observation tokens are context
only: no loss, entropy, KL, advantage or count sees them. They still occupy positions, so padding,
packing and per-token outputs (`unpad_rows`) use the full response lengths.
Pure functions: torch only, no Ray, no config objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlactors.models.routes import as_tensor
from rlactors.types import Group

# Fields filled from the rollout record; others are added by the driver and the trainers.
ROLLOUT_LOGPROBS = "rollout_logprobs"
# 1.0 on model tokens, 0.0 on observation tokens; a batch without it trains on every response token.
LOSS_MASK = "loss_mask"
# Decoupled rollout correction's per-token weights of the policy loss (`algorithm.rollout_correction`).
IMPORTANCE_WEIGHTS = "importance_weights"


@dataclass
class TrainBatch:
    """Sequences to train on; index i of every list is sequence i.

    `token_fields[name][i]` is a 1-D float tensor with one entry per response token of sequence i.
    `group_ids[i]` is an integer naming the group (prompt attempt) of sequence i: samples of one
    group share it (the form `grpo_advantages` wants); `prompt_ids[i]` and `sample_indices[i]` name
    the sample in error messages.
    """

    prompt_token_ids: list[list[int]]
    response_token_ids: list[list[int]]
    group_ids: list[int]
    prompt_ids: list[str] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    token_fields: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # ReMax: per sequence, the score of its group's greedy response (`Group.baseline`); else empty.
    baseline_scores: list[float] = field(default_factory=list)
    # MoE routing replay: per sequence, [prompt + response positions, layers, top_k] int16 expert ids
    # the rollout engine chose, -1 where it recorded none (`rlactors.models.routes`); empty when not recorded.
    routes: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.prompt_token_ids)
        if not self.prompt_ids:
            self.prompt_ids = [str(i) for i in range(n)]
        if not self.sample_indices:
            self.sample_indices = [0] * n
        for name in ("response_token_ids", "group_ids", "prompt_ids", "sample_indices"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries, expected {n}")
        for name in ("scores", "baseline_scores", "routes"):
            if getattr(self, name) and len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries, expected {n}")
        for i, prompt in enumerate(self.prompt_token_ids):
            if not prompt:
                raise ValueError(f"{self.describe(i)}: empty prompt (the first response token needs a context)")
        for name, values in self.token_fields.items():
            self._check_field(name, values)

    def __len__(self) -> int:
        return len(self.prompt_token_ids)

    def describe(self, i: int) -> str:
        return f"sequence {i} (prompt_id {self.prompt_ids[i]!r}, sample_index {self.sample_indices[i]})"

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_token_ids]

    @property
    def loss_masks(self) -> list[torch.Tensor]:
        """Per sequence, 1.0 on the tokens that train (all ones without a `loss_mask` field)."""
        if LOSS_MASK in self.token_fields:
            return self.token_fields[LOSS_MASK]
        return [torch.ones(len(r)) for r in self.response_token_ids]

    @property
    def num_model_tokens(self) -> list[int]:
        """Per sequence, the response tokens that train (the model's, not observations)."""
        if LOSS_MASK not in self.token_fields:
            return self.response_lengths
        return [int(m.sum()) for m in self.token_fields[LOSS_MASK]]

    @property
    def sequence_lengths(self) -> list[int]:
        return [len(p) + len(r) for p, r in zip(self.prompt_token_ids, self.response_token_ids, strict=True)]

    def _check_field(self, name: str, values: list[torch.Tensor]) -> None:
        if len(values) != len(self):
            raise ValueError(f"token field {name!r} has {len(values)} sequences, the batch has {len(self)}")
        for i, (value, response) in enumerate(zip(values, self.response_token_ids, strict=True)):
            if value.dim() != 1 or value.shape[0] != len(response):
                raise ValueError(
                    f"token field {name!r} of {self.describe(i)}: shape {tuple(value.shape)}, "
                    f"expected ({len(response)},) like its response tokens"
                )
            # A fractional mask would weight tokens and break the token counts that normalise losses.
            if name == LOSS_MASK and not bool(((value == 0) | (value == 1)).all()):
                raise ValueError(f"token field {name!r} of {self.describe(i)}: values other than 0 and 1")

    def set_field(self, name: str, values: list[torch.Tensor]) -> None:
        """Add or replace a per-response-token field, checking every sequence's length."""
        values = [torch.as_tensor(v, dtype=torch.float32).detach().cpu() for v in values]
        self._check_field(name, values)
        self.token_fields[name] = values

    def token_field(self, name: str) -> list[torch.Tensor]:
        if name not in self.token_fields:
            raise KeyError(f"TrainBatch has no token field {name!r}; it has {sorted(self.token_fields)}")
        return self.token_fields[name]

    def padded_field(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`(values, mask)`, both [num_sequences, longest response], right-padded with zeros: the form
        the advantage functions take. The mask is the `train_mask` (model tokens only); values are
        there for every response token. `set_padded_field` is the way back."""
        return pad_right(self.token_field(name)), self.train_mask()

    def train_mask(self) -> torch.Tensor:
        """[num_sequences, longest response] bool: real response tokens that are the model's."""
        mask = response_mask(self.response_lengths)
        if LOSS_MASK not in self.token_fields:
            return mask
        return mask & (pad_right(self.token_fields[LOSS_MASK], mask.shape[1]) != 0)

    def set_padded_field(self, name: str, padded: torch.Tensor) -> None:
        self.set_field(name, [padded[i, :n] for i, n in enumerate(self.response_lengths)])

    def __reduce__(self):
        # One flat tensor per token field, split again on arrival. Pickled one by one, a row costs
        # ~60 us of per-tensor overhead, and a row that is a view (`set_padded_field`'s) carries
        # the whole padded tensor with it: n rows of a [n, T] field would weigh n * n * T floats.
        flat = {name: torch.cat(values) if values else torch.zeros(0) for name, values in self.token_fields.items()}
        routes = torch.cat(self.routes) if self.routes else None
        return _batch_from_flat_fields, (self.prompt_token_ids, self.response_token_ids, self.group_ids,
                                         self.prompt_ids, self.sample_indices, self.scores, flat,
                                         self.baseline_scores, routes)

    def select(self, indices: list[int]) -> TrainBatch:
        """The sub-batch of the given sequences, in the given order (tensors are shared, not copied)."""
        return TrainBatch(
            prompt_token_ids=[self.prompt_token_ids[i] for i in indices],
            response_token_ids=[self.response_token_ids[i] for i in indices],
            group_ids=[self.group_ids[i] for i in indices],
            prompt_ids=[self.prompt_ids[i] for i in indices],
            sample_indices=[self.sample_indices[i] for i in indices],
            scores=[self.scores[i] for i in indices] if self.scores else [],
            token_fields={name: [values[i] for i in indices] for name, values in self.token_fields.items()},
            baseline_scores=[self.baseline_scores[i] for i in indices] if self.baseline_scores else [],
            routes=[self.routes[i] for i in indices] if self.routes else [],
        )


def _batch_from_flat_fields(prompt_token_ids, response_token_ids, group_ids, prompt_ids, sample_indices, scores,
                            flat_fields: dict[str, torch.Tensor], baseline_scores: list[float],
                            routes: torch.Tensor | None = None) -> TrainBatch:
    lengths = [len(r) for r in response_token_ids]
    sequence_lengths = [len(p) + n for p, n in zip(prompt_token_ids, lengths, strict=True)]
    return TrainBatch(prompt_token_ids, response_token_ids, group_ids, prompt_ids, sample_indices, scores,
                      {name: list(flat.split(lengths)) for name, flat in flat_fields.items()}, baseline_scores,
                      list(routes.split(sequence_lengths)) if routes is not None else [])


@dataclass
class TrainBatchRef:
    """A TrainBatch in the object store and what planning needs of it (`plan_mini_batches` reads
    lengths only): the driver directs training with this and never holds the batch itself."""

    ref: Any  # ObjectRef of a TrainBatch
    sequence_lengths: list[int]  # prompt + response tokens: what packing and padding cost
    num_model_tokens: list[int]  # response tokens that train: what losses normalise by

    @classmethod
    def of(cls, ref: Any, batch: TrainBatch) -> TrainBatchRef:
        """The ref of `batch` (already put) with the lengths planning reads."""
        return cls(ref, batch.sequence_lengths, batch.num_model_tokens)

    def __len__(self) -> int:
        return len(self.sequence_lengths)


def rows_in_batch_order(per_rank_rows: list[list[tuple]], num_sequences: int, what: str) -> list[tuple]:
    """Merge the ranks' (sequence index, ...) rows of a forward pass into batch order, checking that
    each sequence came back exactly once."""
    rows = sorted((row for rank_rows in per_rank_rows for row in rank_rows), key=lambda row: row[0])
    if [row[0] for row in rows] != list(range(num_sequences)):
        raise RuntimeError(f"{what}: ranks returned sequences {[r[0] for r in rows]}, "
                           f"expected each of 0..{num_sequences - 1} once")
    return rows


def train_batch_from_groups(groups: list[Group]) -> TrainBatch:
    """Flatten groups into a `TrainBatch`, group by group, sample by sample.

    Group ids are 0..len(groups)-1 in order. The rollout engine's logprobs become the
    `rollout_logprobs` field and the samples' loss masks the `loss_mask` field (all ones for a
    sample without one). A sample that failed in rollout, has no score, or whose logprobs or loss
    mask do not match its response is an error naming it: nothing is dropped silently.
    """
    batch = dict(prompt_token_ids=[], response_token_ids=[], group_ids=[], prompt_ids=[], sample_indices=[],
                 scores=[], baseline_scores=[])
    logprobs, loss_masks, routes = [], [], []
    with_baselines = {group.baseline is not None for group in groups}
    if len(with_baselines) > 1:
        missing = [g.group_id for g in groups if g.baseline is None]
        raise ValueError(f"groups {missing[:5]} have no greedy baseline (ReMax), the others of the batch do")
    for group_id, group in enumerate(groups):
        if group.baseline is not None:
            if group.baseline.score is None:
                raise ValueError(f"group {group.group_id!r}: its greedy baseline has no score (score the group first)")
            batch["baseline_scores"] += [float(group.baseline.score)] * len(group.samples)
        for sample in group.samples:
            name = f"group {group.group_id!r} prompt_id {sample.prompt_id!r} sample_index {sample.sample_index}"
            # A scoring failure already gave the sample score 0 (recorded in score_error and the
            # reward metrics), so it trains like any other; a rollout failure has no response to train.
            if sample.error is not None:
                raise ValueError(f"{name}: failed sample cannot be trained ({sample.error})")
            if sample.score is None:
                raise ValueError(f"{name}: no score (score the group before training it)")
            if len(sample.response_logprobs) != len(sample.response_token_ids):
                raise ValueError(f"{name}: {len(sample.response_logprobs)} response_logprobs for "
                                 f"{len(sample.response_token_ids)} response tokens")
            if sample.loss_mask and len(sample.loss_mask) != len(sample.response_token_ids):
                raise ValueError(f"{name}: loss_mask of {len(sample.loss_mask)} entries for "
                                 f"{len(sample.response_token_ids)} response tokens")
            if any(m not in (0, 1) for m in sample.loss_mask):
                raise ValueError(f"{name}: loss_mask holds values other than 0 and 1")
            if not sample.prompt_token_ids:
                raise ValueError(f"{name}: empty prompt")
            batch["prompt_token_ids"].append(list(sample.prompt_token_ids))
            batch["response_token_ids"].append(list(sample.response_token_ids))
            batch["group_ids"].append(group_id)
            batch["prompt_ids"].append(sample.prompt_id)
            batch["sample_indices"].append(sample.sample_index)
            batch["scores"].append(float(sample.score))
            logprobs.append(torch.tensor(sample.response_logprobs, dtype=torch.float32))
            loss_masks.append(torch.tensor(sample.loss_mask, dtype=torch.float32) if sample.loss_mask
                              else torch.ones(len(sample.response_token_ids)))
            routes.append(as_tensor(sample, len(sample.prompt_token_ids) + len(sample.response_token_ids)))
    lengths = [len(p) + len(r) for p, r in zip(batch["prompt_token_ids"], batch["response_token_ids"], strict=True)]
    return TrainBatch(**batch, token_fields={ROLLOUT_LOGPROBS: logprobs, LOSS_MASK: loss_masks},
                      routes=batch_routes(routes, lengths))


def batch_routes(routes: list[torch.Tensor | None], sequence_lengths: list[int]) -> list[torch.Tensor]:
    """The batch's routing: empty when no sample carries any; else one tensor per sample, a sample
    without a record (an engine that did not record it) all -1, so the trainer routes it itself."""
    shape = next((r.shape[1:] for r in routes if r is not None), None)
    if shape is None:
        return []
    for r in routes:
        if r is not None and r.shape[1:] != shape:
            raise ValueError(f"routing of [layers, top_k] {list(r.shape[1:])} beside {list(shape)} in one batch")
    return [r if r is not None else torch.full((n, *shape), -1, dtype=torch.int16)
            for r, n in zip(routes, sequence_lengths, strict=True)]


def pad_right(values: list[torch.Tensor], width: int | None = None, value: float = 0.0) -> torch.Tensor:
    """Stack 1-D tensors into [len(values), width], right-padded with `value`."""
    width = max((v.shape[0] for v in values), default=0) if width is None else width
    dtype = values[0].dtype if values else torch.float32
    out = torch.full((len(values), width), value, dtype=dtype)
    for i, v in enumerate(values):
        out[i, : v.shape[0]] = v
    return out


def response_mask(lengths: list[int], width: int | None = None) -> torch.Tensor:
    width = max(lengths, default=0) if width is None else width
    return torch.arange(width).unsqueeze(0) < torch.tensor(lengths, dtype=torch.long).reshape(-1, 1)


# --------------------------------------------------------------------------------------------
# Micro-batch tensors


@dataclass
class MicroBatch:
    """Padded tensors of one micro-batch.

    `input_ids` [B, L] are prompt + response, right-padded with `pad_token_id`. Right padding under
    causal attention means no real token attends to a pad, so no attention mask is needed and
    results do not depend on the padded width. `response_positions` [B, R] are the positions whose
    logits predict the response tokens (`prompt_len - 1 + t`), `labels` [B, R] those tokens and
    `mask` [B, R] marks the response tokens that train (real, and the model's: observation tokens
    are 0). `response_lengths[b]` counts every response token of row b, observations included.
    `fields[name]` are the token fields, [B, R].
    """

    indices: list[int]
    input_ids: torch.Tensor
    response_positions: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    fields: dict[str, torch.Tensor]
    response_lengths: list[int]
    routes: torch.Tensor | None = None  # [B, L, layers, top_k] recorded experts, -1 where none (MoE replay)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(self.indices, move(self.input_ids), move(self.response_positions), move(self.labels),
                          move(self.mask), {k: move(v) for k, v in self.fields.items()}, list(self.response_lengths),
                          None if self.routes is None else move(self.routes))


def build_micro_batch(batch: TrainBatch, indices: list[int], field_names: tuple[str, ...] = (),
                      pad_token_id: int = 0) -> MicroBatch:
    """Pad the given sequences of `batch` into a `MicroBatch` carrying the named token fields.

    An empty `indices` gives a filler micro-batch: one pad token and no response token, so the
    forward and backward still run (FSDP collectives) but contribute nothing.
    """
    if not indices:
        one = torch.zeros((1, 1), dtype=torch.long)
        return MicroBatch([], one + pad_token_id, one, one, one.bool(),
                          {name: torch.zeros((1, 1)) for name in field_names}, [])
    sequences = [batch.prompt_token_ids[i] + batch.response_token_ids[i] for i in indices]
    input_ids = pad_right([torch.tensor(s, dtype=torch.long) for s in sequences], value=pad_token_id)
    response_lengths = [len(batch.response_token_ids[i]) for i in indices]
    width = max(max(response_lengths), 1)
    prompt_lengths = torch.tensor([len(batch.prompt_token_ids[i]) for i in indices]).unsqueeze(1)
    mask = response_mask(response_lengths, width)
    if LOSS_MASK in batch.token_fields:
        mask &= pad_right([batch.token_fields[LOSS_MASK][i] for i in indices], width) != 0
    # Padded response slots point at the last real position so gathers stay in range.
    positions = torch.minimum(prompt_lengths - 1 + torch.arange(width).unsqueeze(0), torch.tensor(input_ids.shape[1] - 1))
    labels = pad_right([torch.tensor(batch.response_token_ids[i], dtype=torch.long) for i in indices], width,
                       value=pad_token_id)
    fields = {name: pad_right([batch.token_field(name)[i] for i in indices], width) for name in field_names}
    routes = None
    if batch.routes:
        routes = torch.full((len(indices), input_ids.shape[1], *batch.routes[0].shape[1:]), -1, dtype=torch.int16)
        for row, i in enumerate(indices):
            routes[row, :len(batch.routes[i])] = batch.routes[i]
    return MicroBatch(list(indices), input_ids, positions, labels, mask, fields, response_lengths, routes)


def unpad_rows(padded: torch.Tensor, micro_batch: MicroBatch) -> list[tuple[int, torch.Tensor]]:
    """(sequence index, its values at every response token, observations included) for each real
    sequence of a micro-batch: old logprobs and values are read back per token, whatever trains."""
    return [(i, padded[row, :n].detach().float().cpu().clone()) for row, (i, n) in
            enumerate(zip(micro_batch.indices, micro_batch.response_lengths, strict=True))]
