"""Trainer rank 1 of a 2-rank colocated run SIGKILLed in the middle of an update, after a checkpoint:
the run stops with an error naming the rank (not after the collective timeout), every actor,
placement group and engine process of the run is gone, and a resume from the last checkpoint
trains the remaining steps, each prompt exactly once. And a run whose start fails after most of
its actors are up leaves none of them, inside its placement groups or outside them."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from chaos_helpers import assert_each_prompt_once, assert_no_leftovers, checkpoint_ledger, leftover_processes
from tiny_runs import tiny_config, with_resume

from rlactors.pipelines import build, run_pipeline
from rlactors.trainer.group import TrainerGroup
from rlactors.trainer.ranks import TrainerRankError

pytestmark = [pytest.mark.vllm, pytest.mark.chaos]

NUM_STEPS, BATCH = 3, 4  # BATCH: tiny_config's pipeline.batch_size_prompts


def _config(tmp_path, tiny_model_dir, *overrides):
    return tiny_config(tmp_path, tiny_model_dir, "data.num_train_rows=16", "data.num_val_rows=4",
                       # 3 CPUs of the suite's 4: the engine and rank 0 share a bundle, rank 1 has its own.
                       "trainer.num_workers=2",
                       # A hang guard only: a rank failure must surface at once, not after a collective times out.
                       "trainer.collective_timeout_s=300",
                       f"pipeline.num_steps={NUM_STEPS}", "pipeline.checkpoint_every_steps=1", *overrides)


@pytest.mark.extended  # the rank's death at the group's level: tests/trainer/test_trainer_group.py; exact resume:
# tests/pipelines/test_pipelines.py; a driver killed and resumed: tests/chaos/test_checkpoint_faults.py
def test_sigkill_of_trainer_rank_1_mid_update_then_resume(warm_actors, tmp_path, tiny_model_dir, monkeypatch):
    """The engines outlive the trainer's failure: kept, and the resumed run starts on them."""
    config = _config(tmp_path, tiny_model_dir, "pipeline.resume=never")
    latest = Path(config.pipeline.output_dir) / "checkpoints" / "latest"
    killed = []
    update_policy = TrainerGroup.update_policy

    def update_policy_with_rank_1_killed(group, batch, temperature=1.0):
        """After the first checkpoint: rank 1 is first held in a call of its own, so its update
        waits behind it while rank 0 runs into the update's first collective; a thread then
        SIGKILLs rank 1's process there."""
        if not killed and latest.is_file():
            pid = group.info[1]["pid"]
            group.workers[1].__ray_call__.remote(lambda _: time.sleep(600))

            def kill():
                time.sleep(1.0)  # orders the kill after the update's submission (either order kills it mid-call)
                os.kill(pid, signal.SIGKILL)

            killed.append(threading.Thread(target=kill, daemon=True))
            killed[0].start()
        return update_policy(group, batch, temperature)

    monkeypatch.setattr(TrainerGroup, "update_policy", update_policy_with_rank_1_killed)
    before = leftover_processes()
    with pytest.raises(TrainerRankError, match=r"actor rank 1 failed in update_policy: its process died"):
        run_pipeline(config, warm=warm_actors)
    assert killed and latest.read_text().strip() == "step_00000001"
    assert warm_actors.kept is not None and warm_actors.kept.trainers == {}  # engines kept, the failed run's ranks not
    assert_no_leftovers(before, warm=warm_actors)

    monkeypatch.setattr(TrainerGroup, "update_policy", update_policy)
    num_taken = warm_actors.num_taken
    resumed = run_pipeline(with_resume(config), warm=warm_actors)
    assert warm_actors.num_taken == num_taken + 1
    assert [h["step"] for h in resumed] == [2, 3]
    assert latest.read_text().strip() == "step_00000003"
    counts = assert_each_prompt_once(checkpoint_ledger(config.pipeline.output_dir))
    assert counts["trained"] == NUM_STEPS * BATCH
    assert_no_leftovers(before, warm=warm_actors)


class _BuilderThatFailsToStart:
    """The batch builder, the last actor `build_run` starts, failing to: by then the trainer ranks,
    the engine (in the placement groups), the reward scorers and the buffer (outside them) are up."""

    @staticmethod
    def options(**_):
        return _BuilderThatFailsToStart

    @staticmethod
    def remote(*_):
        raise RuntimeError("batch builder failed to start")


def test_a_run_whose_start_fails_leaves_no_actor(warm_actors, tmp_path, tiny_model_dir, monkeypatch):
    """Engines taken from the warm ones (if they match) are the run's: stopped with the rest."""
    monkeypatch.setattr(build, "BatchBuilder", _BuilderThatFailsToStart)
    before = leftover_processes()
    # The error is kept, as a notebook keeps its last traceback: its frames hold the handles of what
    # was started, so Ray's reference counting does not stop those actors; only the teardown does.
    with pytest.raises(RuntimeError, match="batch builder failed to start") as failure:
        run_pipeline(tiny_config(tmp_path, tiny_model_dir), warm=warm_actors)
    assert warm_actors.kept is None
    assert_no_leftovers(before)
    assert failure.value.__traceback__ is not None
