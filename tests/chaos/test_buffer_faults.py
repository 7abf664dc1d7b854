"""The replay buffer under faults, in one short colocated run on the tiny model (real stack):

- a prompt the engine refuses (every sample of its group failed, no policy version at all) is
  recorded dropped with the engine's error and counted in the step's metrics; the run goes on;
- the buffer actor SIGKILLed after step 2's ack, when its trained rows are already in the run's
  ledger log past checkpoint 1's cut: the run stops at once with an error naming ReplayBuffer;
  resuming from checkpoint 1 truncates the log to its cut, trains step 2 again and ends with every
  prompt trained exactly once or dropped with a reason, leaving nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from chaos_helpers import assert_each_prompt_once, assert_no_leftovers, checkpoint_ledger, leftover_processes
from tiny_runs import tiny_config, with_resume

from rlactors.buffer.storage import load_buffer_scalars
from rlactors.pipelines import run_pipeline

# In make test: dropped groups, the ledger and its cut without Ray (tests/buffer), a consistent
# checkpoint cut (tests/pipelines/test_checkpointing.py), a run's drop accounting (tests/chaos/test_reward_faults.py).
pytestmark = [pytest.mark.vllm, pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(900)]

BATCH = 4  # tiny_config's pipeline.batch_size_prompts
FAILS_WITHIN_S = 120.0  # a hang guard: a dead buffer is reported by Ray at once


def _config(tmp_path, tiny_model_dir):
    """A checkpoint every step and every finished ledger row appended to the log at once."""
    return tiny_config(tmp_path, tiny_model_dir, "pipeline.checkpoint_every_steps=1", "buffer.ledger_flush_rows=1")


def _log_segments(output_dir: Path) -> int:
    return len(list((output_dir / "ledger").glob("*/*.events.parquet")))


def test_buffer_killed_mid_run_then_resumed_and_a_refused_prompt_dropped(warm_actors, tmp_path, tiny_model_dir,
                                                                         monkeypatch):
    import ray

    from rlactors.pipelines import colocated
    from rlactors.rollout.router import RolloutRouter
    from rlactors.rollout.samples import error_group, summarize_group

    before = leftover_processes()
    config = _config(tmp_path, tiny_model_dir)
    output_dir = Path(config.pipeline.output_dir)
    num_samples = config.rollout.sampling.num_samples_per_prompt

    refused: list[str] = []  # the first training prompt: answered as the engine answers a prompt it rejects
    generate_refs = RolloutRouter.generate_refs

    def generate_refs_refusing_one(router, requests, sampling=None):
        if sampling is None and not refused and requests:  # training (validation passes its sampling)
            request, requests = requests[0], requests[1:]
            refused.append(request.prompt_id)
            group = error_group(request, num_samples, f"prompt_id={request.prompt_id!r}: refused by the engine")
            yield summarize_group(group), ray.put(group)
        yield from generate_refs(router, requests, sampling)

    killed: list[float] = []
    sync_weights = colocated.sync_weights

    def sync_weights_with_the_buffer_killed(run):
        if run.step == 1 and not killed:  # step 2, acked: its rows are in the log, past checkpoint 1's cut
            os.kill(run.buffer.health()["pid"], signal.SIGKILL)
            killed.append(time.monotonic())
        return sync_weights(run)

    monkeypatch.setattr(RolloutRouter, "generate_refs", generate_refs_refusing_one)
    monkeypatch.setattr(colocated, "sync_weights", sync_weights_with_the_buffer_killed)
    with pytest.raises(ray.exceptions.RayActorError) as failure:
        run_pipeline(config, warm=warm_actors)
    assert killed, f"the run ended before step 2's weight sync: {failure.value}"
    assert time.monotonic() - killed[0] < FAILS_WITHIN_S
    assert "ReplayBuffer" in str(failure.value)
    assert (output_dir / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    cut_at_step_1 = load_buffer_scalars(output_dir / "checkpoints" / "step_00000001" / "buffer")[0]["log"]
    assert _log_segments(output_dir) > cut_at_step_1["num_segments"]  # the killed run logged step 2's rows

    resumed = run_pipeline(with_resume(config), warm=warm_actors)  # on the engines the killed run kept
    assert [h["step"] for h in resumed] == [2]
    ledger = checkpoint_ledger(output_dir)
    counts = assert_each_prompt_once(ledger)  # step 2's rows from the killed run were cut away
    assert counts == {"trained": 2 * BATCH, "dropped": 1}
    [dropped] = [row for row in ledger if row["status"] == "dropped"]
    assert (dropped["prompt_id"], dropped["reason"]) == (
        refused[0], f"rollout_error: prompt_id={refused[0]!r}: refused by the engine")
    steps = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert [s["buffer/num_dropped_rollout_error"] for s in steps[1:]] == [1.0, 0.0]
    assert all(s["response_length/mean"] > 0 for s in steps[1:])  # full batches of real groups were trained
    assert_no_leftovers(before, warm=warm_actors)
