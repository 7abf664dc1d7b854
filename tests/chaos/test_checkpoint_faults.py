"""The async driver SIGKILLed right after a checkpoint lands, then (resumed) SIGKILLed in the middle
of writing the next one, then resumed to the end: no prompt is lost or trained twice, the steps
continue where the last committed checkpoint left them, and nothing of the killed drivers is left
(their actors, placement groups and engine processes die with their job)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chaos_helpers import assert_each_prompt_once, assert_no_leftovers, checkpoint_ledger, leftover_processes
from tiny_runs import tiny_config

from rlactors.config import dump_config
from rlactors.data import PromptDataset
from rlactors.pipelines import run_pipeline
from rlactors.trainer import checkpoint

# In make test: the checkpoint transaction and the ledger cut (tests/pipelines/test_checkpointing.py),
# exact resume after a checkpoint (tests/pipelines/test_pipelines.py).
pytestmark = [pytest.mark.vllm, pytest.mark.chaos, pytest.mark.slow]

NUM_ROWS, BATCH, NUM_STEPS = 16, 4, 8  # 4 steps an epoch: the run crosses into epoch 1 at step 4
HANG_GUARD_S = 600.0

# `python -m rlactors run CONFIG` whose checkpoint at STEP stops half-written (the actor and the
# buffer are in step_N.tmp, the driver files and the commit are not) until the process is killed.
HANG_MID_CHECKPOINT = """
import sys, time
from pathlib import Path
from rlactors.cli import main
from rlactors.pipelines import checkpointing

config_path, hang_step, marker = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
save_prompts = checkpointing.save_prompts

def save_prompts_then_hang(buffer, dataset, path):
    cursor = save_prompts(buffer, dataset, path)
    if Path(path).parent.name == f"step_{hang_step:08d}.tmp":
        marker.write_text(str(path))
        time.sleep(3600)
    return cursor

checkpointing.save_prompts = save_prompts_then_hang
sys.exit(main(["run", config_path]))
"""


def _config(tmp_path, tiny_model_dir):
    return tiny_config(tmp_path, tiny_model_dir, f"data.num_train_rows={NUM_ROWS}", "data.num_val_rows=4",
                       "pipeline.mode=async", "buffer.staleness_threshold=1.0",
                       "buffer.max_staleness=1",  # the producer runs a batch ahead
                       f"pipeline.num_steps={NUM_STEPS}", f"pipeline.batch_size_prompts={BATCH}",
                       "pipeline.checkpoint_every_steps=2", "pipeline.keep_checkpoints=2", "pipeline.resume=auto")


def _latest(root: Path) -> str | None:
    pointer = root / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


def _kill_when(driver: subprocess.Popen, log: Path, condition, what: str) -> None:
    """Poll `condition` until it holds, then SIGKILL the driver (naming `what` if it never does)."""
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while not condition():
            if driver.poll() is not None:
                raise AssertionError(f"the driver exited ({driver.returncode}) before {what}:\n{log.read_text()[-3000:]}")
            assert time.monotonic() < deadline, f"no {what} within {HANG_GUARD_S:g} s"
            time.sleep(0.05)
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()


def _assert_cut_is_consistent(path: Path, rows) -> list[dict]:
    """The checkpoint's buffer holds exactly the (epoch, prompt_id) its data cursor has handed out."""
    assert _latest(path.parent) == path.name  # checkpoint_ledger reads the latest one
    cursor = json.loads((path / "driver.json").read_text())["dataset"]
    dataset = PromptDataset(rows, seed=cursor["seed"], shuffle=cursor["shuffle"])
    handed_out = set()
    for _ in range(cursor["epoch"] * len(rows) + cursor["position"]):
        row = dataset.next_batch(1)[0]
        handed_out.add((dataset.epoch, row.prompt_id))
    ledger = checkpoint_ledger(path.parent.parent)
    assert {(row["epoch"], row["prompt_id"]) for row in ledger} == handed_out, path.name
    return ledger


def test_async_driver_killed_after_and_during_a_checkpoint_resumes_without_losing_a_prompt(
        ray_session, tmp_path, tiny_model_dir):
    before = leftover_processes()
    config = _config(tmp_path, tiny_model_dir)
    config_path = tmp_path / "run.yaml"
    dump_config(config, config_path)
    output_dir = Path(config.pipeline.output_dir)
    root = output_dir / "checkpoints"
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address, "PYTHONUNBUFFERED": "1"}

    # (a) Killed right after checkpoint 2 lands, while the producer thread keeps feeding prompts.
    log = tmp_path / "driver_a.log"
    with open(log, "w") as out:
        driver = subprocess.Popen([sys.executable, "-m", "rlactors", "run", str(config_path)], env=env,
                                  stdout=out, stderr=subprocess.STDOUT)
    _kill_when(driver, log, lambda: _latest(root) == "step_00000002", "checkpoint 2")
    assert_no_leftovers(before, timeout_s=120)  # the job's actors died with its driver
    rows = PromptDataset.from_files([output_dir / "data" / "train.parquet"]).rows
    _assert_cut_is_consistent(root / "step_00000002", rows)

    # (b) Resumed, then killed while checkpoint 4 is half-written.
    log, marker = tmp_path / "driver_b.log", tmp_path / "hanging"
    with open(log, "w") as out:
        driver = subprocess.Popen([sys.executable, "-c", HANG_MID_CHECKPOINT, str(config_path), "4", str(marker)],
                                  env=env, stdout=out, stderr=subprocess.STDOUT)
    _kill_when(driver, log, marker.is_file, "a half-written checkpoint 4")
    assert "at step 2" in log.read_text()  # it had resumed from checkpoint 2
    assert_no_leftovers(before, timeout_s=120)
    assert _latest(root) == "step_00000002" and (root / "step_00000004.tmp" / "buffer").is_dir()
    assert not (root / "step_00000004.tmp" / "driver.json").exists()

    # Resumed in this process to the end: from checkpoint 2 again, the half-written 4 ignored.
    history = run_pipeline(config)
    assert [h["step"] for h in history] == list(range(3, NUM_STEPS + 1))
    assert [p.name for p in checkpoint.committed_checkpoints(root)] == ["step_00000006", "step_00000008"]
    assert _latest(root) == "step_00000008" and not list(root.glob("*.tmp"))

    ledger = _assert_cut_is_consistent(root / "step_00000008", rows)
    counts = assert_each_prompt_once(ledger, {row.prompt_id for row in rows})
    assert counts["trained"] == NUM_STEPS * BATCH  # every step trained a full batch, none twice
    for epoch in (0, 1):  # both epochs were handed out in full
        assert sorted(r["prompt_id"] for r in ledger if r["epoch"] == epoch) == sorted(r.prompt_id for r in rows)
    assert all(r["status"] in ("trained", "dropped") for r in ledger if r["epoch"] == 0), "epoch 0 unfinished"
    assert_no_leftovers(before)
