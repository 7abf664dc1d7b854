"""The staleness-aware replay buffer: a Ray async actor between rollout producers and the trainer.

Protocol (many concurrent callers; the accounting itself is `rlactors.buffer.core.BufferCore`):

    driver:    add_prompts(requests, epoch)         the epoch's prompts; close() after the last epoch
    producer:  reserve(max_count, producer_id)      -> PromptRequests to generate, each with a new
                                                       group_id; waits while the producers are
                                                       capacity_groups ahead (backpressure); [] = done
               put(groups)                          scored Groups (or ObjectRefs to them, in a list)
    trainer:   sample(batch_size, current_version)  -> SampledBatchRef: a ref to the Groups and
                                                       their numbers; waits until enough groups are
                                                       queued, evicting stale ones first
               ack(batch_id)                        after the optimizer step: ledger records "trained"
               nack(batch_id)                       not trained: groups go back to the queue front
    driver:    cancel_reservations(producer_id)     a producer died: its prompts are re-issued
               ledger(), events(), metrics(), health(), state_dict(), load_state_dict(state),
               save(path), load(path)               the checkpoint files, written and read here

Staleness: a group trained at trainer version v has v - oldest_policy_version <= max_staleness.
Groups that exceed it while queued are evicted and their prompts re-issued (first in line for
`reserve`) or dropped (`on_stale`); either way the event is logged with the prompt_id.
Backpressure: groups not yet trained (reserved, queued, or sampled and unacked) stay within
floor((1 + staleness_threshold) x batch_size_prompts x trigger_parameter_sync_step); a rejected or
evicted group frees its slot. With staleness_threshold 0 and trigger_parameter_sync_step 1 the
trainer must ack a batch before the next can be generated (synchronous); 1.0 lets the producers
generate the next batch while the trainer trains (one version off-policy).
Exactly once: per (epoch, prompt_id) the ledger ends "trained" (recorded at ack, never at sample)
or "dropped" with a reason ("zero_variance", "stale (...)", "rollout_error: ..."). A group whose
samples failed in rollout, even all of them (a prompt the engine refused), is
recorded dropped and the run goes on; each `SampledBatchRef` carries the drops by kind since the
previous batch (`num_dropped`), which the driver logs as metrics. Rollout errors alone for
`max_generation_rounds` rounds of a batch stop the run (`RolloutErrorsExhausted`).

Ownership: the buffer keeps every Group by value in its own heap. `put` resolves ObjectRefs at
once (while their owner, the producer, is alive), so killing a producer never makes buffered
groups unreadable. `sample` puts the batch's Groups into the object store as one object, owned by
the buffer, and returns its ref with ids, lengths and scores: the Groups go from here to whoever
reads the ref (the batch builder) without passing through the driver.

Bounded: finished ledger rows and events leave memory for the run's ledger log under
`ledger_dir` (output_dir/ledger; `rlactors.buffer.ledger_log`), appended in segments; `ledger()`
and `events()` read it back whole. Without a `ledger_dir` the log stays in memory.

Checkpoint (`state_dict`, written by `save_buffer_state` as parquet files; `rlactors.buffer.resume`):
the in-flight window (ledger rows not yet finished, unfinished prompts in hand-out order, open
reservations, re-issued on resume under the same group_id, queued groups and unacked batches by
value, which return to the queue front), per-epoch counts, counters, and the ledger log's cut:
loading truncates the log to it, so nothing the killed run logged after the checkpoint counts.
Config is not saved: it comes from the run's config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from pathlib import Path

import ray

from rlactors.buffer.core import BufferCore
from rlactors.buffer.ledger_log import LEDGER_FOLDER, LedgerLog
from rlactors.buffer.records import SampledBatchRef, capacity_groups, describe_batch
from rlactors.buffer.storage import load_buffer_state, save_buffer_state
from rlactors.config import BufferConfig
from rlactors.types import Group, PromptRequest

# The counts a timed-out wait reports: enough to say why it waited (see `_wait_for`).
WAIT_STATE = ("policy_version", "capacity_groups", "num_pending", "num_reserved_open", "num_queued",
              "num_unacked_batches", "num_groups_ahead", "num_unfinished")

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class ReplayBuffer:
    def __init__(self, config: BufferConfig, batch_size_prompts: int, trigger_parameter_sync_step: int = 1,
                 ledger_dir: str | None = None):
        """`ledger_dir`: where the run's ledger log goes (output_dir/ledger), seen by this actor's node."""
        self.core = BufferCore(
            capacity_groups(batch_size_prompts, trigger_parameter_sync_step, config.staleness_threshold),
            config.max_staleness, config.on_stale, config.max_reissues, config.dynamic_sampling,
            config.dynamic_sampling_metric, config.max_generation_rounds,
            LedgerLog(ledger_dir, config.ledger_flush_rows),
        )
        self.changed = asyncio.Condition()  # notified after every change a waiter may be waiting for
        self.wait_s: Counter[str] = Counter()

    async def add_prompts(self, requests: list[PromptRequest], epoch: int = 0) -> int:
        async with self.changed:
            count = self.core.add_prompts(requests, epoch)
            self.changed.notify_all()
        return count

    async def close(self) -> None:
        async with self.changed:
            self.core.close()
            self.changed.notify_all()

    async def reserve(self, max_count: int, producer_id: str = "", timeout_s: float | None = None) -> list[PromptRequest]:
        """Waits until at least one prompt can be handed out; [] means every prompt is finished."""
        return await self._wait_for(
            "reserve", timeout_s, lambda: self.core.reserve(max_count, producer_id) or ([] if self.core.is_done() else None)
        )

    async def put(self, groups: list[Group | ray.ObjectRef]) -> dict[str, int]:
        """Returns counts per outcome: kept, zero_variance, stale, rollout_error, superseded (a
        group_id no longer reserved: a retried call, or a cancelled reservation; ignored)."""
        refs = [(i, g) for i, g in enumerate(groups) if isinstance(g, ray.ObjectRef)]
        if refs:  # take a copy now: the ref's owner (a producer) may die later
            groups = list(groups)
            for (i, _), value in zip(refs, await asyncio.gather(*(ref for _, ref in refs)), strict=True):
                groups[i] = value
        async with self.changed:
            result = self.core.put(groups)
            self.changed.notify_all()
        if result["rollout_error"]:  # also in the ledger and the step's metrics; said here as it happens
            logger.warning("replay buffer: %d group(s) dropped for rollout errors; the latest: %s",
                           result["rollout_error"], self.core.last_rollout_error)
        return result

    async def cancel_reservations(self, producer_id: str) -> list[str]:
        async with self.changed:
            group_ids = self.core.cancel_reservations(producer_id)
            self.changed.notify_all()
        return group_ids

    async def set_policy_version(self, policy_version: int) -> None:
        async with self.changed:
            self.core.set_policy_version(policy_version)
            self.changed.notify_all()

    async def sample(self, batch_size: int, current_version: int, timeout_s: float | None = None) -> SampledBatchRef:
        batch = await self._wait_for("sample", timeout_s, lambda: self.core.sample(batch_size, current_version))
        return describe_batch(batch, ray.put(batch.groups) if batch.groups else None)

    async def ack(self, batch_id: int) -> bool:
        async with self.changed:
            done = self.core.ack(batch_id)
            self.changed.notify_all()
        return done

    async def nack(self, batch_id: int) -> None:
        async with self.changed:
            self.core.nack(batch_id)
            self.changed.notify_all()

    async def ledger(self, epoch: int | None = None) -> list[dict]:
        return [entry.__dict__ for entry in self.core.ledger(epoch)]

    async def events(self) -> list[dict]:
        return self.core.event_log()

    async def health(self) -> dict:
        """Answers at once (never waits on the buffer's lock): its process and how much is in flight."""
        return {"pid": os.getpid(), "num_unfinished": self.core.num_unfinished,
                "num_log_rows_waiting": self.core.log.num_pending_rows()}

    async def metrics(self) -> dict[str, float]:
        return self.core.metrics() | {f"{name}_wait_s": seconds for name, seconds in self.wait_s.items()}

    async def state_dict(self) -> dict:
        return self.core.state_dict()

    async def load_state_dict(self, state: dict) -> None:
        async with self.changed:
            self.core.load_state_dict(state)
            self.changed.notify_all()

    async def save(self, path: str) -> None:
        """Write the checkpoint files (`save_buffer_state`) from here: the queued groups never
        travel to the driver. `path` must be visible to this actor's node."""
        save_buffer_state(self.core.state_dict(), path)

    async def load(self, path: str) -> None:
        """Restore the checkpoint files at `path` (`<output_dir>/checkpoints/<step>/buffer`); a
        checkpoint of another run brings its ledger log up to the cut into this run's."""
        state = load_buffer_state(path)
        self.core.log.adopt(Path(path).absolute().parents[2] / LEDGER_FOLDER, state["log"])
        await self.load_state_dict(state)

    async def _wait_for(self, name: str, timeout_s: float | None, attempt):
        """Run `attempt` (a core call returning None for "not now") until it returns a value."""
        start = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s), self.changed:
                while (result := attempt()) is None:
                    await self.changed.wait()
                self.changed.notify_all()
        except TimeoutError:
            # Routine for polling callers (the colocated driver polls `sample`), and the error
            # travels to them every time: the counts that say why it waited, not every counter.
            state = {key: value for key, value in self.core.metrics().items() if key in WAIT_STATE}
            raise TimeoutError(f"buffer.{name} waited {timeout_s} s; state: {state}") from None
        finally:
            self.wait_s[name] += time.perf_counter() - start
        return result
