"""A fully-async run of the real stack that once stopped without a word: dynamic sampling with
many flat groups (a stalled engine core is in tests/chaos/test_engine_faults.py). In `make test`
the same rule is tested below the whole stack: the producer's quota and the trainer's bounded wait
over the real buffer, tests/pipelines/test_producer.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_runs import record_scored_batches, tiny_config

from rlactors.pipelines import run_pipeline

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

HALF_FLAT_REWARD = (f"reward.custom_function={Path(__file__).parents[1] / 'parity_reward.py'}"
                    ":compute_score_half_flat")


def test_async_dynamic_sampling_with_half_the_groups_flat_trains_every_step_on_kept_groups(
        warm_actors, tmp_path, tiny_model_dir, monkeypatch):
    """4 steps of 4 prompts, a quota of 4 kept groups per version and about half the groups flat:
    the run finishes (a producer that counted dropped groups waited for a publish forever), and
    trains only groups with a reward that varies."""
    batches = record_scored_batches(monkeypatch)
    config = tiny_config(tmp_path, tiny_model_dir, "pipeline.mode=async", "pipeline.num_steps=4",
                         "buffer.dynamic_sampling=true", "buffer.dynamic_sampling_metric=score",
                         "pipeline.batch_timeout_s=120", HALF_FLAT_REWARD)
    history = run_pipeline(config, warm=warm_actors)
    assert [step["step"] for step in history] == [0, 1, 2, 3, 4]
    assert sum(step["buffer/num_dropped_zero_variance"] for step in history[1:]) > 0
    assert [len(groups) for _, groups in batches] == [4, 4, 4, 4]
    for _, groups in batches:
        for group in groups:
            assert len({sample.score for sample in group.samples}) > 1, group.prompt_id  # never a flat group
