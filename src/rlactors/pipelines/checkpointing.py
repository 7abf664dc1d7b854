"""Transactional run checkpoints: everything needed to continue a run exactly where it stopped.

    output_dir/checkpoints/step_00000010/
        actor/        the actor group's DCP checkpoint (model, optimizer, LR scheduler, RNG, step)
        critic/       the same for the critic (PPO only)
        buffer/       the replay buffer's state as parquet: the in-flight window (pending
                      prompts, reservations, whose prompts are re-issued on resume, queued groups),
                      counters, and the cut of the run's ledger log (output_dir/ledger/, where
                      finished prompts are recorded once; a resume truncates it to this cut)
        driver.json   step, policy_version, data cursor, KL controller, reward counters
        driver_rng.pt the driver's Python, NumPy and torch RNG states (tensors and plain values only)
    output_dir/checkpoints/latest

The whole directory is written under `step_N.tmp`, listed with each file's size and checksum in
`manifest.json`, fsynced and renamed into place before `latest` moves
(`rlactors.trainer.checkpoint.commit`), so a kill or power loss mid-write leaves the previous
checkpoint loadable; `pipeline.keep_checkpoints` then bounds how many stay. A resume checks the
checkpoint against its manifest before any actor starts (`preflight.check_resume_point`), and a
write that fails for lack of space says so, naming the intact previous checkpoint
(`CheckpointWriteError`).

One consistent cut: the buffer's state and the data cursor are snapshotted together under
`PromptDataset.lock`, which `feed_prompts` holds from advancing the cursor until the prompts are
in the buffer (the async producer thread keeps running during a checkpoint). So
every prompt the saved cursor has passed is in the saved buffer, and none it has not. Generation
need not pause: open reservations are in the buffer's state and re-issued on resume.
"""

from __future__ import annotations

import errno
import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from rlactors.trainer import checkpoint

DRIVER_FILE = "driver.json"
RNG_FILE = "driver_rng.pt"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_prompts(buffer, dataset, path: str | Path) -> dict:
    """Write the buffer's checkpoint to `path` and return the data cursor of the same instant."""
    with dataset.lock:  # no prompt can leave the cursor without reaching the buffer meanwhile
        buffer.save(str(path))
        return dataset.state_dict()


def rng_state() -> dict:
    """The driver process's RNG states as tensors and plain Python values (loadable with
    `weights_only=True`, no allow-list)."""
    numpy = np.random.get_state(legacy=False)
    numpy["state"] = {"key": numpy["state"]["key"].tolist(), "pos": int(numpy["state"]["pos"])}
    return {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy = dict(state["numpy"])
    numpy["state"] = {"key": np.asarray(numpy["state"]["key"], dtype=np.uint32), "pos": numpy["state"]["pos"]}
    np.random.set_state(numpy)
    torch.set_rng_state(state["torch"])


def write_driver_files(run, temp: Path, cursor: dict) -> None:
    driver = {
        "step": run.step,
        "policy_version": run.policy_version,
        "dataset": cursor,
        "kl_controller": run.kl_controller.state_dict(),
        "reward": run.reward.state_dict(),
    }
    (temp / DRIVER_FILE).write_text(json.dumps(driver, indent=2))
    torch.save(rng_state(), temp / RNG_FILE)


def save_run(run) -> Path:
    root = checkpoint_root(run.output_dir)
    try:
        temp = checkpoint.prepare_temp_dir(root, run.step)
        run.actor.save_checkpoint(str(temp / "actor"), run.step)
        if run.critic is not None:
            run.critic.save_checkpoint(str(temp / "critic"), run.step)
        cursor = save_prompts(run.buffer, run.dataset, temp / "buffer")  # written by the buffer: its groups skip the driver
        write_driver_files(run, temp, cursor)
        final = checkpoint.commit(root, run.step)  # fsyncs every file first
    except Exception as error:
        if not out_of_space(error, root):
            raise
        checkpoint.remove_unfinished(root)  # what this write left takes the space the next one needs
        raise CheckpointWriteError(f"checkpoint step {run.step} could not be written under {root}: the disk is full "
                                   f"({_size(free_bytes(root))} free; {space_needed(root)}). "
                                   f"{_previous(root)}") from error
    checkpoint.prune(root, run.config.pipeline.keep_checkpoints)
    return final


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written for lack of space; the previous one is untouched."""


# Below this much free space a failed write is taken for a full disk: torch's writers report one as
# "unexpected pos" or "enforce fail" without an errno.
LOW_SPACE_BYTES = 64 << 20


def out_of_space(error: BaseException, root: Path) -> bool:
    """Whether `error`, raised while writing a checkpoint under `root`, came from a full disk."""
    for cause in (error, error.__cause__, getattr(error, "cause", None)):
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return True
    return "No space left on device" in str(error) or free_bytes(root) < LOW_SPACE_BYTES


def free_bytes(path: Path) -> int:
    path = Path(path)
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def checkpoint_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in Path(path).rglob("*") if file.is_file())


def space_needed(root: Path) -> str:
    latest = checkpoint.latest_checkpoint(root) if root.is_dir() else None
    return (f"the last checkpoint, {latest.name}, takes {_size(checkpoint_bytes(latest))}" if latest is not None
            else "no earlier checkpoint of this run to size one by")


def _previous(root: Path) -> str:
    latest = checkpoint.latest_checkpoint(root) if root.is_dir() else None
    return (f"Checkpoint {latest} is intact and `latest` names it: free space, then resume from it."
            if latest is not None else "No checkpoint of this run was written yet.")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB" if num_bytes >= 1 << 30 else f"{num_bytes / (1 << 20):.1f} MiB"


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
    rng = checkpoint.load_plain(path / RNG_FILE)  # first: a file that would run code stops everything
    run.actor.load_checkpoint(str(path / "actor"))
    if run.critic is not None:
        run.critic.load_checkpoint(str(path / "critic"))
    run.buffer.load(str(path / "buffer"))
    driver = json.loads((path / DRIVER_FILE).read_text())
    run.step, run.policy_version = driver["step"], driver["policy_version"]
    run.dataset.load_state_dict(driver["dataset"])
    run.kl_controller.load_state_dict(driver["kl_controller"])
    run.reward.load_state_dict(driver["reward"])
    run.buffer.set_policy_version(run.policy_version)
    set_rng_state(rng)
