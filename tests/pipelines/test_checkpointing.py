"""Run checkpoints without engines: the buffer and data cursor cut together while a feeder runs,
the driver's RNG states, and checkpoint files that would run code when loaded."""

import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch
from conftest import RunsCode

from rlactors.buffer import ReplayBuffer
from rlactors.buffer.client import BufferClient
from rlactors.config import AlgorithmConfig, TrainerConfig, load_config
from rlactors.data import PromptDataset, read_parquet_rows
from rlactors.data.synthetic import write_task
from rlactors.models import build_char_tokenizer
from rlactors.pipelines import checkpointing, common
from rlactors.pipelines.common import feed_prompts

HANG_GUARD_S = 60.0


class WatchedLock:
    """A re-entrant lock that records when a thread had to wait for it."""

    def __init__(self):
        self.inner = threading.RLock()
        self.contended = threading.Event()

    def __enter__(self):
        if not self.inner.acquire(blocking=False):
            self.contended.set()
            self.inner.acquire()
        return self

    def __exit__(self, *exc):
        self.inner.release()


def _passed_keys(rows, seed, state) -> set[tuple[int, str]]:
    """(epoch, prompt_id) of every row a cursor in `state` has handed out."""
    dataset = PromptDataset(rows, seed=seed)
    keys = set()
    for _ in range(state["epoch"] * len(rows) + state["position"]):
        row = dataset.next_batch(1)[0]
        keys.add((dataset.epoch, row.prompt_id))
    return keys


def _ledger_keys(buffer) -> list[tuple[int, str]]:
    return [(entry["epoch"], entry["prompt_id"]) for entry in buffer.ledger()]


def test_a_checkpoint_taken_while_prompts_are_fed_is_one_consistent_cut(ray_session, tmp_path, monkeypatch):
    """The checkpoint snapshots the buffer after the feeder advanced the cursor across the epoch
    boundary but before its prompts reached the buffer. The saved cursor and the saved buffer
    must agree: resumed from them, each epoch holds every prompt exactly once."""
    config = load_config(None, ["pipeline.batch_size_prompts=4"])
    rows = read_parquet_rows(write_task("arithmetic", tmp_path, 10, 2)[0])[0]
    ledger_dir = str(tmp_path / "ledger")  # the run's ledger log, shared by the killed and the resumed buffer
    run = SimpleNamespace(dataset=PromptDataset(rows, seed=1),
                          buffer=BufferClient(ReplayBuffer.remote(config.buffer, 4, ledger_dir=ledger_dir)),
                          tokenizer=build_char_tokenizer(), config=config)
    run.dataset.lock = lock = WatchedLock()
    feed_prompts(run, 8)
    advanced, saved = threading.Event(), threading.Event()
    tokenize = common.requests_for

    def pause_between_cursor_and_buffer(rows_, tokenizer, config_):
        # feed_prompts calls this after next_batch moved the cursor and before add_prompts.
        if threading.current_thread().name == "feeder" and not advanced.is_set():
            advanced.set()
            deadline = time.monotonic() + HANG_GUARD_S
            while not (lock.contended.is_set() or saved.is_set()):  # the checkpoint waits, or is done
                assert time.monotonic() < deadline, "the checkpoint neither waited for the feeder nor finished"
                time.sleep(0.01)
        return tokenize(rows_, tokenizer, config_)

    monkeypatch.setattr(common, "requests_for", pause_between_cursor_and_buffer)
    cursors = []
    feeder = threading.Thread(target=feed_prompts, args=(run, 4), name="feeder")  # 2 of epoch 0, 2 of 1
    feeder.start()
    assert advanced.wait(HANG_GUARD_S), "the feeder never advanced the cursor"

    def checkpoint():
        try:
            cursors.append(checkpointing.save_prompts(run.buffer, run.dataset, tmp_path / "buffer"))
        except Exception as error:  # noqa: BLE001 - reported below
            cursors.append(error)
        saved.set()

    saver = threading.Thread(target=checkpoint)
    saver.start()
    for thread in (feeder, saver):
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive(), f"{thread.name} hung"
    [cursor] = cursors
    assert isinstance(cursor, dict), f"the checkpoint failed: {cursor!r}"
    ray.kill(run.buffer.actor)

    resumed = SimpleNamespace(dataset=PromptDataset(rows, seed=0),
                              buffer=BufferClient(ReplayBuffer.remote(config.buffer, 4, ledger_dir=ledger_dir)),
                              tokenizer=run.tokenizer, config=config)
    resumed.buffer.load(str(tmp_path / "buffer"))
    resumed.dataset.load_state_dict(cursor)
    assert set(_ledger_keys(resumed.buffer)) == _passed_keys(rows, 1, cursor)
    feed_prompts(resumed, 2 * len(rows) - (cursor["epoch"] * len(rows) + cursor["position"]))  # to epoch 1's end
    keys = _ledger_keys(resumed.buffer)
    assert len(keys) == len(set(keys)) == 2 * len(rows)
    for epoch in (0, 1):
        assert sorted(p for e, p in keys if e == epoch) == sorted(r.prompt_id for r in rows), epoch
    ray.kill(resumed.buffer.actor)


def test_driver_rng_states_round_trip_in_plain_values(tmp_path):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in NumPy's legacy state
    torch.save(checkpointing.rng_state(), tmp_path / checkpointing.RNG_FILE)
    expected = (random.random(), np.random.standard_normal(), torch.rand(2))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    checkpointing.set_rng_state(torch.load(tmp_path / checkpointing.RNG_FILE, weights_only=True))
    got = (random.random(), np.random.standard_normal(), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_a_driver_rng_file_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"python": RunsCode(marker)}, tmp_path / checkpointing.RNG_FILE)
    with pytest.raises(ValueError, match="driver_rng.pt: refused to load"):
        checkpointing.load_run(SimpleNamespace(), tmp_path)  # refused before any actor is touched
    assert not marker.exists()


def test_a_trainer_rank_file_that_would_run_code_is_refused(ray_session, tiny_model_dir, tmp_path):
    from rlactors.trainer.group import TrainerGroup

    config = TrainerConfig(num_workers=1, num_cpus_per_worker=1.0, max_tokens_per_micro_batch=4096)
    group = TrainerGroup("actor", tiny_model_dir, config, AlgorithmConfig())
    marker = tmp_path / "ran"
    try:
        path = group.save_checkpoint(tmp_path / "checkpoints", step=1)
        assert group.load_checkpoint(path) == 1  # what the worker writes loads under weights_only
        torch.save({"step": 1, "rng": RunsCode(marker)}, f"{path}/rank_0.pt")
        with pytest.raises(Exception, match="rank_0.pt: refused to load"):
            group.load_checkpoint(path)
    finally:
        group.shutdown()
    assert not marker.exists()


def test_a_checkpoint_that_fills_the_disk_says_so_and_leaves_the_previous_one(tmp_path, monkeypatch):
    from rlactors.trainer import checkpoint

    root = checkpointing.checkpoint_root(tmp_path)
    temp = checkpoint.prepare_temp_dir(root, 2)
    (temp / "driver.json").write_text("{}")
    previous = checkpoint.commit(root, 2)

    class ActorOnAFullDisk:
        def save_checkpoint(self, path, step):
            Path(path).mkdir(parents=True)
            (Path(path) / "__0_0.distcp").write_bytes(b"half a shard")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    run = SimpleNamespace(output_dir=tmp_path, step=4, actor=ActorOnAFullDisk(), critic=None)
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: 3 << 20)
    with pytest.raises(checkpointing.CheckpointWriteError) as failure:
        checkpointing.save_run(run)
    assert str(failure.value) == (
        f"checkpoint step 4 could not be written under {root}: the disk is full (3.0 MiB free; the last checkpoint, "
        f"step_00000002, takes {checkpointing.checkpoint_bytes(previous) / (1 << 20):.1f} MiB). Checkpoint {previous} "
        "is intact and `latest` names it: free space, then resume from it.")
    assert checkpoint.latest_checkpoint(root) == previous and checkpoint.damage(previous) is None
    assert not checkpoint.temp_dir(root, 4).exists()  # the half-written one no longer takes space
    # With space left, the same error is not called a full disk: it is raised as it came.
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: 100 << 30)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        checkpointing.save_run(run)
