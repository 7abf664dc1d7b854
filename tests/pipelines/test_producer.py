"""The fully-async producer over the real replay buffer, with each group made in the test the
moment it is asked for instead of by an engine (the engines' side is tests/rollout): what the
producer counts against its quota per published version, and the trainer's bounded wait."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import ray

from rlactors.buffer.client import BufferClient
from rlactors.config import load_config
from rlactors.data import PromptDataset, read_parquet_rows
from rlactors.data.synthetic import write_task
from rlactors.models import build_char_tokenizer
from rlactors.pipelines import fully_async
from rlactors.pipelines.fully_async import Producer, next_batch
from rlactors.types import Group, Sample

# The DAPO async example's numbers (examples/math_dapo_qwen2.5_math_7b_async.yaml): a quota of
# (1 + 0.5) x 128 x 4 = 768 groups per published version, of which 4 batches of 128 are trained.
DAPO_ASYNC = ["pipeline.mode=async", "pipeline.batch_size_prompts=128", "pipeline.trigger_parameter_sync_step=4",
              "buffer.staleness_threshold=0.5", "buffer.max_staleness=2", "buffer.dynamic_sampling=true",
              "buffer.dynamic_sampling_metric=score", "buffer.max_generation_rounds=10",
              "rollout.sampling.num_samples_per_prompt=4"]


class InstantRouter:
    """Answers each request with a group of `num_samples` one-token samples labelled with the
    version it holds, `per_call` groups per read of its stream (oldest first; None: all at once);
    `flat(prompt_id)` says which prompts score 0 on every sample (zero variance: dynamic sampling
    drops them), the others score 0 and 1 in turn. After `stop_after` groups its stream goes quiet,
    as a stalled engine's, until `resume` is set. `adds` records, per `add`, how many groups came
    and how many were in flight before; `num_reads` counts the reads of its stream."""

    def __init__(self, num_samples: int, flat, stop_after: int | None = None, per_call: int | None = None,
                 capacity: int = 0):
        self.num_samples, self.flat, self.stop_after, self.per_call = num_samples, flat, stop_after, per_call
        self.max_num_seqs = capacity
        self.policy_version, self.num_generated, self.num_reads = 0, 0, 0
        self.resume = threading.Event()
        self.adds: list[tuple[int, int]] = []
        self.closed_with: list[str] | None = None  # the group_ids in flight when the producer closed its stream

    def stream(self):
        return InstantStream(self)

    def answer(self, request):
        self.num_generated += 1
        scores = [0.0 if self.flat(request.prompt_id) else float(k % 2) for k in range(self.num_samples)]
        samples = [Sample(request.prompt_id, k, list(request.prompt_token_ids), [7], [-0.1], [self.policy_version],
                          score=score) for k, score in enumerate(scores)]
        return SimpleNamespace(group_id=request.group_id), ray.put(Group(request, samples))

    def capacity(self) -> int:
        return self.max_num_seqs

    def clocks(self) -> dict:
        return {}

    def health(self) -> list[dict]:
        return [{"replica": 0, "state": "healthy", "num_failures": 0, "last_error": None}]


class InstantStream:
    def __init__(self, router: InstantRouter):
        self.router, self.queue = router, []

    @property
    def num_in_flight(self) -> int:
        return len(self.queue)

    def add(self, requests, sampling=None):
        self.router.adds.append((len(requests), len(self.queue)))
        self.queue += requests

    def next_done(self, timeout_s: float):
        router, done = self.router, []
        router.num_reads += 1
        while self.queue and (router.per_call is None or len(done) < router.per_call):
            if router.stop_after is not None and router.num_generated >= router.stop_after \
                    and not router.resume.is_set():
                router.resume.wait(timeout=timeout_s)
                break
            done.append(router.answer(self.queue.pop(0)))
        return done

    def close(self):
        self.router.closed_with = [r.group_id for r in self.queue]
        self.queue = []


def a_run(tmp_path, overrides: list[str], router) -> SimpleNamespace:
    config = load_config(None, overrides)
    rows = read_parquet_rows(write_task("arithmetic", tmp_path, 3000, 2)[0])[0]
    pipeline = config.pipeline
    buffer = BufferClient.create(config.buffer, pipeline.batch_size_prompts, pipeline.trigger_parameter_sync_step, None)
    return SimpleNamespace(config=config, buffer=buffer, router=router, reward=SimpleNamespace(score=lambda ref: ref),
                           dataset=PromptDataset(rows, seed=3), tokenizer=build_char_tokenizer(), policy_version=0)


def row_index(prompt_id: str) -> int:
    return int(prompt_id.rsplit("/", 1)[-1])


def test_dropped_groups_leave_the_quota_so_a_third_flat_keeps_publishing(ray_session, tmp_path):
    """With the DAPO async example's quota and a third of the prompts flat (in a shuffled order, so
    some windows hold more), the producer keeps generating until the buffer has kept its quota, and
    the trainer gets full batches of kept groups through three publishes."""
    router = InstantRouter(4, flat=lambda prompt_id: row_index(prompt_id) % 3 == 0)
    run = a_run(tmp_path, DAPO_ASYNC, router)
    producer = Producer(run)
    producer.start()
    try:
        for _ in range(3):
            for _ in range(4):
                sampled = next_batch(run, producer, timeout_s=60.0)
                assert len(sampled.group_ids) == 128
                run.buffer.ack(sampled.batch_id)
            run.policy_version += 1
            router.policy_version = run.policy_version
            run.buffer.set_policy_version(run.policy_version)
            producer.on_published(run.policy_version)
    finally:
        producer.stopping.set()
        producer.join(timeout=60)
    assert producer.error is None
    trained = [e for e in run.buffer.ledger() if e["status"] == "trained"]
    dropped = [e for e in run.buffer.ledger() if e["status"] == "dropped"]
    assert len(trained) == 12 * 128 and not any(row_index(e["prompt_id"]) % 3 == 0 for e in trained)
    assert dropped and all(e["reason"] == "zero_variance" and row_index(e["prompt_id"]) % 3 == 0 for e in dropped)
    ray.kill(run.buffer.actor)


def test_the_trainer_s_wait_ends_when_no_group_arrives_and_says_what_each_side_was_doing(ray_session, tmp_path):
    """An engine that goes quiet mid-batch: the trainer's wait, bounded by progress, ends after
    `timeout_s` without a put and names the producer's state and the buffer's counts."""
    router = InstantRouter(4, flat=lambda prompt_id: False, stop_after=5)
    run = a_run(tmp_path, ["pipeline.mode=async", "pipeline.batch_size_prompts=8",
                           "rollout.sampling.num_samples_per_prompt=4"], router)
    producer = Producer(run)
    producer.start()
    try:
        with pytest.raises(TimeoutError) as raised:
            next_batch(run, producer, timeout_s=3.0)
    finally:
        router.resume.set()
        producer.stopping.set()
        producer.join(timeout=60)
    message = str(raised.value)
    # Streaming: the five groups before the stall were put one by one; three are still generating.
    for text in ("no batch of 8 group(s) for policy_version 0", "no group reached the replay buffer for 3 s "
                 "(pipeline.batch_timeout_s)", "Producer: generating 3 group(s); 5 of its quota of 8",
                 "Buffer since the last batch: 5 group(s) put", "3 reserved (in flight)", "replica 0 healthy"):
        assert text in message, message
    ray.kill(run.buffer.actor)


def settles(read, timeout_s: float = 30.0, still_s: float = 1.0, moved_from=None):
    """`read()` once it has not changed for `still_s` (the producer went as far as it may), and no
    longer equals `moved_from` if given (the producer has started: a slow start is no stop)."""
    deadline, last, since = time.monotonic() + timeout_s, read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read()
        if now != last or now == moved_from:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= still_s:
            return now
    raise TimeoutError(f"still changing after {timeout_s:g} s: {last}")


def test_the_producer_streams_one_group_per_finished_one_within_its_quota_the_backpressure_and_a_stop(
        ray_session, tmp_path):
    """Groups finish one at a time: the producer fills its target in flight once, then sends one
    group per finished one (no batch barrier), stops at its quota of kept groups without a publish,
    holds still under the buffer's backpressure after one, and on a stop ends at once, closing its
    stream with what was still generating."""
    router = InstantRouter(4, flat=lambda prompt_id: False, per_call=1)
    run = a_run(tmp_path, ["pipeline.mode=async", "pipeline.batch_size_prompts=8", "pipeline.num_groups_in_flight=6",
                           "buffer.staleness_threshold=1.0", "buffer.max_staleness=4",
                           "rollout.sampling.num_samples_per_prompt=4"], router)
    producer = Producer(run)
    assert producer.quota == 16
    producer.start()
    try:
        assert settles(lambda: router.num_generated, moved_from=0) == 16, producer.error  # the quota: 2 batches kept per published version
        assert router.adds[0] == (6, 0) and set(router.adds[1:]) == {(1, 5)}
        assert sum(n for n, _ in router.adds) == 16
        assert run.buffer.metrics()["num_queued"] == 16

        run.policy_version = router.policy_version = 1  # a publish with nothing trained: the buffer is full
        run.buffer.set_policy_version(1)
        producer.on_published(1)
        blocked_before = producer.clock.seconds()["blocked"]
        assert settles(lambda: router.num_generated, still_s=1.5) == 16
        assert producer.clock.seconds()["blocked"] - blocked_before >= 1.0
        assert "the buffer holds it back" in producer.describe()

        router.stop_after = 16  # from here on nothing finishes
        sampled = next_batch(run, producer, timeout_s=30.0)
        run.buffer.ack(sampled.batch_id)  # room for 8: the target of 6 goes out and stays in flight
        settles(lambda: len(router.adds))
    finally:
        producer.stopping.set()
        producer.join(timeout=10)
    assert not producer.is_alive() and producer.error is None
    assert router.closed_with is not None and len(router.closed_with) == 6
    ray.kill(run.buffer.actor)


def test_the_producer_tops_up_in_steps_of_a_quarter_of_its_target(ray_session, tmp_path):
    """A top-up costs a reservation and an engine call on the driver's core: the producer sends
    once a quarter of its target has finished (the end of its window in one go), not per group."""
    router = InstantRouter(4, flat=lambda prompt_id: False, per_call=1)
    run = a_run(tmp_path, ["pipeline.mode=async", "pipeline.batch_size_prompts=7", "pipeline.num_groups_in_flight=8",
                           "buffer.staleness_threshold=1.0", "rollout.sampling.num_samples_per_prompt=4"], router)
    producer = Producer(run)
    assert producer.quota == 14
    producer.start()
    try:
        assert settles(lambda: router.num_generated, moved_from=0) == 14
    finally:
        producer.stopping.set()
        producer.join(timeout=10)
    assert producer.top_up_step == 2 and router.adds == [(8, 0), (2, 6), (2, 6), (2, 6)], router.adds
    ray.kill(run.buffer.actor)


class CountingBuffer:
    """The real buffer's client, counting the producer's reservations."""

    def __init__(self, buffer: BufferClient):
        self.buffer, self.num_reserves = buffer, 0

    def reserve(self, *args, **kwargs):
        self.num_reserves += 1
        return self.buffer.reserve(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.buffer, name)


def test_a_refused_reservation_is_asked_again_when_the_trainer_frees_room_not_in_a_loop(
        ray_session, tmp_path, monkeypatch):
    """Groups in flight and the buffer full: the producer does not ask it again and again (each
    ask costs buffer calls on the driver's core), but at once when the trainer loop has freed room."""
    monkeypatch.setattr(fully_async, "RETRY_S", 600.0)  # only a freeing asks again
    router = InstantRouter(4, flat=lambda prompt_id: False, per_call=1, stop_after=6)
    run = a_run(tmp_path, ["pipeline.mode=async", "pipeline.batch_size_prompts=4", "pipeline.num_groups_in_flight=6",
                           "buffer.staleness_threshold=1.0", "buffer.max_staleness=4",
                           "rollout.sampling.num_samples_per_prompt=4"], router)
    run.buffer = buffer = CountingBuffer(run.buffer)
    producer = Producer(run)
    producer.start()
    try:
        # 6 groups put, the quota's last 2 sent and stalled: 8 ahead, the buffer's capacity.
        assert settles(lambda: (router.num_generated, producer.num_in_flight), moved_from=(0, 0)) == (6, 2)
        run.policy_version = router.policy_version = 1  # a publish opens the next window: room 4 on the engines
        run.buffer.set_policy_version(1)
        producer.on_published(1)
        refused = settles(lambda: buffer.num_reserves, still_s=2.0)  # asked once, refused, and not again
        assert producer.num_in_flight == 2
        sampled = next_batch(run, producer, timeout_s=30.0)
        run.buffer.ack(sampled.batch_id)  # room for 4
        producer.on_buffer_freed()
        assert settles(lambda: buffer.num_reserves) == refused + 1
        assert router.adds[-1] == (4, 2), router.adds
    finally:
        producer.stopping.set()
        producer.join(timeout=10)
    assert producer.error is None
    ray.kill(run.buffer.actor)


@ray.remote
def slow_score(group: Group, delay_s: float) -> Group:
    time.sleep(delay_s)
    return group


def test_the_producer_waits_on_its_puts_instead_of_spinning(ray_session, tmp_path):
    """Every group generated and its scoring slow: the producer, which shares the driver's core
    with the trainer loop, waits on the puts in flight instead of looping over an empty stream."""
    router = InstantRouter(2, flat=lambda prompt_id: False)
    run = a_run(tmp_path, ["pipeline.mode=async", "pipeline.batch_size_prompts=4", "pipeline.num_groups_in_flight=4",
                           "buffer.staleness_threshold=0", "rollout.sampling.num_samples_per_prompt=2"], router)
    run.reward = SimpleNamespace(score=lambda ref: slow_score.remote(ref, 3.0))
    producer = Producer(run)
    producer.start()
    try:
        assert settles(lambda: router.num_generated, moved_from=0, still_s=0.5) == 4  # the quota, then puts pending
        reads = router.num_reads
        time.sleep(1.0)
        assert producer.num_in_flight == 4  # still scoring: the second above saw only waits on the puts
        assert router.num_reads - reads <= 15, router.num_reads - reads  # a wait is 0.2 s; a spin reads thousands
    finally:
        producer.stopping.set()
        producer.join(timeout=10)
    assert producer.error is None
    ray.kill(run.buffer.actor)


def test_groups_to_fill_the_engines():
    from rlactors.pipelines.fully_async import groups_to_fill

    assert groups_to_fill(capacity=256, num_samples=8, num_engines=1, batch_size=16) == 32  # 32 fill it
    assert groups_to_fill(capacity=2 * 100, num_samples=8, num_engines=2, batch_size=16) == 26  # 2 x ceil(100 / 8)
    assert groups_to_fill(capacity=64, num_samples=8, num_engines=1, batch_size=16) == 16  # at least a batch


def test_the_batch_wait_s_default_covers_finding_and_restarting_a_hung_engine_and_scoring_a_group():
    from rlactors.pipelines.fully_async import batch_timeout_s

    config = load_config(None, ["rollout.stall_timeout_s=20", "rollout.health_timeout_s=10", "rollout.start_timeout_s=100",
                                "reward.timeout_s=2", "rollout.sampling.num_samples_per_prompt=4"])
    assert batch_timeout_s(config) == 20 + 10 + 100 + 4 * 2
    assert batch_timeout_s(config.model_copy(update={"pipeline": config.pipeline.model_copy(
        update={"batch_timeout_s": 7.0})})) == 7.0
