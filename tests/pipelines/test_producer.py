"""The fully-async producer over the real replay buffer, with each group made in the test the
moment it is asked for instead of by an engine (the engines' side is tests/rollout): what the
producer counts against its quota per published version, and the trainer's bounded wait."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import ray

from rlactors.buffer.client import BufferClient
from rlactors.config import load_config
from rlactors.data import PromptDataset, read_parquet_rows
from rlactors.data.synthetic import write_task
from rlactors.models import build_char_tokenizer
from rlactors.pipelines.fully_async import Producer, next_batch
from rlactors.types import Group, Sample

# The DAPO async example's numbers (examples/math_dapo_qwen2.5_math_7b_async.yaml): a quota of
# (1 + 0.5) x 128 x 4 = 768 groups per published version, of which 4 batches of 128 are trained.
DAPO_ASYNC = ["pipeline.mode=async", "pipeline.batch_size_prompts=128", "pipeline.trigger_parameter_sync_step=4",
              "buffer.staleness_threshold=0.5", "buffer.max_staleness=2", "buffer.dynamic_sampling=true",
              "buffer.dynamic_sampling_metric=score", "buffer.max_generation_rounds=10",
              "rollout.sampling.num_samples_per_prompt=4"]


class InstantRouter:
    """Answers each request at once with a group of `num_samples` one-token samples labelled with
    the version it holds; `flat(prompt_id)` says which prompts score 0 on every sample (zero
    variance: dynamic sampling drops them), the others score 0 and 1 in turn. After `stop_after`
    groups its stream goes quiet, as a stalled engine's, until `resume` is set."""

    def __init__(self, num_samples: int, flat, stop_after: int | None = None):
        self.num_samples, self.flat, self.stop_after = num_samples, flat, stop_after
        self.policy_version, self.num_generated = 0, 0
        self.resume = threading.Event()

    def generate_refs(self, requests):
        for request in requests:
            if self.stop_after is not None and self.num_generated >= self.stop_after:
                self.resume.wait(timeout=120)
            self.num_generated += 1
            scores = [0.0 if self.flat(request.prompt_id) else float(k % 2) for k in range(self.num_samples)]
            samples = [Sample(request.prompt_id, k, list(request.prompt_token_ids), [7], [-0.1], [self.policy_version],
                              score=score) for k, score in enumerate(scores)]
            yield None, ray.put(Group(request, samples))

    def time_s(self) -> dict[str, float]:
        return {}

    def health(self) -> list[dict]:
        return [{"replica": 0, "state": "healthy", "num_failures": 0, "last_error": None}]


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
    """An engine that goes quiet mid-chunk: the trainer's wait, bounded by progress, ends after
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
    for text in ("no batch of 8 group(s) for policy_version 0", "no group reached the replay buffer for 3 s "
                 "(pipeline.batch_timeout_s)", "Producer: generating 8 group(s); 0 of its quota of 8",
                 "Buffer since the last batch: 0 group(s) put", "8 reserved (in flight)", "replica 0 healthy"):
        assert text in message, message
    ray.kill(run.buffer.actor)


def test_the_batch_wait_s_default_covers_finding_and_restarting_a_hung_engine_and_scoring_a_group():
    from rlactors.pipelines.fully_async import batch_timeout_s

    config = load_config(None, ["rollout.stall_timeout_s=20", "rollout.health_timeout_s=10", "rollout.start_timeout_s=100",
                                "reward.timeout_s=2", "rollout.sampling.num_samples_per_prompt=4"])
    assert batch_timeout_s(config) == 20 + 10 + 100 + 4 * 2
    assert batch_timeout_s(config.model_copy(update={"pipeline": config.pipeline.model_copy(
        update={"batch_timeout_s": 7.0})})) == 7.0
