"""Records and pure rules of the replay buffer (no state, no Ray): what `BufferCore` keeps and
hands out, and the functions it decides with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from rlactors.types import Group, Sample

Key = tuple[int, str]  # (epoch, prompt_id)
TERMINAL = ("trained", "dropped")
PUT_OUTCOMES = ("kept", "zero_variance", "stale", "rollout_error", "superseded")
DROP_KINDS = ("rollout_error", "zero_variance", "stale")  # why a prompt is recorded dropped
MAX_REASON_CHARS = 1000  # a drop reason quotes rollout errors; the ledger keeps it bounded
COUNTER_NAMES = (  # the buffer's counters, all in `BufferCore.metrics()` from the start
    "num_prompts_added", "num_reserved", "num_cancelled", "num_put_kept", "num_put_zero_variance",
    "num_put_stale", "num_put_rollout_error", "num_put_superseded", "num_evicted_stale", "num_reissued",
    "num_dropped", "num_batches", "num_short_batches", "num_trained", "num_nacked",
    *(f"num_dropped_{kind}" for kind in DROP_KINDS),
)


class DynamicSamplingExhausted(RuntimeError):
    """Dynamic sampling spent its generation rounds without keeping a single group."""


class RolloutErrorsExhausted(RuntimeError):
    """Every group generated for a batch over its generation rounds failed in rollout."""


@dataclass
class LedgerEntry:
    """What happened to one prompt in one epoch. In flight, in the buffer's memory and checkpoint;
    once trained or dropped, a row of the run's ledger log (`rlactors.buffer.ledger_log`)."""

    epoch: int
    prompt_id: str
    status: str = "pending"  # pending | reserved | queued | sampled | trained | dropped
    group_id: str = ""  # the latest attempt
    num_attempts: int = 0  # reservations handed out for this prompt
    num_evictions: int = 0  # times its group went stale before being trained
    reason: str = ""  # why it was dropped
    batch_id: int = -1  # batch that trained it
    policy_version: int = -1  # trainer version it was trained at
    staleness: int = -1  # policy_version - the group's oldest version


@dataclass
class Reservation:
    key: Key
    producer_id: str
    policy_version: int  # trainer version when it was handed out


@dataclass
class QueuedGroup:
    epoch: int
    group: Group
    oldest_policy_version: int


@dataclass
class SampledBatch:
    """Groups to train at `policy_version`; ack `batch_id` after the optimizer step.
    An empty batch (batch_id -1, not to be acked) means the buffer is closed and nothing is left.
    The buffer's own record; the `ReplayBuffer` actor hands out a `SampledBatchRef` of it."""

    batch_id: int
    policy_version: int
    groups: list[Group]
    staleness: list[int] = field(default_factory=list)  # per group
    epochs: list[int] = field(default_factory=list)  # per group: the epoch whose prompt it answers
    num_dropped: dict[str, int] = field(default_factory=dict)  # by DROP_KINDS: drops since the previous batch
    num_evicted_stale: int = 0  # groups evicted as too stale since the previous batch (their generation wasted)


@dataclass
class SampledBatchRef:
    """A sampled batch as the trainer side gets it from `ReplayBuffer.sample`: one object ref to its
    Groups (put by the buffer, which lives for the run; `ray.get(groups_ref)` gives them) and the
    numbers the driver needs, without tokens or text. Per-sample lists run group by group, sample by
    sample. Empty (batch_id -1, groups_ref None, not to be acked): the buffer is closed and drained."""

    batch_id: int
    policy_version: int
    groups_ref: Any  # ObjectRef of list[Group]
    group_ids: list[str] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # per group
    epochs: list[int] = field(default_factory=list)  # per group
    prompt_lengths: list[int] = field(default_factory=list)  # per sample
    response_lengths: list[int] = field(default_factory=list)  # per sample
    scores: list[float | None] = field(default_factory=list)  # per sample
    accuracies: list[float | None] = field(default_factory=list)  # per sample: score_details["acc"], or None
    num_score_errors: int = 0
    first_score_error: str | None = None  # the batch's first Sample.score_error: what a scoring stop names
    num_dropped: dict[str, int] = field(default_factory=dict)  # by DROP_KINDS: drops since the previous batch
    num_evicted_stale: int = 0  # groups evicted as too stale since the previous batch (re-issued or dropped)
    # Per sample, for multi-turn metrics: response tokens the model wrote (the rest are observations).
    num_model_tokens: list[int] = field(default_factory=list)
    num_turns: list[int] = field(default_factory=list)
    num_tool_calls: list[int] = field(default_factory=list)
    # With reward models: each part of the reward (`score_details["reward_parts"]`), by name, per sample.
    score_parts: dict[str, list[float]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.group_ids)


def describe_batch(batch: SampledBatch, groups_ref: Any) -> SampledBatchRef:
    samples = [s for g in batch.groups for s in g.samples]
    return SampledBatchRef(
        batch.batch_id, batch.policy_version, groups_ref, [g.group_id for g in batch.groups], list(batch.staleness),
        list(batch.epochs), [len(s.prompt_token_ids) for s in samples], [s.num_response_tokens for s in samples],
        [s.score for s in samples],
        [float(s.score_details["acc"]) if s.score_details.get("acc") is not None else None for s in samples],
        sum(s.score_error is not None for s in samples),
        next((s.score_error for s in samples if s.score_error is not None), None), dict(batch.num_dropped),
        num_model_tokens=[s.num_model_tokens for s in samples], num_turns=[s.num_turns for s in samples],
        num_tool_calls=[s.num_tool_calls for s in samples], num_evicted_stale=batch.num_evicted_stale,
        score_parts=score_parts(samples),
    )


def score_parts(samples: list[Sample]) -> dict[str, list[float]]:
    """Each reward part's values over the samples that have it (`score_details["reward_parts"]`)."""
    parts: dict[str, list[float]] = {}
    for sample in samples:
        for name, value in sample.score_details.get("reward_parts", {}).items():
            parts.setdefault(name, []).append(float(value))
    return parts


def capacity_groups(batch_size_prompts: int, trigger_parameter_sync_step: int, staleness_threshold: float) -> int:
    """Most groups not yet trained at once: (1 + threshold) x groups per weight sync (veRL's rule)."""
    return math.floor((1.0 + staleness_threshold) * batch_size_prompts * trigger_parameter_sync_step)


def group_metric_values(group: Group, metric: Literal["score", "acc"]) -> list[float]:
    """The per-sample values dynamic sampling looks at; a missing one is an error naming the sample."""
    values = []
    for sample in group.samples:
        value = sample.score if metric == "score" else sample.score_details.get("acc")
        if value is None:
            raise ValueError(
                f"prompt_id {group.prompt_id!r} group_id {group.group_id!r} sample {sample.sample_index}: "
                f"no {metric!r} to filter on (dynamic sampling needs scored groups)"
            )
        values.append(float(value))
    return values


def oldest_policy_version(group: Group) -> int | None:
    """`Group.oldest_policy_version`, in one pass (it runs for every group put)."""
    return min((min(s.token_policy_versions) for s in group.samples if s.token_policy_versions), default=None)


def rollout_error_reason(group: Group) -> str | None:
    """"rollout_error: <the samples' distinct errors>", naming the prompt_id; None if no sample failed."""
    errors = list(dict.fromkeys(s.error for s in group.samples if s.error))
    if not errors:
        return None
    text = " | ".join(errors)
    if group.prompt_id not in text:
        text = f"prompt_id {group.prompt_id!r}: {text}"
    failed = sum(bool(s.error) for s in group.samples)
    if failed < len(group.samples):
        text += f" ({failed} of {len(group.samples)} samples)"
    reason = f"rollout_error: {text}"
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


def has_zero_variance(values: list[float]) -> bool:
    """DAPO's filter: a group of two or more whose values are all equal gives no GRPO signal."""
    return len(values) > 1 and max(values) == min(values)


def parse_group_id(group_id: str) -> tuple[Key, int]:
    """`{prompt_id}#{epoch}.{attempt}` (as made by `reserve`) -> ((epoch, prompt_id), attempt)."""
    prompt_id, _, rest = group_id.rpartition("#")
    epoch, _, attempt = rest.partition(".")
    if not (prompt_id and epoch.isdigit() and attempt.isdigit()):
        raise ValueError(f"group_id {group_id!r} was not handed out by this buffer (expected prompt_id#epoch.attempt)")
    return (int(epoch), prompt_id), int(attempt)
