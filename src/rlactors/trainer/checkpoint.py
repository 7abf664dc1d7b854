"""Atomic checkpoint directories and the `latest` pointer.

Layout under a checkpoint root:

    root/step_00000012/      a complete checkpoint (only ever appears by rename)
    root/step_00000014.tmp/  a checkpoint being written (or left by a kill mid-write: ignored)
    root/latest              text file naming the newest complete checkpoint ("step_00000012")

Writers fill `temp_dir(root, step)`, then `commit(root, step)` renames it into place and rewrites
`latest` by write-to-temp + `os.replace`, so a reader sees either the old or the new checkpoint,
never a partial one. A trainer checkpoint itself (written by `TrainerWorker.save_checkpoint`) holds:
model and optimizer state as torch.distributed.checkpoint (DCP) shards, and one
`rank_<r>.pt` per rank with the LR scheduler, step counters and RNG states. Every rank must see the
same filesystem path (one machine, or a shared filesystem).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LATEST = "latest"
TEMP_SUFFIX = ".tmp"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def temp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / (checkpoint_name(step) + TEMP_SUFFIX)


def prepare_temp_dir(root: str | Path, step: int) -> Path:
    """An empty temp directory for checkpoint `step` (a leftover from an interrupted write is removed)."""
    path = temp_dir(root, step)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def commit(root: str | Path, step: int) -> Path:
    """Move the finished temp directory into place and point `latest` at it."""
    root = Path(root)
    final = root / checkpoint_name(step)
    if final.exists():  # re-saving a step: move the old one aside so the rename cannot fail
        stale = root / (checkpoint_name(step) + ".old")
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        temp_dir(root, step).rename(final)
        shutil.rmtree(stale)
    else:
        temp_dir(root, step).rename(final)
    pointer = root / (LATEST + TEMP_SUFFIX)
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint `latest` names, or None when the root holds no committed checkpoint."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{pointer} names {path.name!r}, which does not exist")
    return path


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from either a checkpoint root (follows `latest`) or a checkpoint itself."""
    path = Path(path)
    if (path / LATEST).is_file():
        return latest_checkpoint(path)
    if path.name.endswith(TEMP_SUFFIX):
        raise ValueError(f"{path} is an unfinished checkpoint (a write was interrupted); load a committed one")
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return path


def step_of(path: str | Path) -> int:
    name = Path(path).name
    if not name.startswith("step_"):
        raise ValueError(f"{path}: not a checkpoint directory name (expected step_<number>)")
    return int(name.removeprefix("step_"))
