"""Random interleavings of producers, version bumps, consumers, producer deaths, checkpoint round
trips and kills after a checkpoint (the run goes on, appending to the ledger log, then resumes
from the checkpoint) against `BufferCore` (no Ray), checking the buffer's promises after every step
and that every prompt ends trained exactly once or dropped with a reason."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rlactors.buffer import LedgerLog, load_buffer_state, save_buffer_state
from rlactors.buffer.core import BufferCore
from rlactors.buffer.records import (
    TERMINAL,
    DynamicSamplingExhausted,
    RolloutErrorsExhausted,
    capacity_groups,
)
from rlactors.types import Group, PromptRequest, Sample

NUM_PROMPT_IDS = 12


def make_group(request: PromptRequest, versions: list[int], scores: list[float], error: str | None = None) -> Group:
    """One sample per score; sample i's tokens came from `versions` (a response may span several)."""
    samples = [
        Sample(request.prompt_id, i, request.prompt_token_ids, [5, 6, 7], [-0.5, -0.25, -1.0],
               [versions[0], versions[-1], versions[-1]], "stop", error if i == 0 else None,
               "text", score, {"acc": score})
        for i, score in enumerate(scores)
    ]
    return Group(request, samples)


class BufferMachine(RuleBasedStateMachine):
    @initialize(
        batch_size=st.integers(1, 3), trigger=st.integers(1, 2), threshold=st.sampled_from([0.0, 0.5, 1.0]),
        max_staleness=st.integers(0, 2), on_stale=st.sampled_from(["reissue", "drop"]),
        max_reissues=st.integers(0, 2), dynamic_sampling=st.booleans(), rounds=st.integers(1, 3),
        log_on_disk=st.booleans(), flush_rows=st.sampled_from([1, 4, 10_000]),
    )
    def setup(self, batch_size, trigger, threshold, max_staleness, on_stale, max_reissues, dynamic_sampling, rounds,
              log_on_disk, flush_rows):
        self.batch_size = batch_size
        self.options = dict(
            capacity_groups=capacity_groups(batch_size, trigger, threshold), max_staleness=max_staleness,
            on_stale=on_stale, max_reissues=max_reissues, dynamic_sampling=dynamic_sampling,
            dynamic_sampling_metric="acc", max_generation_rounds=rounds,
        )
        # On disk, a restarted buffer opens the same folder, as a new actor would; in memory it
        # shares the log object.
        self.folder = tempfile.mkdtemp(prefix="ledger_") if log_on_disk else None
        self.flush_rows = flush_rows
        self.core = BufferCore(**self.options, log=LedgerLog(self.folder, flush_rows))
        self.saved = None  # (state, the model's fields) at the last checkpoint
        self.version = 0
        self.epoch = 0
        self.added: set[tuple[int, str]] = set()
        self.held: dict[str, list[tuple[PromptRequest, int]]] = {"0": [], "1": []}  # producer -> (request, version)
        self.put_groups: list[Group] = []  # to re-put as duplicates
        self.delivered: set[str] = set()  # group_ids handed to the trainer
        self.unacked: list[int] = []
        self.trained: set[tuple[int, str]] = set()

    # -- producers ----------------------------------------------------------------------------

    @rule(count=st.integers(1, 5))
    def add_prompts(self, count):
        free = [f"p{i}" for i in range(NUM_PROMPT_IDS) if (self.epoch, f"p{i}") not in self.added][:count]
        if free:
            self.core.add_prompts([PromptRequest(pid, [1, 2, i]) for i, pid in enumerate(free)], self.epoch)
            self.added |= {(self.epoch, pid) for pid in free}

    @rule()
    def new_epoch(self):
        self.epoch += 1

    @rule(producer=st.sampled_from(["0", "1"]), count=st.integers(1, 4))
    def reserve(self, producer, count):
        free = self.core.num_free_slots()
        pending = len(self.core.reissued) + len(self.core.fresh)
        got = self.core.reserve(count, producer)
        assert len(got) == min(count, free, pending)  # hands out what it can, no more (backpressure)
        self.held[producer] += [(request, self.version) for request in got]

    @rule(producer=st.sampled_from(["0", "1"]), count=st.integers(1, 3), lag=st.integers(0, 2),
          kind=st.sampled_from(["mixed", "same", "error", "single"]))
    def put(self, producer, count, lag, kind):
        taken, self.held[producer] = self.held[producer][:count], self.held[producer][count:]
        scores = {"mixed": [0.0, 1.0], "same": [1.0, 1.0], "error": [0.0, 1.0], "single": [1.0]}[kind]
        groups = [
            make_group(request, [max(0, version - lag), version], scores, "engine died" if kind == "error" else None)
            for request, version in taken
        ]
        result = self.core.put(groups)
        assert sum(result.values()) == len(groups)
        self.put_groups += groups

    @rule(producer=st.sampled_from(["0", "1"]), count=st.integers(1, 3), lag=st.integers(0, 2),
          kind=st.sampled_from(["mixed", "mixed", "same", "single"]))
    def reserve_and_put(self, producer, count, lag, kind):
        self.reserve(producer, count)
        self.put(producer, count, lag, kind)

    @precondition(lambda self: self.put_groups)
    @rule(data=st.data())
    def put_duplicate(self, data):
        group = data.draw(st.sampled_from(self.put_groups))
        assert self.core.put([group])["superseded"] == 1

    @rule(producer=st.sampled_from(["0", "1"]))
    def producer_dies(self, producer):
        cancelled = self.core.cancel_reservations(producer)
        assert sorted(cancelled) == sorted(request.group_id for request, _ in self.held[producer])
        self.put_groups += [make_group(request, [version], [0.0, 1.0]) for request, version in self.held[producer]]
        self.held[producer] = []  # a late put of these is ignored (put_duplicate covers it)

    # -- trainer ------------------------------------------------------------------------------

    @rule()
    def bump_version(self):
        self.version += 1

    @rule()
    def sample(self):
        try:
            batch = self.core.sample(self.batch_size, self.version)
        except DynamicSamplingExhausted:
            assert self.core.dynamic_sampling and not self.core.queue
            return
        except RolloutErrorsExhausted:  # the run would stop here, naming the error; the state is unchanged
            assert not self.core.queue and self.core.drops_since_batch["rollout_error"] >= self.batch_size
            return
        if batch is None:
            return
        assert len(batch.groups) <= self.batch_size
        for group, staleness in zip(batch.groups, batch.staleness, strict=True):
            assert staleness == self.version - group.oldest_policy_version <= self.options["max_staleness"]
            assert group.group_id not in self.delivered, f"{group.group_id} delivered twice"
            self.delivered.add(group.group_id)
        self.unacked.append(batch.batch_id)

    @precondition(lambda self: self.unacked)
    @rule(data=st.data(), train=st.booleans())
    def finish_batch(self, data, train):
        batch_id = data.draw(st.sampled_from(self.unacked))
        self.unacked.remove(batch_id)
        batch = self.core.unacked[batch_id]
        if train:
            keys = {(epoch, group.prompt_id) for group, epoch in zip(batch.groups, batch.epochs, strict=True)}
            assert not keys & self.trained, f"trained twice: {keys & self.trained}"
            self.trained |= keys
            assert self.core.ack(batch_id) and not self.core.ack(batch_id)  # second ack is a no-op
        else:
            self.core.nack(batch_id)
            self.delivered -= {group.group_id for group in batch.groups}

    @rule(through_files=st.booleans())
    def checkpoint(self, through_files):
        state = self.core.state_dict()
        if through_files:
            with tempfile.TemporaryDirectory() as folder:
                save_buffer_state(state, f"{folder}/buffer")
                state = load_buffer_state(f"{folder}/buffer")
        # Unacked batches were never trained: their groups come back and may be delivered again.
        delivered = self.delivered - {g.group_id for batch_id in self.unacked for g in self.core.unacked[batch_id].groups}
        self.saved = state, copy.deepcopy(dict(added=self.added, trained=self.trained, delivered=delivered,
                                               epoch=self.epoch, version=self.version, put_groups=self.put_groups))

    @precondition(lambda self: self.saved is not None)
    @rule()
    def killed_and_resumed_from_the_last_checkpoint(self):
        """Whatever happened since the checkpoint (rows appended to the log included) is lost."""
        state, model = self.saved
        log = self.core.log if self.folder is None else LedgerLog(self.folder, self.flush_rows)
        self.core = BufferCore(**self.options, log=log)
        self.core.load_state_dict(copy.deepcopy(state))
        for name, value in copy.deepcopy(model).items():
            setattr(self, name, value)
        self.unacked = []
        self.held = {"0": [], "1": []}  # producers restart empty-handed

    @rule(through_files=st.booleans())
    def restart_from_checkpoint(self, through_files):
        self.checkpoint(through_files)
        self.killed_and_resumed_from_the_last_checkpoint()

    # -- promises -----------------------------------------------------------------------------

    @invariant()
    def within_capacity(self):
        if hasattr(self, "core"):
            core = self.core
            assert core.num_unacked_groups == sum(len(b.groups) for b in core.unacked.values())
            assert len(core.reserved) + len(core.queue) + core.num_unacked_groups <= core.capacity_groups

    @invariant()
    def ledger_matches_the_queues(self):
        if not hasattr(self, "core"):
            return
        core = self.core
        statuses = {key: e.status for key, e in core.entries.items()}
        assert all(s not in TERMINAL for s in statuses.values())  # finished rows left memory
        assert core.num_unfinished == len(statuses)
        if self.folder is None:  # on disk, reading the log at every step is slow: teardown reads it
            ledger = {(e.epoch, e.prompt_id): e for e in core.ledger()}
            assert set(ledger) == self.added and len(ledger) == len(core.ledger())
            assert {k for k, e in ledger.items() if e.status == "trained"} == self.trained
            assert all(e.reason for e in ledger.values() if e.status == "dropped")
        assert sorted([*core.reissued, *core.fresh]) == sorted(k for k, s in statuses.items() if s == "pending")
        assert sorted(r.key for r in core.reserved.values()) == sorted(k for k, s in statuses.items() if s == "reserved")
        assert sorted((i.epoch, i.group.prompt_id) for i in core.queue) == sorted(
            k for k, s in statuses.items() if s == "queued")

    def teardown(self):
        """Drain: close, generate fresh groups for everything left, train it all; then every prompt
        ever added is trained exactly once or dropped with a reason."""
        if not hasattr(self, "core"):
            return
        core = self.core
        core.close()
        for batch_id in self.unacked:
            self.finish_batch_by_id(batch_id)
        for held in self.held.values():  # the producers finish what they hold
            core.put([make_group(request, [self.version], [0.0, 1.0]) for request, _ in held])
        for _ in range(10 * NUM_PROMPT_IDS * (self.epoch + 1)):
            if core.is_done():
                break
            requests = core.reserve(core.capacity_groups, "drain")
            core.put([make_group(r, [self.version], [0.0, 1.0]) for r in requests])
            try:
                batch = core.sample(self.batch_size, self.version)
            except (DynamicSamplingExhausted, RolloutErrorsExhausted):
                continue
            if batch is not None and batch.groups:
                assert all(s <= self.options["max_staleness"] for s in batch.staleness)
                self.finish_batch_by_id(batch.batch_id)
        assert core.is_done(), core.metrics()
        for name, value in core.metrics().items():  # shown by --hypothesis-show-statistics
            if name.startswith("num_") and value:
                event(name)
        ledger = core.ledger()
        assert sorted((e.epoch, e.prompt_id) for e in ledger) == sorted(self.added)  # one row each
        for entry in ledger:
            assert entry.status == "trained" or (entry.status == "dropped" and entry.reason), entry
        assert core.metrics()["num_trained"] == len(self.trained) == sum(e.status == "trained" for e in ledger)
        if self.folder is not None:
            shutil.rmtree(self.folder)

    def finish_batch_by_id(self, batch_id):
        batch = self.core.unacked[batch_id]
        keys = {(epoch, group.prompt_id) for group, epoch in zip(batch.groups, batch.epochs, strict=True)}
        assert not keys & self.trained
        self.trained |= keys
        self.core.ack(batch_id)


BufferMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("BUFFER_EXAMPLES", 100)), stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBufferProperties = BufferMachine.TestCase
