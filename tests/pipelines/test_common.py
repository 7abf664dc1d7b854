"""Driver pieces that need no engine: feeding prompts across epoch boundaries."""

from types import SimpleNamespace

import ray

from rlactors.buffer import ReplayBuffer
from rlactors.config import load_config
from rlactors.data import PromptDataset, read_parquet_rows
from rlactors.models import build_char_tokenizer
from rlactors.pipelines.common import feed_prompts
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
