"""Transactional run checkpoints: everything needed to continue a run exactly where it stopped.

    output_dir/checkpoints/step_00000010/
        actor/        the actor group's DCP checkpoint (model, optimizer, LR scheduler, RNG, step)
        critic/       the same for the critic (PPO only)
        buffer/       the replay buffer's state as parquet: ledger, queued groups, in-flight
                      reservations (their prompts are re-issued on resume), counters
        driver.json   step, policy_version, data cursor, KL controller, reward counters
        driver_rng.pt the driver's Python, NumPy and torch RNG states
    output_dir/checkpoints/latest

The whole directory is written under `step_N.tmp` and renamed into place before `latest` moves
(`rlactors.trainer.checkpoint.commit`), so a kill mid-write leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import ray
import torch

from rlactors.trainer import checkpoint

DRIVER_FILE = "driver.json"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_run(run) -> Path:
    root = checkpoint_root(run.output_dir)
    temp = checkpoint.prepare_temp_dir(root, run.step)
    run.actor.save_checkpoint(str(temp / "actor"), run.step)
    if run.critic is not None:
        run.critic.save_checkpoint(str(temp / "critic"), run.step)
    ray.get(run.buffer.save.remote(str(temp / "buffer")))  # written by the buffer: its groups skip the driver
    driver = {
        "step": run.step,
        "policy_version": run.policy_version,
        "dataset": run.dataset.state_dict(),
        "kl_controller": run.kl_controller.state_dict(),
        "reward": run.reward.state_dict(),
    }
    (temp / DRIVER_FILE).write_text(json.dumps(driver, indent=2))
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               temp / "driver_rng.pt")
    return checkpoint.commit(root, run.step)


def find_resume_point(resume: str, output_dir: str | Path) -> Path | None:
    """`resume`: "auto" (latest under output_dir, if any), "never", or a checkpoint path."""
    if resume == "never":
        return None
    if resume == "auto":
        return checkpoint.latest_checkpoint(checkpoint_root(output_dir))
    return checkpoint.resolve_checkpoint(resume)


def load_run(run, path: str | Path) -> None:
    """Restore every actor and the driver from checkpoint `path` (weights are re-sent to the
    engines by the caller, under the restored policy_version)."""
    path = Path(path)
    run.actor.load_checkpoint(str(path / "actor"))
    if run.critic is not None:
        run.critic.load_checkpoint(str(path / "critic"))
    ray.get(run.buffer.load.remote(str(path / "buffer")))
    driver = json.loads((path / DRIVER_FILE).read_text())
    run.step, run.policy_version = driver["step"], driver["policy_version"]
    run.dataset.load_state_dict(driver["dataset"])
    run.kl_controller.load_state_dict(driver["kl_controller"])
    run.reward.load_state_dict(driver["reward"])
    ray.get(run.buffer.set_policy_version.remote(run.policy_version))
    rng = torch.load(path / "driver_rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
