"""What a `BufferCore` checkpoint holds, and how a buffer resumes from one (plain functions over
the core; `BufferCore.state_dict` / `load_state_dict` call them).

The state is the in-flight window only: ledger rows not yet trained or dropped, unfinished
prompts (with their requests) in hand-out order, open reservations, queued groups and unacked
batches by value; plus a few scalars: counts of finished rows (per open epoch, in total for the
others: `rlactors.buffer.epochs`), counters, and the cut of the ledger log, where every finished
row and event is (`rlactors.buffer.ledger_log`). Its size does not grow with the length of the
run. Plain Python values and `Group`/`PromptRequest` dataclasses.

Resuming truncates the log to the cut (what the killed run appended after the checkpoint will be
produced again), then checks the log against the checkpoint's per-epoch counts, and rebuilds the
newest epoch's set of finished prompt_ids from it (so a prompt added twice is still refused).
A checkpoint whose log is missing, rewritten or short is an error naming the log, never a resume
that silently counts a prompt twice or not at all.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque

from rlactors.buffer.records import LedgerEntry, QueuedGroup


def core_state(core) -> dict:
    """The state to save; appends the log's waiting rows first (the cut covers them)."""
    return {
        "policy_version": core.policy_version,
        "closed": core.closed,
        "next_batch_id": core.next_batch_id,
        "num_put_since_batch": core.num_put_since_batch,
        "entries": [dataclasses.asdict(e) for e in core.entries.values()],
        "requests": [(key[0], request) for key, request in core.requests.items()],
        "reissued": [list(key) for key in core.reissued],
        "fresh": [list(key) for key in core.fresh],
        "reserved": [[gid, *r.key, r.producer_id, r.policy_version] for gid, r in core.reserved.items()],
        "queue": [(item.epoch, item.group) for item in core.queue],
        "unacked": [
            dict(batch_id=b.batch_id, policy_version=b.policy_version, groups=list(b.groups),
                 staleness=list(b.staleness), epochs=list(b.epochs))
            for b in core.unacked.values()
        ],
        "nacked_batch_ids": sorted(core.nacked_batch_ids),
        "epochs": core.epochs.state(),
        "drops_since_batch": dict(core.drops_since_batch),
        "last_rollout_error": core.last_rollout_error,
        "counters": dict(core.counters),
        "trained_staleness": {str(s): n for s, n in core.trained_staleness.items()},
        "log": core.log.cut(),
    }


def load_core_state(core, state: dict) -> None:
    """Resume. Open reservations died with their producers: their prompts are handed out again
    first, under the same group_id. Unacked batches were not trained: their groups return to the
    front of the queue (staleness is checked again at the next sample) and their batch ids count
    as nacked. Raises ValueError naming the log if it does not match the checkpoint."""
    core.log.restore(state["log"])
    core.entries = {(e["epoch"], e["prompt_id"]): LedgerEntry(**e) for e in state["entries"]}
    found, finished_in_newest = core.log.finished_summary(state["epochs"]["newest_epoch"])
    core.epochs.load(state["epochs"], list(core.entries.values()), found, finished_in_newest, core.log.where())
    core.policy_version = state["policy_version"]
    core.closed = state["closed"]
    core.next_batch_id = state["next_batch_id"]
    core.num_put_since_batch = state["num_put_since_batch"]
    core.requests = {(epoch, r.prompt_id): r for epoch, r in state["requests"]}
    core.reissued = deque(tuple(key) for key in state["reissued"])
    core.fresh = deque(tuple(key) for key in state["fresh"])
    core.reserved = {}
    for _group_id, epoch, prompt_id, _producer_id, _version in reversed(state["reserved"]):
        entry = core.entries[(epoch, prompt_id)]
        entry.status, entry.num_attempts = "pending", entry.num_attempts - 1
        core.reissued.appendleft((epoch, prompt_id))
    core.queue = deque(QueuedGroup(epoch, g, g.oldest_policy_version) for epoch, g in state["queue"])
    core.unacked = {}
    core.nacked_batch_ids = set(state["nacked_batch_ids"])
    for batch in sorted(state["unacked"], key=lambda b: b["batch_id"], reverse=True):
        for group, epoch in zip(reversed(batch["groups"]), reversed(batch["epochs"]), strict=True):
            entry = core.entries[(epoch, group.prompt_id)]
            entry.status, entry.batch_id = "queued", -1
            core.queue.appendleft(QueuedGroup(epoch, group, group.oldest_policy_version))
        core.nacked_batch_ids.add(batch["batch_id"])
    core.num_unacked_groups = 0
    core.drops_since_batch = Counter(state["drops_since_batch"])
    core.last_rollout_error = state["last_rollout_error"]
    core.counters = Counter(state["counters"])
    core.trained_staleness = Counter({int(s): n for s, n in state["trained_staleness"].items()})
