"""Replay buffer: accounting rules on `BufferCore`, checkpoint files, and the real Ray actor
(concurrent callers, backpressure, a producer killed with ray.kill)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlactors.buffer import LedgerLog, load_buffer_state, read_checkpoint_ledger, save_buffer_state
from rlactors.buffer.core import BufferCore
from rlactors.buffer.records import (
    PUT_OUTCOMES,
    DynamicSamplingExhausted,
    RolloutErrorsExhausted,
    capacity_groups,
)
from rlactors.config import BufferConfig
from rlactors.rollout.samples import error_group
from rlactors.types import Group, PromptRequest, Sample


def make_group(request: PromptRequest, version: int, scores=(0.0, 1.0), error=None) -> Group:
    samples = [
        Sample(request.prompt_id, i, request.prompt_token_ids, [3, 4], [-0.1, -0.2], [version, version],
               error=error, score=score, score_details={"acc": score})
        for i, score in enumerate(scores)
    ]
    return Group(request, samples)


def prompts(count: int, start: int = 0) -> list[PromptRequest]:
    return [PromptRequest(f"p{i}", [1, i]) for i in range(start, start + count)]


def outcome(**counts) -> dict[str, int]:
    return dict.fromkeys(PUT_OUTCOMES, 0) | counts


def status_of(core: BufferCore, prompt_id: str, epoch: int = 0):
    """The ledger row, in flight (in memory) or finished (from the ledger log)."""
    return next(e for e in core.ledger(epoch) if e.prompt_id == prompt_id)


# -- backpressure and staleness ------------------------------------------------------------------


def test_capacity_follows_the_staleness_threshold():
    assert capacity_groups(4, 2, 0.0) == 8
    assert capacity_groups(4, 2, 0.5) == 12
    assert capacity_groups(3, 1, 0.5) == 4  # floor(4.5)


def test_reserve_stops_at_capacity_and_resumes_when_the_trainer_acks():
    core = BufferCore(capacity_groups=4, max_staleness=1)
    core.add_prompts(prompts(10))
    first = core.reserve(10, "a")
    assert [r.prompt_id for r in first] == ["p0", "p1", "p2", "p3"]
    assert [r.group_id for r in first] == ["p0#0.0", "p1#0.0", "p2#0.0", "p3#0.0"]
    assert core.reserve(1, "a") == []  # 4 ahead: backpressure
    core.put([make_group(r, 0) for r in first])
    assert core.reserve(1, "a") == []  # queued groups still count
    batch = core.sample(2, current_version=0)
    assert core.reserve(1, "a") == []  # sampled but unacked groups still count
    core.ack(batch.batch_id)
    assert [r.prompt_id for r in core.reserve(10, "a")] == ["p4", "p5"]


def test_stale_groups_are_evicted_and_their_prompts_reissued_first():
    core = BufferCore(capacity_groups=4, max_staleness=1)
    core.add_prompts(prompts(4))
    requests = core.reserve(2, "a")
    core.put([make_group(requests[0], 0), make_group(requests[1], 1)])
    batch = core.sample(1, current_version=2)
    assert batch.groups[0].prompt_id == "p1"  # p0 is 2 versions old
    assert batch.num_evicted_stale == 1 and batch.num_dropped["stale"] == 0  # evicted, not dropped: re-issued
    assert status_of(core, "p0").status == "pending" and status_of(core, "p0").num_evictions == 1
    assert core.event_log()[-1] == dict(kind="evicted_stale", epoch=0, prompt_id="p0", group_id="p0#0.0",
                                        policy_version=2, staleness=2, reason="")
    again = core.reserve(1, "a")
    assert [(r.prompt_id, r.group_id) for r in again] == [("p0", "p0#0.1")]  # before fresh p2
    assert core.put([make_group(requests[0], 2)]) == outcome(superseded=1)  # the old attempt, late
    assert core.metrics()["num_put_superseded"] == 1
    core.ack(batch.batch_id)
    core.put([make_group(again[0], 2)])
    assert core.sample(1, current_version=2).num_evicted_stale == 0  # counted with one batch only


def test_on_stale_drop_and_reissue_limit_record_the_reason():
    for on_stale, max_reissues, reason in [("drop", 3, "stale (on_stale=drop)"), ("reissue", 0, "stale (evicted 1 times)")]:
        core = BufferCore(capacity_groups=2, max_staleness=0, on_stale=on_stale, max_reissues=max_reissues)
        core.add_prompts(prompts(1))
        core.set_policy_version(1)
        assert core.put([make_group(core.reserve(1)[0], 0)]) == outcome(stale=1)  # stale on arrival
        entry = status_of(core, "p0")
        assert (entry.status, entry.reason) == ("dropped", reason)
        assert [e["kind"] for e in core.event_log()] == ["evicted_stale", "dropped"]


def test_policy_version_cannot_go_back():
    core = BufferCore(capacity_groups=2, max_staleness=0)
    core.set_policy_version(3)
    with pytest.raises(ValueError, match="from 3 to 2"):
        core.sample(1, current_version=2)


# -- dynamic sampling ----------------------------------------------------------------------------


def test_dynamic_sampling_rejects_zero_variance_groups_and_records_them_dropped():
    core = BufferCore(capacity_groups=8, max_staleness=0, dynamic_sampling=True, dynamic_sampling_metric="acc")
    core.add_prompts(prompts(4))
    requests = core.reserve(4)
    result = core.put([make_group(requests[0], 0, (1.0, 1.0)), make_group(requests[1], 0, (0.0, 1.0)),
                       make_group(requests[2], 0, (1.0,)), make_group(requests[3], 0, (0.0, 0.0))])
    assert result == outcome(zero_variance=2, kept=2)  # a group of one is never rejected
    assert [(e.prompt_id, e.status, e.reason) for e in core.ledger()] == [
        ("p0", "dropped", "zero_variance"), ("p1", "queued", ""), ("p2", "queued", ""), ("p3", "dropped", "zero_variance")]
    assert core.metrics()["num_put_zero_variance"] == 2


def test_dynamic_sampling_needs_the_metric_and_names_the_sample():
    core = BufferCore(capacity_groups=8, max_staleness=0, dynamic_sampling=True, dynamic_sampling_metric="acc")
    core.add_prompts(prompts(2))
    requests = core.reserve(2)
    bad = make_group(requests[1], 0)
    bad.samples[1].score_details = {}
    with pytest.raises(ValueError, match=r"prompt_id 'p1' group_id 'p1#0.0' sample 1: no 'acc'"):
        core.put([make_group(requests[0], 0), bad])
    assert len(core.queue) == 0 and len(core.reserved) == 2  # the good group was not applied either


def test_dynamic_sampling_gives_a_short_batch_after_its_rounds_then_fails_when_nothing_is_kept():
    core = BufferCore(capacity_groups=8, max_staleness=0, dynamic_sampling=True, max_generation_rounds=2)
    core.add_prompts(prompts(16))
    requests = core.reserve(4)
    core.put([make_group(requests[0], 0)] + [make_group(r, 0, (1.0, 1.0)) for r in requests[1:]])
    assert core.sample(4, 0) is None  # 4 generated, 1 kept: keep drawing (round 1 of 2)
    requests = core.reserve(4)
    core.put([make_group(r, 0, (1.0, 1.0)) for r in requests])
    batch = core.sample(4, 0)  # 2 rounds spent: the one kept group goes
    assert [g.prompt_id for g in batch.groups] == ["p0"] and core.metrics()["num_short_batches"] == 1
    core.ack(batch.batch_id)
    core.put([make_group(r, 0, (1.0, 1.0)) for r in core.reserve(4)])
    core.put([make_group(r, 0, (1.0, 1.0)) for r in core.reserve(4)])
    with pytest.raises(DynamicSamplingExhausted, match="kept no group out of the last 8"):
        core.sample(4, 0)


# -- bad input, errors, acks ---------------------------------------------------------------------


def test_bad_input_is_refused_with_the_item_named():
    core = BufferCore(capacity_groups=4, max_staleness=0)
    core.add_prompts(prompts(2))
    with pytest.raises(ValueError, match="prompt_id 'p1' added twice in epoch 0"):
        core.add_prompts(prompts(1, start=1))
    with pytest.raises(ValueError, match="'p0#0.0'.*never handed out"):
        core.put([make_group(PromptRequest("p0", [1], group_id="p0#0.0"), 0)])
    request = core.reserve(1)[0]
    group = make_group(request, 0)
    group.samples[1].token_policy_versions = []
    with pytest.raises(ValueError, match="prompt_id 'p0'.*sample 1: empty token_policy_versions"):
        core.put([group])
    with pytest.raises(ValueError, match="batch_size must be in 1..capacity_groups=4"):
        core.sample(5, 0)


def test_rollout_errors_are_dropped_with_the_error():
    core = BufferCore(capacity_groups=4, max_staleness=0)
    core.add_prompts(prompts(1))
    assert core.put([make_group(core.reserve(1)[0], 0, error="prompt too long")]) == outcome(rollout_error=1)
    assert status_of(core, "p0").reason == "rollout_error: prompt_id 'p0': prompt too long"


def test_a_group_whose_every_sample_failed_is_dropped_and_reported_with_the_next_batch():
    """A prompt the engine refused comes back as `error_group`: no sample carries a policy version."""
    core = BufferCore(capacity_groups=4, max_staleness=0)
    core.add_prompts(prompts(3))
    refused, *good = core.reserve(3)
    group = error_group(refused, 2, f"prompt_id={refused.prompt_id!r}: prompt is longer than max_model_len")
    assert core.put([group, *(make_group(r, 0) for r in good)]) == outcome(rollout_error=1, kept=2)
    entry = status_of(core, "p0")
    assert (entry.status, entry.reason) == ("dropped", "rollout_error: prompt_id='p0': prompt is longer than max_model_len")
    assert core.event_log()[-1]["kind"] == "dropped" and core.event_log()[-1]["prompt_id"] == "p0"
    assert core.metrics()["num_dropped_rollout_error"] == 1 and core.is_done() is False
    batch = core.sample(2, 0)
    assert [g.prompt_id for g in batch.groups] == ["p1", "p2"]
    assert batch.num_dropped == {"rollout_error": 1, "zero_variance": 0, "stale": 0}
    core.ack(batch.batch_id)
    core.add_prompts(prompts(2, start=3))
    core.put([make_group(r, 0) for r in core.reserve(2)])
    assert core.sample(2, 0).num_dropped == {"rollout_error": 0, "zero_variance": 0, "stale": 0}  # counted once


def test_rollout_errors_alone_for_the_generation_rounds_stop_with_the_latest_error():
    core = BufferCore(capacity_groups=2, max_staleness=0, max_generation_rounds=2)
    core.add_prompts(prompts(6))
    for _ in range(2):
        assert core.sample(2, 0) is None
        core.put([error_group(r, 2, f"prompt_id={r.prompt_id!r}: no live rollout engine") for r in core.reserve(2)])
    with pytest.raises(RolloutErrorsExhausted, match=r"last 4 groups .* all failed .*prompt_id='p3': no live rollout"):
        core.sample(2, 0)


def test_a_finished_prompt_is_refused_again_in_its_epoch_and_epochs_go_in_order(tmp_path):
    core = BufferCore(capacity_groups=2, max_staleness=0, log=LedgerLog(tmp_path / "ledger", flush_rows=1))
    core.add_prompts(prompts(2))
    core.put([make_group(r, 0) for r in core.reserve(2)])
    core.ack(core.sample(2, 0).batch_id)
    assert not core.entries  # the finished rows left memory for the log
    with pytest.raises(ValueError, match="prompt_id 'p1' added twice in epoch 0"):
        core.add_prompts(prompts(1, start=1))
    core.add_prompts(prompts(1, start=1), epoch=1)
    with pytest.raises(ValueError, match="epoch 0 is over: prompts of epoch 1 were added already"):
        core.add_prompts(prompts(1, start=5), epoch=0)
    core.put([make_group(r, 0) for r in core.reserve(1)])
    core.close()
    core.ack(core.sample(2, 0).batch_id)
    save_buffer_state(core.state_dict(), tmp_path / "buffer")
    resumed = BufferCore(capacity_groups=2, max_staleness=0, log=LedgerLog(tmp_path / "ledger"))
    resumed.closed = False
    resumed.load_state_dict(load_buffer_state(tmp_path / "buffer"))
    resumed.closed = False  # as if more prompts could come: the refusal survives the restart
    with pytest.raises(ValueError, match="prompt_id 'p1' added twice in epoch 1"):
        resumed.add_prompts(prompts(1, start=1), epoch=1)
    assert [(e.epoch, e.prompt_id, e.status) for e in resumed.ledger()] == [
        (0, "p0", "trained"), (0, "p1", "trained"), (1, "p1", "trained")]


def test_ack_records_training_once_and_nack_puts_groups_back_in_order():
    core = BufferCore(capacity_groups=4, max_staleness=2)
    core.add_prompts(prompts(3))
    core.put([make_group(r, 0) for r in core.reserve(3)])
    batch = core.sample(2, 1)
    core.nack(batch.batch_id)
    assert [item.group.prompt_id for item in core.queue] == ["p0", "p1", "p2"]
    batch = core.sample(2, 2)
    assert (batch.batch_id, batch.staleness) == (1, [2, 2])
    assert core.ack(batch.batch_id) and not core.ack(batch.batch_id)
    entry = status_of(core, "p1")
    assert (entry.status, entry.batch_id, entry.policy_version, entry.staleness) == ("trained", 1, 2, 2)
    with pytest.raises(ValueError, match="batch_id 0 was never delivered"):
        core.ack(0)


def test_closing_delivers_the_remainder_then_empty_batches():
    core = BufferCore(capacity_groups=4, max_staleness=0)
    core.add_prompts(prompts(3))
    core.close()
    core.put([make_group(r, 0) for r in core.reserve(4)])
    first = core.sample(2, 0)
    core.ack(first.batch_id)
    last = core.sample(2, 0)
    assert [g.prompt_id for g in last.groups] == ["p2"]
    assert not core.is_done() and core.reserve(4) == []
    core.ack(last.batch_id)
    empty = core.sample(2, 0)
    assert core.is_done() and (empty.batch_id, empty.groups) == (-1, []) and not core.unacked


def test_one_prompt_id_in_two_epochs_is_two_ledger_entries():
    core = BufferCore(capacity_groups=4, max_staleness=0)
    core.add_prompts(prompts(1), epoch=0)
    core.add_prompts(prompts(1), epoch=1)
    requests = core.reserve(2)
    assert [r.group_id for r in requests] == ["p0#0.0", "p0#1.0"]
    core.put([make_group(r, 0) for r in requests])
    core.ack(core.sample(2, 0).batch_id)
    assert [(e.epoch, e.status) for e in core.ledger()] == [(0, "trained"), (1, "trained")]


# -- checkpoints ---------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**62), 2**62) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)
int_lists = st.lists(st.integers(0, 2**40), max_size=4)


@st.composite
def groups(draw) -> Group:
    request = PromptRequest(draw(st.text(min_size=1, max_size=6)), draw(int_lists), draw(st.text(max_size=6)),
                            draw(st.text(max_size=3)), draw(st.text(max_size=3)),
                            draw(st.dictionaries(st.text(max_size=4), json_values, max_size=2)))
    samples = [
        Sample(request.prompt_id, i, request.prompt_token_ids, draw(int_lists),
               draw(st.lists(st.floats(allow_nan=False), max_size=4)), draw(st.lists(st.integers(0, 99), max_size=4)),
               draw(st.sampled_from(["stop", "length", "abort", "error"])), draw(st.none() | st.text(max_size=4)),
               draw(st.text(max_size=8)), draw(st.none() | st.floats(allow_nan=False)),
               draw(st.dictionaries(st.text(max_size=4), json_values, max_size=2)), draw(st.none() | st.text(max_size=4)),
               loss_mask=draw(st.lists(st.integers(0, 1), max_size=4)), num_turns=draw(st.integers(1, 9)),
               num_tool_calls=draw(st.integers(0, 9)), episode_reward=draw(st.none() | st.floats(allow_nan=False)),
               environment_error=draw(st.none() | st.text(max_size=4)))
        for i in range(draw(st.integers(1, 3)))
    ]
    baseline = draw(st.none() | st.builds(  # ReMax's greedy response
        lambda tokens, score: Sample(request.prompt_id, len(samples), request.prompt_token_ids, tokens, score=score),
        int_lists, st.none() | st.floats(allow_nan=False)))
    return Group(request, samples, baseline)


@settings(max_examples=40, deadline=None)
@given(group=groups())
def test_groups_round_trip_exactly_through_the_checkpoint_files(tmp_path_factory, group):
    state = BufferCore(capacity_groups=2, max_staleness=0).state_dict()
    state["queue"] = [(3, group)]
    path = tmp_path_factory.mktemp("state") / "buffer"
    save_buffer_state(state, path)
    [(epoch, loaded)] = load_buffer_state(path)["queue"]
    assert epoch == 3 and loaded == group
    assert [math.copysign(1, x) for s in loaded.samples for x in s.response_logprobs] == [
        math.copysign(1, x) for s in group.samples for x in s.response_logprobs]  # -0.0 stays -0.0


def test_values_json_would_change_are_refused_with_the_prompt_named(tmp_path):
    core = BufferCore(capacity_groups=2, max_staleness=0)
    core.add_prompts([PromptRequest("p7", [1], extra_info={"pair": (1, 2)})])
    with pytest.raises(ValueError, match=r"prompt_id 'p7' extra_info.pair: tuple value"):
        save_buffer_state(core.state_dict(), tmp_path / "buffer")


def simulate_step(core: BufferCore, step: int, held: list[PromptRequest]) -> list[PromptRequest]:
    """One step of a deterministic async-style loop: a producer keeps reservations in flight across
    steps and puts groups generated at the current version; the trainer samples, acks and bumps
    the version. Returns the reservations still held."""
    version = core.policy_version
    held = held + core.reserve(core.capacity_groups, "producer")
    ready, held = held[: len(held) // 2 + 1], held[len(held) // 2 + 1:]
    core.put([make_group(r, version - (step % 2), (0.0, float(len(r.prompt_id) % 2 or step % 3 == 0)))
              for r in ready])
    batch = core.sample(3, version + 1) if step % 3 else None
    if batch is not None:
        core.ack(batch.batch_id)
    return held


def simulate(core: BufferCore, num_steps: int, checkpoint_at: int | None = None, folder=None,
             num_lost_steps: int = 0) -> BufferCore:
    """`simulate_step` `num_steps` times. With `checkpoint_at`, the run saves its buffer there,
    goes on for `num_lost_steps` steps (appending to the ledger log under `folder`) and is
    killed; it resumes from the files with a new buffer on the same log folder (the producer's
    reservations are lost with it)."""
    options = dict(capacity_groups=core.capacity_groups, max_staleness=core.max_staleness,
                   dynamic_sampling=core.dynamic_sampling)
    held: list[PromptRequest] = []
    for step in range(num_steps):
        if step == checkpoint_at:
            save_buffer_state(core.state_dict(), folder / "buffer")
            cut = core.log.cut_without_flush()
            for lost in range(num_lost_steps):
                held = simulate_step(core, step + lost, held)
            assert core.log.num_segments > cut["num_segments"] or not num_lost_steps  # rows past the cut
            core, held = BufferCore(**options, log=LedgerLog(folder / "ledger")), []
            core.load_state_dict(load_buffer_state(folder / "buffer"))
        held = simulate_step(core, step, held)
    return core


@pytest.mark.parametrize("checkpoint_at, num_lost_steps", [(2, 0), (5, 0), (5, 3)])
def test_a_run_resumed_from_a_checkpoint_ends_with_the_same_ledger(tmp_path, checkpoint_at, num_lost_steps):
    """Also when the killed run went on past the checkpoint, appending finished rows and events to
    the ledger log: resuming truncates the log to the checkpoint's cut, so nothing counts twice."""
    def fresh(log=None):
        core = BufferCore(capacity_groups=6, max_staleness=1, dynamic_sampling=True, log=log)
        core.add_prompts(prompts(30))
        return core

    straight = simulate(fresh(), 12)
    resumed = simulate(fresh(LedgerLog(tmp_path / "ledger", flush_rows=1)), 12, checkpoint_at, tmp_path, num_lost_steps)
    assert len(resumed.reserved) > 0 and resumed.metrics()["num_evicted_stale"] > 0  # the case is not trivial
    assert resumed.ledger() == straight.ledger()
    assert {s for s in ("trained", "dropped") if any(e.status == s for e in straight.ledger())} == {"trained", "dropped"}
    assert [item.group for item in resumed.queue] == [item.group for item in straight.queue]
    assert resumed.event_log() == straight.event_log()
    assert resumed.metrics() == straight.metrics() | {"num_log_rows_waiting": resumed.log.num_pending_rows()}


def test_memory_and_checkpoint_hold_the_in_flight_window_and_the_log_the_rest(tmp_path):
    core = BufferCore(capacity_groups=6, max_staleness=1, log=LedgerLog(tmp_path / "ledger", flush_rows=50))
    sizes, held = [], []
    for step in range(300):
        if len(core.reissued) + len(core.fresh) < 6:  # a 40-prompt data set: many epochs
            epoch, start = divmod(core.metrics()["num_prompts_added"], 40)
            core.add_prompts(prompts(min(6, 40 - start), start), epoch)
        held = simulate_step(core, step, held)
        if step % 50 == 49:
            state = core.state_dict()
            sizes.append((len(state["entries"]), len(state["requests"]), len(json.dumps(state["epochs"]))))
            assert core.log.num_pending_rows() == 0  # the cut appended them
        # In flight: under 6 pending + 6 just added, and capacity_groups reserved, queued or unacked.
        assert len(core.entries) <= 18 and core.log.num_pending_rows() < 50 + 18
    assert max(sizes) <= (18, 18, 200) and core.epochs.newest_epoch >= 8
    assert len(core.epochs.finished_in_newest) <= 40
    save_buffer_state(core.state_dict(), tmp_path / "buffer")
    ledger = read_checkpoint_ledger(tmp_path / "buffer", tmp_path / "ledger")
    assert [(e.epoch, e.prompt_id, e.status) for e in core.ledger()] == sorted(
        (row["epoch"], row["prompt_id"], row["status"]) for row in ledger)
    assert sum(row["status"] == "trained" for row in ledger) == core.metrics()["num_trained"] >= 300


def test_a_checkpoint_whose_ledger_log_was_rewritten_or_lost_is_refused(tmp_path):
    def run_on(log, steps, start=0):  # reservations held at the end are lost with the run
        held = []
        for step in range(start, start + steps):
            held = simulate_step(core, step, held)
        return log

    core = BufferCore(capacity_groups=6, max_staleness=1, log=LedgerLog(tmp_path / "ledger", flush_rows=1))
    core.add_prompts(prompts(30))
    run_on(core.log, 3)
    save_buffer_state(core.state_dict(), tmp_path / "early")
    run_on(core.log, 3, 3)
    save_buffer_state(core.state_dict(), tmp_path / "late")
    core = BufferCore(capacity_groups=6, max_staleness=1, log=LedgerLog(tmp_path / "ledger", flush_rows=1))
    core.load_state_dict(load_buffer_state(tmp_path / "early"))  # back to the early cut; the run goes on
    run_on(core.log, 6, 3)
    with pytest.raises(ValueError, match="was rewritten by a run resumed from an earlier checkpoint"):
        BufferCore(capacity_groups=6, max_staleness=1, log=LedgerLog(tmp_path / "ledger")).load_state_dict(
            load_buffer_state(tmp_path / "late"))
    with pytest.raises(ValueError, match=r"segments \[0, .*\] of the \d+ this checkpoint counts are missing"):
        BufferCore(capacity_groups=6, max_staleness=1, log=LedgerLog(tmp_path / "elsewhere")).load_state_dict(
            load_buffer_state(tmp_path / "early"))


def test_unacked_batches_come_back_after_a_restart_and_are_trained_once(tmp_path):
    core = BufferCore(capacity_groups=4, max_staleness=1)
    core.add_prompts(prompts(4))
    core.put([make_group(r, 0) for r in core.reserve(4)])
    core.ack(core.sample(2, 0).batch_id)
    lost = core.sample(2, 0)  # the trainer dies before acking this one
    save_buffer_state(core.state_dict(), tmp_path / "buffer")
    save_buffer_state(core.state_dict(), tmp_path / "buffer")  # overwriting keeps one good copy
    resumed = BufferCore(capacity_groups=4, max_staleness=1, log=core.log)
    resumed.load_state_dict(load_buffer_state(tmp_path / "buffer"))
    again = resumed.sample(2, 1)
    assert again.groups == lost.groups and again.batch_id != lost.batch_id
    resumed.ack(again.batch_id)
    assert [e.status for e in resumed.ledger()] == ["trained"] * 4
    assert resumed.metrics()["num_trained"] == 4
    with pytest.raises(ValueError, match=f"batch_id {lost.batch_id} was never delivered"):
        resumed.ack(lost.batch_id)  # its groups came back under a new batch id


# -- the Ray actor -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_buffer_module(ray_session):
    import sys

    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this file
    from rlactors.buffer import ReplayBuffer

    @ray.remote(num_cpus=0)
    class Producer:
        """Stands in for a rollout engine; keeps the Groups it makes in its own object store."""

        def __init__(self, buffer, name: str):
            self.buffer, self.name = buffer, name

        async def reserve(self, max_count: int) -> list[PromptRequest]:
            return await self.buffer.reserve.remote(max_count, self.name)

        async def generate(self, requests: list[PromptRequest], version: int) -> None:
            refs = [ray.put(make_group(r, version)) for r in requests]  # owned by this actor
            await self.buffer.put.remote(refs)  # inside a list: the buffer receives the refs

        async def run(self, version: int) -> int:
            num_groups = 0
            while requests := await self.buffer.reserve.remote(2, self.name):
                await self.generate(requests, version)
                num_groups += len(requests)
            return num_groups

    return ray, ReplayBuffer, Producer


def test_buffered_groups_outlive_a_killed_producer(ray_buffer_module):
    ray, ReplayBuffer, Producer = ray_buffer_module
    buffer = ReplayBuffer.remote(BufferConfig(max_staleness=1, staleness_threshold=1.0), batch_size_prompts=2)
    ray.get(buffer.add_prompts.remote(prompts(8)))
    ray.get(buffer.close.remote())
    first, doomed = Producer.remote(buffer, "first"), Producer.remote(buffer, "doomed")
    held = ray.get(doomed.reserve.remote(2))
    [request] = ray.get(first.reserve.remote(1))
    ray.get(first.generate.remote([request], 0))
    ray.kill(first)
    ray.kill(doomed)  # dies holding two reservations
    batch = ray.get(buffer.sample.remote(1, 0))
    assert ray.get(batch.groups_ref) == [make_group(request, 0)]  # readable although its maker is dead
    assert batch.group_ids == [request.group_id] and batch.response_lengths == [2, 2]  # numbers, no tokens
    assert batch.scores == batch.accuracies == [0.0, 1.0] and batch.prompt_lengths == [2, 2]
    ray.get(buffer.ack.remote(batch.batch_id))
    assert sorted(ray.get(buffer.cancel_reservations.remote("doomed"))) == sorted(r.group_id for r in held)

    worker = Producer.remote(buffer, "worker")
    produced = worker.run.remote(1)
    while (batch := ray.get(buffer.sample.remote(2, 1))).group_ids:
        ray.get(buffer.ack.remote(batch.batch_id))
    assert batch.batch_id == -1 and batch.groups_ref is None
    assert ray.get(produced) == 7
    ledger = ray.get(buffer.ledger.remote())
    assert sorted(e["prompt_id"] for e in ledger) == [f"p{i}" for i in range(8)]
    assert all(e["status"] == "trained" for e in ledger)
    assert {e["group_id"] for e in ledger if e["prompt_id"] in {r.prompt_id for r in held}} == {
        r.group_id.replace(".0", ".1") for r in held}  # re-issued as a new attempt
    assert ray.get(buffer.metrics.remote())["num_trained"] == 8


def test_reserve_and_sample_wait_for_each_other(ray_buffer_module):
    ray, ReplayBuffer, _ = ray_buffer_module
    buffer = ReplayBuffer.remote(BufferConfig(), batch_size_prompts=2)  # capacity 2, synchronous
    ray.get(buffer.add_prompts.remote(prompts(4)))
    first = ray.get(buffer.reserve.remote(4, "a"))
    assert len(first) == 2
    blocked = buffer.reserve.remote(1, "a")
    waiting = buffer.sample.remote(2, 0)
    assert ray.wait([blocked, waiting], timeout=0.5)[0] == []
    ray.get(buffer.put.remote([make_group(r, 0) for r in first]))
    batch = ray.get(waiting)
    assert [g.group_id for g in ray.get(batch.groups_ref)] == batch.group_ids == [r.group_id for r in first]
    assert ray.wait([blocked], timeout=0.3)[0] == []  # the batch is not acked yet
    ray.get(buffer.ack.remote(batch.batch_id))
    assert [r.prompt_id for r in ray.get(blocked)] == ["p2"]
    with pytest.raises(TimeoutError, match="buffer.sample waited 0.2 s"):
        ray.get(buffer.sample.remote(2, 0, timeout_s=0.2))
    metrics = ray.get(buffer.metrics.remote())
    assert metrics["sample_wait_s"] > 0 and metrics["num_groups_ahead"] == 1


def test_a_sample_without_a_wait_answers_at_once_either_way(ray_buffer_module):
    # The colocated driver asks so before each round of generation (nothing can arrive meanwhile).
    ray, ReplayBuffer, _ = ray_buffer_module
    buffer = ReplayBuffer.remote(BufferConfig(), batch_size_prompts=2)
    ray.get(buffer.add_prompts.remote(prompts(2)))
    requests = ray.get(buffer.reserve.remote(2, "a"))
    ray.get(buffer.put.remote([make_group(requests[0], 0)]))
    with pytest.raises(TimeoutError, match="buffer.sample waited 0.0 s"):
        ray.get(buffer.sample.remote(2, 0, timeout_s=0.0))
    ray.get(buffer.put.remote([make_group(requests[1], 0)]))
    batch = ray.get(buffer.sample.remote(2, 0, timeout_s=0.0))
    assert batch.group_ids == [r.group_id for r in requests]


def test_actor_state_round_trips_through_files_mid_run(ray_buffer_module, tmp_path):
    ray, ReplayBuffer, _ = ray_buffer_module
    config = BufferConfig(max_staleness=2, staleness_threshold=1.0)
    buffer = ReplayBuffer.remote(config, batch_size_prompts=2, ledger_dir=str(tmp_path / "ledger"))
    ray.get(buffer.add_prompts.remote(prompts(6)))
    requests = ray.get(buffer.reserve.remote(4, "a"))
    ray.get(buffer.put.remote([make_group(r, 0) for r in requests[:3]]))
    ray.get(buffer.ack.remote(ray.get(buffer.sample.remote(2, 0)).batch_id))
    ray.get(buffer.save.remote(str(tmp_path / "buffer")))  # the files are written by the actor itself
    before = ray.get(buffer.ledger.remote())
    ray.kill(buffer)

    resumed = ReplayBuffer.remote(config, batch_size_prompts=2, ledger_dir=str(tmp_path / "ledger"))
    ray.get(resumed.load.remote(str(tmp_path / "buffer")))
    after = ray.get(resumed.ledger.remote())
    assert [e["status"] for e in before] == ["trained", "trained", "queued", "reserved", "pending", "pending"]
    assert after == [e | {"status": "pending", "num_attempts": 0} if e["status"] == "reserved" else e for e in before]
    again = ray.get(resumed.reserve.remote(4, "b"))
    assert [r.group_id for r in again] == ["p3#0.0", "p4#0.0", "p5#0.0"]  # the lost reservation first
    ray.get(resumed.put.remote([make_group(r, 1) for r in again]))
    ray.get(resumed.close.remote())
    while (batch := ray.get(resumed.sample.remote(2, 1))).group_ids:
        ray.get(resumed.ack.remote(batch.batch_id))
    assert [e["status"] for e in ray.get(resumed.ledger.remote())] == ["trained"] * 6


def test_a_checkpoint_of_another_run_resumes_into_a_copy_of_its_ledger_log(ray_buffer_module, tmp_path):
    """`pipeline.resume=<other run's checkpoint>`: the new run's buffer copies the other run's log up to
    the cut into its own output dir, and the other run's log is left as it was."""
    ray, ReplayBuffer, _ = ray_buffer_module
    config = BufferConfig()
    first = tmp_path / "first"
    buffer = ReplayBuffer.remote(config, batch_size_prompts=2, ledger_dir=str(first / "ledger"))
    ray.get(buffer.add_prompts.remote(prompts(4)))
    ray.get(buffer.put.remote([make_group(r, 0) for r in ray.get(buffer.reserve.remote(2, "a"))]))
    ray.get(buffer.ack.remote(ray.get(buffer.sample.remote(2, 0)).batch_id))
    checkpoint = first / "checkpoints" / "step_00000001" / "buffer"
    ray.get(buffer.save.remote(str(checkpoint)))
    before = ray.get(buffer.ledger.remote())
    first_log = sorted(p.name for p in (first / "ledger").rglob("*.parquet"))
    ray.kill(buffer)

    second = tmp_path / "second"
    resumed = ReplayBuffer.remote(config, batch_size_prompts=2, ledger_dir=str(second / "ledger"))
    ray.get(resumed.load.remote(str(checkpoint)))
    assert ray.get(resumed.ledger.remote()) == before and [e["status"] for e in before][:2] == ["trained"] * 2
    ray.get(resumed.put.remote([make_group(r, 0) for r in ray.get(resumed.reserve.remote(2, "b"))]))
    ray.get(resumed.ack.remote(ray.get(resumed.sample.remote(2, 0)).batch_id))
    ray.get(resumed.save.remote(str(second / "checkpoints" / "step_00000002" / "buffer")))
    assert [e["status"] for e in ray.get(resumed.ledger.remote())] == ["trained"] * 4
    assert sorted(p.name for p in (first / "ledger").rglob("*.parquet")) == first_log  # untouched
    ray.kill(resumed)
