"""A run on Ray's smallest object store (75 MiB, `ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES`):
weight buckets, Groups, train batches and results all travel through it (`rlactors.runtime.transport`),
so the run lives on spilling to disk rather than on spare store memory. It must finish with
every prompt accounted for and nothing left behind."""

import json

import pytest
import ray
from chaos_helpers import assert_each_prompt_once, assert_no_leftovers, checkpoint_ledger, leftover_processes
from conftest import another_ray
from ray._private.ray_constants import OBJECT_STORE_MINIMUM_MEMORY_BYTES

from rlactors.config import load_config
from rlactors.pipelines import run_pipeline

# A Ray of its own. In make test: every transport on the suite's Ray (tests/weight_sync, tests/pipelines).
pytestmark = [pytest.mark.vllm, pytest.mark.chaos, pytest.mark.slow]


@pytest.fixture
def tiny_object_store(tmp_path):
    spilling = {"type": "filesystem", "params": {"directory_path": str(tmp_path / "spill")}}
    with another_ray(object_store_memory=OBJECT_STORE_MINIMUM_MEMORY_BYTES,
                     _system_config={"object_spilling_config": json.dumps(spilling)}):
        yield ray


def test_a_run_on_the_smallest_object_store_finishes_and_accounts_for_every_prompt(tiny_object_store, tmp_path,
                                                                                  tiny_model_dir):
    before = leftover_processes()
    output_dir = tmp_path / "run"
    config = load_config(None, [
        f"model.path={tiny_model_dir}", "model.preset=tiny", "data.num_train_rows=16", "data.num_val_rows=4",
        "rollout.max_model_len=64", "rollout.sampling.num_samples_per_prompt=8",
        "rollout.sampling.max_response_tokens=8", "rollout.sampling.seed=1",
        "rollout.validation_sampling.max_response_tokens=4", "pipeline.num_steps=3", "pipeline.batch_size_prompts=8",
        "pipeline.val_every_steps=0", "pipeline.checkpoint_every_steps=3", f"pipeline.output_dir={output_dir}",
        "pipeline.resume=never",
    ])
    history = run_pipeline(config)
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["policy_version"] == 3
    counts = assert_each_prompt_once(checkpoint_ledger(output_dir))
    assert counts["trained"] + counts["dropped"] == 3 * 8  # 16 rows, 24 prompts handed out over two epochs
    assert_no_leftovers(before)
