"""Driver pieces that need no engine: feeding prompts across epoch boundaries, bounded buffer calls."""

import time
from types import SimpleNamespace

import pytest
import ray

from rlactors.buffer import ReplayBuffer
from rlactors.config import load_config
from rlactors.data import PromptDataset, read_parquet_rows
from rlactors.models import build_char_tokenizer
from rlactors.pipelines import common
from rlactors.pipelines.common import ask_buffer, buffer_wait_ran_out, feed_prompts, produce
from rlactors.synthetic import write_task


def test_feeding_across_an_epoch_boundary_stamps_each_prompt_with_its_epoch(ray_session, tmp_path):
    config = load_config(None, ["pipeline.batch_size_prompts=4"])
    rows = read_parquet_rows(write_task("arithmetic", tmp_path, 10, 2)[0])[0]
    buffer = ReplayBuffer.remote(config.buffer, 4)
    run = SimpleNamespace(dataset=PromptDataset(rows, seed=1), buffer=buffer, tokenizer=build_char_tokenizer(),
                          config=config)
    for _ in range(4):  # 28 prompts from a 10-row data set: epochs 0, 1 and part of 2
        feed_prompts(run, 7)
    ledger = ray.get(buffer.ledger.remote())
    for epoch in (0, 1):
        assert sorted(e["prompt_id"] for e in ledger if e["epoch"] == epoch) == sorted(r.prompt_id for r in rows)
    assert sum(e["epoch"] == 2 for e in ledger) == 8
    assert run.dataset.epoch == 2 and run.dataset.position == 8
    ray.kill(buffer)


@ray.remote(num_cpus=0)
class StuckBuffer:
    """Answers nothing: a buffer actor whose event loop is blocked."""

    def metrics(self):
        time.sleep(600)

    def reserve(self, *args):
        time.sleep(600)


def test_buffer_calls_tell_a_wait_that_ran_out_from_a_stuck_or_dead_buffer(ray_session, monkeypatch):
    config = load_config(None, ["pipeline.batch_size_prompts=4"])
    run = SimpleNamespace(buffer=ReplayBuffer.remote(config.buffer, 4), config=config)
    # The buffer's own wait (nothing queued to sample): "not now", the caller asks again.
    with pytest.raises(TimeoutError) as empty:
        ask_buffer(run, "sample", 4, 0, 0.01, wait_s=0.01)
    assert buffer_wait_ran_out(empty.value)
    # A dead buffer: Ray's error, naming the actor's class.
    ray.kill(run.buffer)
    with pytest.raises(ray.exceptions.RayActorError):  # once the kill has landed
        for _ in range(100):
            ray.get(run.buffer.__ray_ready__.remote(), timeout=30)
            time.sleep(0.1)
    with pytest.raises(ray.exceptions.RayActorError, match="ReplayBuffer"):
        ask_buffer(run, "metrics")
    # A stuck one: a bounded wait naming the call, which no retry loop mistakes for "not now"
    # (the async producer once swallowed every TimeoutError from `produce`).
    monkeypatch.setattr(common, "BUFFER_TIMEOUT_S", 1.0)
    run.buffer = StuckBuffer.remote()
    with pytest.raises(TimeoutError, match=r"replay_buffer.reserve: no answer within 1.5 s") as stuck:
        produce(run, 4, "producer", timeout_s=0.5)
    assert not buffer_wait_ran_out(stuck.value)
    ray.kill(run.buffer)
