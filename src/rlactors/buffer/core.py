"""The replay buffer's accounting, as a plain Python class (no Ray, no waiting).

`BufferCore` decides; the `ReplayBuffer` actor (rlactors.buffer.replay) wraps it and turns "not now" into
waiting. Every method either completes or returns an empty result; none blocks.

A prompt is tracked per (epoch, prompt_id) through these statuses:

    pending -> reserved -> queued -> sampled -> trained
                  ^          |         |
                  |          |         +-> queued        (nack: the trainer gave the batch back)
                  +----------+-> dropped  (zero variance, rollout error, too stale)
                  pending <--+            (evicted for staleness and re-issued, or reservation cancelled)

Invariants (checked by tests/buffer/test_buffer_properties.py):
- every delivered group has current_version - oldest_policy_version <= max_staleness;
- no group_id is delivered twice, and a prompt is marked trained at most once per epoch;
- groups not yet trained (reserved + queued + sampled but unacked) never exceed `capacity_groups`
  when a reservation is handed out (backpressure);
- every added prompt ends trained or dropped with a reason; nothing leaves silently. A group whose
  every sample failed in rollout (no policy version at all) is dropped like a partly failed one.

Bounded memory: `entries` holds only the in-flight window (not yet trained or dropped). A row
that finishes leaves it for the run-level `LedgerLog`, as do the events; `ledger()` and
`event_log()` read both. What stays is counts per open epoch and, for the newest epoch, its
finished prompt_ids, to refuse a prompt added twice (`EpochBook`: epochs are added in order).
Batch ids are handed out in order; an ack of an id below `next_batch_id` that is neither waiting
nor nacked was acked before (nacked ids are kept: one per trainer failure, rare).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from typing import Literal

from rlactors.buffer import resume
from rlactors.buffer.epochs import EpochBook
from rlactors.buffer.ledger_log import LedgerLog
from rlactors.buffer.records import (
    COUNTER_NAMES,
    DROP_KINDS,
    PUT_OUTCOMES,
    DynamicSamplingExhausted,
    Key,
    LedgerEntry,
    QueuedGroup,
    Reservation,
    RolloutErrorsExhausted,
    SampledBatch,
    group_metric_values,
    has_zero_variance,
    oldest_policy_version,
    parse_group_id,
    rollout_error_reason,
)
from rlactors.types import Group, PromptRequest


class BufferCore:
    def __init__(
        self,
        capacity_groups: int,
        max_staleness: int,
        on_stale: Literal["reissue", "drop"] = "reissue",
        max_reissues: int = 3,
        dynamic_sampling: bool = False,
        dynamic_sampling_metric: Literal["score", "acc"] = "score",
        max_generation_rounds: int = 10,
        log: LedgerLog | None = None,
    ):
        if capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1, got {capacity_groups}")
        self.capacity_groups = capacity_groups
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        self.max_reissues = max_reissues
        self.dynamic_sampling = dynamic_sampling
        self.dynamic_sampling_metric = dynamic_sampling_metric
        self.max_generation_rounds = max_generation_rounds

        self.policy_version = 0
        self.closed = False  # no more prompts will be added
        self.next_batch_id = 0
        self.num_put_since_batch = 0  # groups arrived since the last batch: dynamic sampling's budget
        self.log = log if log is not None else LedgerLog()  # finished rows and events go here
        self.entries: dict[Key, LedgerEntry] = {}  # in flight only: not yet trained or dropped
        self.requests: dict[Key, PromptRequest] = {}  # originals of unfinished prompts, to (re)issue
        self.reissued: deque[Key] = deque()  # handed out before fresh prompts
        self.fresh: deque[Key] = deque()
        self.reserved: dict[str, Reservation] = {}  # by group_id
        self.queue: deque[QueuedGroup] = deque()  # oldest first
        self.unacked: dict[int, SampledBatch] = {}
        self.nacked_batch_ids: set[int] = set()
        self.num_unacked_groups = 0
        self.epochs = EpochBook()  # per-epoch memory of rows that left `entries` (rlactors.buffer.epochs)
        self.drops_since_batch: Counter[str] = Counter()  # by DROP_KINDS, reported with the next batch
        self.num_evicted_since_batch = 0  # reported with the next batch, like the drops
        self.last_rollout_error = ""
        self.counters: Counter[str] = Counter()
        self.trained_staleness: Counter[int] = Counter()

    # -- producer side ------------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        """Prompts added and not yet trained or dropped: finished entries leave memory (`_finish`)."""
        return len(self.entries)

    def add_prompts(self, requests: list[PromptRequest], epoch: int = 0) -> int:
        if self.closed:
            raise ValueError("buffer is closed: no prompts can be added")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        keys = [(epoch, r.prompt_id) for r in requests]
        seen: set[Key] = set()
        for index, (request, key) in enumerate(zip(requests, keys, strict=True)):
            if not isinstance(request.prompt_id, str) or not request.prompt_id:
                raise ValueError(f"request {index}: prompt_id must be a non-empty string, got {request.prompt_id!r}")
            if key in self.entries or key in seen:
                raise ValueError(f"prompt_id {request.prompt_id!r} added twice in epoch {epoch}")
            self.epochs.check_add(epoch, request.prompt_id)
            seen.add(key)
        self.epochs.added(epoch, len(requests))
        for request, key in zip(requests, keys, strict=True):
            self.entries[key] = LedgerEntry(epoch, request.prompt_id)
            self.requests[key] = request
            self.fresh.append(key)
        self.counters["num_prompts_added"] += len(requests)
        return len(requests)

    def close(self) -> None:
        self.closed = True

    def is_done(self) -> bool:
        """Closed and every prompt trained or dropped: producers may exit."""
        return self.closed and self.num_unfinished == 0

    def num_groups_ahead(self) -> int:
        """Groups the producers are ahead of the trainer: reserved, queued, or sampled but unacked."""
        return len(self.reserved) + len(self.queue) + self.num_unacked_groups

    def num_free_slots(self) -> int:
        return self.capacity_groups - self.num_groups_ahead()

    def reserve(self, max_count: int, producer_id: str = "") -> list[PromptRequest]:
        """Up to `max_count` prompts to generate (re-issued ones first), each with a fresh group_id.
        Empty when the producers are `capacity_groups` ahead or nothing is pending. Since unacked
        groups count as ahead, with capacity_groups < 2 x batch_size the trainer must ack a batch
        before the next one can be generated (staleness_threshold 0 is synchronous)."""
        count = min(max_count, self.num_free_slots(), len(self.reissued) + len(self.fresh))
        handed_out = []
        for _ in range(max(count, 0)):
            key = self.reissued.popleft() if self.reissued else self.fresh.popleft()
            entry = self.entries[key]
            entry.group_id = f"{entry.prompt_id}#{entry.epoch}.{entry.num_attempts}"
            entry.num_attempts += 1
            entry.status = "reserved"
            self.reserved[entry.group_id] = Reservation(key, producer_id, self.policy_version)
            handed_out.append(dataclasses.replace(self.requests[key], group_id=entry.group_id))
        self.counters["num_reserved"] += len(handed_out)
        return handed_out

    def cancel_reservations(self, producer_id: str) -> list[str]:
        """Re-issue every open reservation of a producer (it died); returns their group_ids."""
        group_ids = [gid for gid, r in self.reserved.items() if r.producer_id == producer_id]
        for group_id in group_ids:
            key = self.reserved.pop(group_id).key
            self.entries[key].status = "pending"
            self.reissued.append(key)
            self._event("cancelled", key, group_id, reason=f"producer {producer_id!r}")
        self.counters["num_cancelled"] += len(group_ids)
        self.log.flush_if_full()
        return group_ids

    def put(self, groups: list[Group]) -> dict[str, int]:
        """Accept generated groups. All are checked before any is applied, so a bad one changes
        nothing. A group of an attempt no longer open (already put, e.g. by a retried call, or
        whose reservation was cancelled) is ignored, counted and logged: its prompt is elsewhere.
        A group with a failed sample (or only failed ones: a prompt the engine refused) is recorded
        dropped with the errors as its reason."""
        fresh: dict[str, tuple[Group, int]] = {}  # group_id -> (group, its oldest policy version)
        for index, group in enumerate(groups):
            if group.group_id in fresh or self._is_superseded(group.group_id):
                key = parse_group_id(group.group_id)[0]
                self._event("put_superseded", key, group.group_id)
                continue
            fresh[group.group_id] = group, self._check_group(group, index)
        result = Counter(superseded=len(groups) - len(fresh))
        for group, oldest in fresh.values():
            key = self.reserved.pop(group.group_id).key
            self.num_put_since_batch += 1
            reason = rollout_error_reason(group)
            if reason is not None:
                self._drop(key, "rollout_error", reason)
                self.last_rollout_error = reason
                result["rollout_error"] += 1
            elif self.policy_version - oldest > self.max_staleness:
                self._evict(key, group.group_id, self.policy_version - oldest)
                result["stale"] += 1
            elif self.dynamic_sampling and has_zero_variance(group_metric_values(group, self.dynamic_sampling_metric)):
                self._drop(key, "zero_variance", "zero_variance")
                result["zero_variance"] += 1
            else:
                self.entries[key].status = "queued"
                self.queue.append(QueuedGroup(key[0], group, oldest))
                result["kept"] += 1
        for name, count in result.items():
            self.counters[f"num_put_{name}"] += count
        self.log.flush_if_full()
        return {name: result[name] for name in PUT_OUTCOMES}

    def _is_superseded(self, group_id: str) -> bool:
        """An earlier attempt of a prompt in flight, or any attempt of a finished one."""
        if group_id in self.reserved:
            return False
        key, attempt = parse_group_id(group_id)
        if key in self.entries:
            return attempt < self.entries[key].num_attempts
        return self.epochs.is_finished(*key)

    def _check_group(self, group: Group, index: int) -> int | None:
        """Raise ValueError naming the group if it cannot be put; returns its oldest policy version
        (None only when every sample failed in rollout: such a group is dropped, never trained)."""
        where = f"group {index} (prompt_id {group.prompt_id!r}, group_id {group.group_id!r})"
        reservation = self.reserved.get(group.group_id)
        if reservation is None:
            raise ValueError(f"{where}: not reserved: never handed out by this buffer")
        if reservation.key[1] != group.prompt_id:
            raise ValueError(f"{where}: group_id was reserved for prompt_id {reservation.key[1]!r}")
        if not group.samples:
            raise ValueError(f"{where}: has no samples")
        for sample in group.samples:
            if not sample.error and not sample.token_policy_versions:
                raise ValueError(f"{where} sample {sample.sample_index}: empty token_policy_versions")
        oldest = oldest_policy_version(group)  # None: every sample failed (checked just above)
        if self.dynamic_sampling and not any(s.error for s in group.samples):
            group_metric_values(group, self.dynamic_sampling_metric)  # raises naming the sample
        return oldest

    # -- trainer side -------------------------------------------------------------------------

    def set_policy_version(self, policy_version: int) -> None:
        if policy_version < self.policy_version:
            raise ValueError(f"policy_version went back from {self.policy_version} to {policy_version}")
        self.policy_version = policy_version

    def sample(self, batch_size: int, current_version: int) -> SampledBatch | None:
        """A batch of `batch_size` groups, none staler than `max_staleness` at `current_version`,
        or None when the caller must wait. Short batches only come when no more groups can arrive
        (closed), or when dynamic sampling has spent its generation rounds. Generation rounds
        that end in nothing but rollout errors raise `RolloutErrorsExhausted` (else a run whose
        every prompt fails would go on through its epochs forever, training nothing)."""
        if batch_size < 1 or batch_size > self.capacity_groups:
            raise ValueError(f"batch_size must be in 1..capacity_groups={self.capacity_groups}, got {batch_size}")
        self.set_policy_version(current_version)
        self._evict_stale()
        count = None
        if len(self.queue) >= batch_size:
            count = batch_size
        elif self.closed and not self.reissued and not self.fresh and not self.reserved:
            count = len(self.queue)  # nothing more can arrive: short (possibly empty) batch
        elif self.dynamic_sampling and self.num_put_since_batch >= self.max_generation_rounds * batch_size:
            if not self.queue:
                raise DynamicSamplingExhausted(
                    f"dynamic sampling kept no group out of the last {self.num_put_since_batch} generated "
                    f"({self.max_generation_rounds} rounds of {batch_size}); all had zero "
                    f"{self.dynamic_sampling_metric!r} variance or were stale. Raise buffer.max_generation_rounds "
                    "or turn off buffer.dynamic_sampling"
                )
            count = len(self.queue)
            self.counters["num_short_batches"] += 1
        elif not self.queue and self.drops_since_batch["rollout_error"] >= self.max_generation_rounds * batch_size:
            raise RolloutErrorsExhausted(
                f"the last {self.drops_since_batch['rollout_error']} groups generated ({self.max_generation_rounds} "
                f"rounds of {batch_size}) all failed in rollout, none kept; the latest: {self.last_rollout_error}"
            )
        if count is None:
            return None
        if count == 0:
            return SampledBatch(-1, current_version, [])  # closed and drained; needs no ack
        items = [self.queue.popleft() for _ in range(count)]
        batch = SampledBatch(
            self.next_batch_id, current_version, [item.group for item in items],
            [current_version - item.oldest_policy_version for item in items], [item.epoch for item in items],
            {kind: self.drops_since_batch[kind] for kind in DROP_KINDS}, self.num_evicted_since_batch,
        )
        self.drops_since_batch, self.num_evicted_since_batch = Counter(), 0
        for item in items:
            entry = self.entries[(item.epoch, item.group.prompt_id)]
            entry.status, entry.batch_id = "sampled", batch.batch_id
        self.unacked[batch.batch_id] = batch
        self.num_unacked_groups += len(items)
        self.next_batch_id += 1
        self.num_put_since_batch = 0
        self.counters["num_batches"] += 1
        return batch

    def ack(self, batch_id: int) -> bool:
        """The batch was trained: record it in the ledger. Acking twice is a no-op (returns False)."""
        batch = self.unacked.pop(batch_id, None)
        if batch is None:
            if 0 <= batch_id < self.next_batch_id and batch_id not in self.nacked_batch_ids:
                return False  # delivered, not waiting, not nacked: acked before
            raise ValueError(f"batch_id {batch_id} was never delivered (or was nacked)")
        for group, staleness, epoch in zip(batch.groups, batch.staleness, batch.epochs, strict=True):
            key = (epoch, group.prompt_id)
            entry = self.entries[key]
            assert entry.status == "sampled", f"prompt_id {key[1]!r} epoch {key[0]} is {entry.status}, not sampled"
            entry.status, entry.policy_version, entry.staleness = "trained", batch.policy_version, staleness
            self._finish(key)
            self.trained_staleness[staleness] += 1
        self.num_unacked_groups -= len(batch.groups)
        self.counters["num_trained"] += len(batch.groups)
        self.log.flush_if_full()
        return True

    def nack(self, batch_id: int) -> None:
        """The batch was not trained: its groups go back to the front of the queue, in order."""
        batch = self.unacked.pop(batch_id, None)
        if batch is None:
            raise ValueError(f"batch_id {batch_id} is not waiting for an ack")
        for group, epoch, staleness in zip(*(reversed(x) for x in (batch.groups, batch.epochs, batch.staleness)), strict=True):
            entry = self.entries[(epoch, group.prompt_id)]
            entry.status, entry.batch_id = "queued", -1
            self.queue.appendleft(QueuedGroup(epoch, group, batch.policy_version - staleness))
        self.nacked_batch_ids.add(batch_id)
        self.num_unacked_groups -= len(batch.groups)
        self.counters["num_nacked"] += len(batch.groups)

    # -- staleness, drops, ledger -------------------------------------------------------------

    def _evict_stale(self) -> None:
        kept = deque()
        for item in self.queue:
            staleness = self.policy_version - item.oldest_policy_version
            if staleness > self.max_staleness:
                self._evict((item.epoch, item.group.prompt_id), item.group.group_id, staleness)
            else:
                kept.append(item)
        self.queue = kept

    def _evict(self, key: Key, group_id: str, staleness: int) -> None:
        entry = self.entries[key]
        entry.num_evictions += 1
        self.counters["num_evicted_stale"] += 1
        self.num_evicted_since_batch += 1
        self._event("evicted_stale", key, group_id, staleness=staleness)
        if self.on_stale == "reissue" and entry.num_evictions <= self.max_reissues:
            entry.status = "pending"
            self.reissued.append(key)
            self.counters["num_reissued"] += 1
        else:
            why = "on_stale=drop" if self.on_stale == "drop" else f"evicted {entry.num_evictions} times"
            self._drop(key, "stale", f"stale ({why})")

    def _drop(self, key: Key, kind: str, reason: str) -> None:
        """Record the prompt dropped; `kind` (one of DROP_KINDS) counts it, `reason` says why."""
        entry = self.entries[key]
        entry.status, entry.reason = "dropped", reason
        self._event("dropped", key, entry.group_id, reason=reason)
        self._finish(key)
        self.counters["num_dropped"] += 1
        self.counters[f"num_dropped_{kind}"] += 1
        self.drops_since_batch[kind] += 1

    def _finish(self, key: Key) -> None:
        """The entry is trained or dropped: it leaves memory for the ledger log."""
        entry = self.entries.pop(key)
        self.requests.pop(key, None)
        self.log.add_entry(dataclasses.asdict(entry))
        self.epochs.finished(entry)

    def _event(self, kind: str, key: Key, group_id: str, staleness: int = -1, reason: str = "") -> None:
        self.log.add_event(dict(kind=kind, epoch=key[0], prompt_id=key[1], group_id=group_id,
                                policy_version=self.policy_version, staleness=staleness, reason=reason))

    # -- queries and checkpoint ---------------------------------------------------------------

    def ledger(self, epoch: int | None = None) -> list[LedgerEntry]:
        """Every row, finished (from the log) and in flight, sorted by (epoch, prompt_id). Reads the
        whole log: for tests and inspection, not for a step loop."""
        rows = [LedgerEntry(**row) for row in self.log.rows("ledger")] + [dataclasses.replace(e) for e in self.entries.values()]
        return sorted((e for e in rows if epoch is None or e.epoch == epoch), key=lambda e: (e.epoch, e.prompt_id))

    def event_log(self) -> list[dict]:
        """Every event so far, oldest first (reads the whole log)."""
        return self.log.rows("events")

    def metrics(self) -> dict[str, float]:
        num_trained = sum(self.trained_staleness.values())
        staleness_sum = sum(s * n for s, n in self.trained_staleness.items())
        return {
            **{name: 0 for name in COUNTER_NAMES},
            **self.counters,
            "policy_version": self.policy_version,
            "capacity_groups": self.capacity_groups,
            "num_pending": len(self.reissued) + len(self.fresh),
            "num_reserved_open": len(self.reserved),
            "num_queued": len(self.queue),
            "num_unacked_batches": len(self.unacked),
            "num_groups_ahead": self.num_groups_ahead(),
            "num_unfinished": self.num_unfinished,
            "num_log_rows_waiting": self.log.num_pending_rows(),
            # Groups put so far (any outcome): a count that stands still says no producer is delivering.
            "num_put": sum(self.counters[f"num_put_{outcome}"] for outcome in PUT_OUTCOMES),
            "num_put_since_batch": self.num_put_since_batch,
            **{f"num_dropped_since_batch_{kind}": self.drops_since_batch[kind] for kind in DROP_KINDS},
            "staleness_mean": staleness_sum / num_trained if num_trained else 0.0,
            "staleness_max": max(self.trained_staleness, default=0),
        }

    def state_dict(self) -> dict:
        """Everything needed to resume (`rlactors.buffer.resume`); appends the waiting log rows."""
        return resume.core_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state`, truncating the ledger log to its cut (`rlactors.buffer.resume`)."""
        resume.load_core_state(self, state)

