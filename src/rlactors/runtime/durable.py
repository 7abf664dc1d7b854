"""Durable writes: a rename is only as durable as the data it moves and the directory holding it.

Used by the run checkpoints (`rlactors.trainer.checkpoint`) and the buffer's ledger log
(`rlactors.buffer.ledger_log`): write under a temporary name, fsync, rename, fsync the directory.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """Flush one file's or directory's contents (a directory's: its entries) to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(path: str | Path) -> None:
    """fsync every file and directory under `path`, children before their directory."""
    for directory, _, files in os.walk(path, topdown=False):
        for name in files:
            fsync_path(os.path.join(directory, name))
        fsync_path(directory)


def write_durably(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably: temp file, fsync, rename, fsync the directory."""
    path = Path(path)
    temp = path.with_name(path.name + ".tmp")
    with open(temp, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp, path)
    fsync_path(path.parent)
