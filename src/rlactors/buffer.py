"""The staleness-aware replay buffer: a Ray async actor between rollout producers and the trainer.

Protocol (many concurrent callers; the accounting itself is `rlactors.buffer_core.BufferCore`):

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
               ledger(), events(), metrics(), state_dict(), load_state_dict(state),
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
or "dropped" with a reason ("zero_variance", "stale (...)", "rollout_error: ...").

Ownership: the buffer keeps every Group by value in its own heap. `put` resolves ObjectRefs at
once (while their owner, the producer, is alive), so killing a producer never makes buffered
groups unreadable. `sample` puts the batch's Groups into the object store as one object, owned by
the buffer, and returns its ref with ids, lengths and scores: the Groups go from here to whoever
reads the ref (the batch builder) without passing through the driver.

Checkpoint (`state_dict`, written by `save_buffer_state` as parquet files): the ledger, unfinished
prompts in hand-out order, open reservations (re-issued on resume under the same group_id),
queued groups and unacked batches by value (unacked ones return to the queue front), the event
log and counters. Config is not saved: it comes from the run's config.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from rlactors.buffer_core import BufferCore
from rlactors.buffer_records import SampledBatchRef, capacity_groups, describe_batch
from rlactors.config import BufferConfig
from rlactors.types import Group, PromptRequest, Sample

# The counts a timed-out wait reports: enough to say why it waited (see `_wait_for`).
WAIT_STATE = ("policy_version", "capacity_groups", "num_pending", "num_reserved_open", "num_queued",
              "num_unacked_batches", "num_groups_ahead", "num_unfinished")


@ray.remote(num_cpus=0)
class ReplayBuffer:
    def __init__(self, config: BufferConfig, batch_size_prompts: int, trigger_parameter_sync_step: int = 1):
        self.core = BufferCore(
            capacity_groups(batch_size_prompts, trigger_parameter_sync_step, config.staleness_threshold),
            config.max_staleness, config.on_stale, config.max_reissues, config.dynamic_sampling,
            config.dynamic_sampling_metric, config.max_generation_rounds,
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
        return list(self.core.events)

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
        await self.load_state_dict(load_buffer_state(path))

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


# --------------------------------------------------------------------------------------------
# Checkpoint files: the state dict as parquet tables (ledger.parquet carries the scalars).

_INTS = pa.list_(pa.int64())
_REQUEST_FIELDS = [
    ("prompt_id", pa.string()), ("group_id", pa.string()), ("prompt_token_ids", _INTS),
    ("data_source", pa.string()), ("ground_truth", pa.string()), ("extra_info", pa.string()),
]
_SAMPLE = pa.struct([
    ("prompt_id", pa.string()), ("sample_index", pa.int64()), ("prompt_token_ids", _INTS),
    ("response_token_ids", _INTS), ("response_logprobs", pa.list_(pa.float64())),
    ("token_policy_versions", _INTS), ("finish_reason", pa.string()), ("error", pa.string()),
    ("text", pa.string()), ("score", pa.float64()), ("score_details", pa.string()), ("score_error", pa.string()),
])
REQUESTS_SCHEMA = pa.schema([("epoch", pa.int64()), *_REQUEST_FIELDS])
GROUPS_SCHEMA = pa.schema([("batch_id", pa.int64()), ("epoch", pa.int64()), *_REQUEST_FIELDS,
                           ("samples", pa.list_(_SAMPLE))])
LEDGER_SCHEMA = pa.schema([
    ("epoch", pa.int64()), ("prompt_id", pa.string()), ("status", pa.string()), ("group_id", pa.string()),
    ("num_attempts", pa.int64()), ("num_evictions", pa.int64()), ("reason", pa.string()),
    ("batch_id", pa.int64()), ("policy_version", pa.int64()), ("staleness", pa.int64()),
])
EVENTS_SCHEMA = pa.schema([
    ("kind", pa.string()), ("epoch", pa.int64()), ("prompt_id", pa.string()), ("group_id", pa.string()),
    ("policy_version", pa.int64()), ("staleness", pa.int64()), ("reason", pa.string()),
])
_META_KEY = b"rlactors.buffer"


def _json_text(value, where: str) -> str:
    """JSON for a free-form dict, refusing values JSON would not give back identically."""

    def check(item, path: str) -> None:
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    raise ValueError(f"{where}{path}: key {key!r} is not a string; it would not round-trip")
                check(child, f"{path}.{key}")
        elif isinstance(item, list):
            for i, child in enumerate(item):
                check(child, f"{path}[{i}]")
        elif item is not None and type(item) not in (bool, int, float, str):
            raise ValueError(f"{where}{path}: {type(item).__name__} value {item!r} cannot be saved exactly")

    check(value, "")
    return json.dumps(value)


def _request_row(request: PromptRequest, where: str) -> dict:
    return dict(prompt_id=request.prompt_id, group_id=request.group_id, prompt_token_ids=request.prompt_token_ids,
                data_source=request.data_source, ground_truth=request.ground_truth,
                extra_info=_json_text(request.extra_info, f"{where} extra_info"))


def _group_row(group: Group, epoch: int, batch_id: int) -> dict:
    where = f"prompt_id {group.prompt_id!r} group_id {group.group_id!r}"
    samples = [
        dict(s.__dict__, score_details=_json_text(s.score_details, f"{where} sample {s.sample_index} score_details"))
        for s in group.samples
    ]
    return dict(batch_id=batch_id, epoch=epoch, **_request_row(group.request, where), samples=samples)


def _request_from(row: dict) -> PromptRequest:
    fields = {name: row[name] for name, _ in _REQUEST_FIELDS}
    return PromptRequest(**fields | {"extra_info": json.loads(row["extra_info"])})


def _group_from(row: dict) -> Group:
    samples = [Sample(**s | {"score_details": json.loads(s["score_details"])}) for s in row["samples"]]
    return Group(_request_from(row), samples)


def _table(rows: list[dict], schema: pa.Schema, what: str) -> pa.Table:
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        for row in rows:  # find the row to name
            try:
                pa.Table.from_pylist([row], schema=schema)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as error:
                raise ValueError(f"{what}: prompt_id {row.get('prompt_id')!r}: {error}") from None
        raise


def save_buffer_state(state: dict, path: str | Path) -> None:
    """Write `ReplayBuffer.state_dict()` as a folder of parquet files, replacing `path` atomically
    (a crash mid-write leaves the previous folder in place)."""
    path = Path(path)
    scratch = path.with_name(path.name + ".writing")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    requests = [dict(epoch=epoch, **_request_row(r, f"prompt_id {r.prompt_id!r}")) for epoch, r in state["requests"]]
    groups = [_group_row(group, epoch, -1) for epoch, group in state["queue"]]
    for batch in state["unacked"]:
        groups += [_group_row(g, e, batch["batch_id"]) for g, e in zip(batch["groups"], batch["epochs"], strict=True)]
    scalars = {k: v for k, v in state.items() if k not in ("entries", "requests", "queue", "events")}
    scalars["unacked"] = [{k: v for k, v in b.items() if k not in ("groups", "epochs")} for b in state["unacked"]]
    ledger = _table(state["entries"], LEDGER_SCHEMA, "ledger")
    pq.write_table(ledger.replace_schema_metadata({_META_KEY: json.dumps(scalars)}), scratch / "ledger.parquet")
    pq.write_table(_table(requests, REQUESTS_SCHEMA, "requests"), scratch / "requests.parquet")
    pq.write_table(_table(groups, GROUPS_SCHEMA, "groups"), scratch / "groups.parquet")
    pq.write_table(_table(state["events"], EVENTS_SCHEMA, "events"), scratch / "events.parquet")
    previous = path.with_name(path.name + ".previous")
    if path.exists():
        os.replace(path, previous)
    os.replace(scratch, path)
    shutil.rmtree(previous, ignore_errors=True)


def load_buffer_state(path: str | Path) -> dict:
    """Read a folder written by `save_buffer_state` back into a state dict."""
    path = Path(path)
    if not (path / "ledger.parquet").exists() and path.with_name(path.name + ".previous").exists():
        path = path.with_name(path.name + ".previous")  # a crash hit between the two renames
    ledger = pq.read_table(path / "ledger.parquet")
    state = json.loads(ledger.schema.metadata[_META_KEY])
    state["entries"] = ledger.to_pylist()
    state["requests"] = [(row["epoch"], _request_from(row)) for row in pq.read_table(path / "requests.parquet").to_pylist()]
    state["events"] = pq.read_table(path / "events.parquet").to_pylist()
    batches = {b["batch_id"]: b | {"groups": [], "epochs": []} for b in state["unacked"]}
    state["queue"] = []
    for row in pq.read_table(path / "groups.parquet").to_pylist():
        if row["batch_id"] < 0:
            state["queue"].append((row["epoch"], _group_from(row)))
        else:
            batches[row["batch_id"]]["groups"].append(_group_from(row))
            batches[row["batch_id"]]["epochs"].append(row["epoch"])
    state["unacked"] = list(batches.values())
    return state
