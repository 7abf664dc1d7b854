"""Atomic, durable checkpoint directories and the `latest` pointer.

Layout under a checkpoint root:

    root/step_00000012/      a complete checkpoint (only ever appears by rename)
    root/step_00000012.1/    the same step saved again (a re-save never renames the one `latest`
                             names; the superseded copy is deleted once `latest` moved)
    root/step_00000014.tmp/  a checkpoint being written (one left by a kill mid-write is ignored, and
                             deleted at the next run's start: `remove_unfinished`)
    root/latest              text file naming the newest complete checkpoint ("step_00000012")
    root/step_N/manifest.json  every file of that checkpoint with its size and CRC-32 (`damage`
                             checks a checkpoint against it before a resume loads anything)

Writers fill `temp_dir(root, step)`, then `commit(root, step)` fsyncs every file and directory in
it, renames it into place and rewrites `latest` by write-to-temp + fsync + `os.replace` + fsync of
the root, so a reader (even after a power loss) sees either the old or the new checkpoint, never a
partial one, and `latest` always names a directory that exists. `prune(root, keep)` then deletes
all but the newest `keep` committed checkpoints, never the one `latest` names.

A trainer checkpoint itself (written by `TrainerWorker.save_checkpoint`, through
`rlactors.trainer.rank_checkpoint`) holds: model and optimizer state as torch.distributed.checkpoint
(DCP) shards, and one `rank_<r>.pt` per rank with the LR scheduler, step counters and RNG states,
read back by `load_plain` (tensors and plain Python values only: a file that would run code when
unpickled is refused). Every rank must see the same filesystem path (one machine, or a shared
filesystem).
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import zlib
from pathlib import Path

import torch

from rlactors.runtime.durable import fsync_path, fsync_tree, write_durably

LATEST = "latest"
MANIFEST = "manifest.json"  # every file of the checkpoint with its size and CRC-32, written before the commit
CHECKSUM_CHUNK_BYTES = 8 << 20
TEMP_SUFFIX = ".tmp"
DELETING_SUFFIX = ".deleting"
# A committed checkpoint's name: the step, and a revision number when the step was saved again.
COMMITTED = re.compile(r"step_(\d+)(?:\.(\d+))?")


def checkpoint_name(step: int, revision: int = 0) -> str:
    name = f"step_{step:08d}"
    return f"{name}.{revision}" if revision else name


def temp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / (checkpoint_name(step) + TEMP_SUFFIX)


def prepare_temp_dir(root: str | Path, step: int) -> Path:
    """An empty temp directory for checkpoint `step` (a leftover from an interrupted write is removed)."""
    path = temp_dir(root, step)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


# --------------------------------------------------------------------------------------------
# Commit, prune, find


def committed_checkpoints(root: str | Path) -> list[Path]:
    """The committed checkpoint directories under `root`, oldest first (by step, then revision)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = COMMITTED.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match[1]), int(match[2] or 0), path))
    return [path for _, _, path in sorted(found)]


def _delete(path: Path) -> None:
    """Remove a checkpoint directory: renamed out of the committed names first, so a kill
    mid-delete never leaves a half-deleted directory that looks committed."""
    doomed = path.with_name(path.name + DELETING_SUFFIX)
    shutil.rmtree(doomed, ignore_errors=True)
    path.rename(doomed)
    shutil.rmtree(doomed)


def commit(root: str | Path, step: int) -> Path:
    """Make the finished temp directory durable, move it into place and point `latest` at it.
    Returns the committed directory (`step_N`, or `step_N.<revision>` when step N existed)."""
    root = Path(root)
    write_manifest(temp_dir(root, step))
    fsync_tree(temp_dir(root, step))
    # Re-saving a step: the new copy takes a free revision name, so the copy `latest` may name
    # stays in place until `latest` names the new one.
    superseded = [path for path in committed_checkpoints(root) if step_of(path) == step]
    taken = {path.name for path in superseded}
    revision = next(r for r in range(len(taken) + 1) if checkpoint_name(step, r) not in taken)
    final = root / checkpoint_name(step, revision)
    temp_dir(root, step).rename(final)
    fsync_path(root)
    write_durably(root / LATEST, (final.name + "\n").encode())
    for path in superseded:
        _delete(path)
    remove_unfinished(root)
    return final


def write_manifest(path: str | Path) -> None:
    """Record every file under checkpoint `path` with its size and CRC-32 (`MANIFEST`), so that a
    resume can tell a damaged checkpoint (a file missing, truncated or changed) before it loads it."""
    path = Path(path)
    files = {str(file.relative_to(path)): {"bytes": file.stat().st_size, "crc32": _crc32(file)}
             for file in sorted(path.rglob("*")) if file.is_file() and file.name != MANIFEST}
    (path / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def damage(path: str | Path) -> str | None:
    """What is wrong with checkpoint `path` against its manifest, naming the file (None: intact, or
    written before checkpoints had manifests). Sizes are checked first (a truncated file is found
    without reading any), then every checksum."""
    path = Path(path)
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as error:
        return f"{MANIFEST} is unreadable ({type(error).__name__}: {error})"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} is {file.stat().st_size} bytes, its manifest says {expected['bytes']}"
    for name, expected in files.items():
        if _crc32(path / name) != expected["crc32"]:
            return f"{name} changed since it was written (its checksum differs from the manifest's)"
    return None


def _crc32(file: Path) -> int:
    crc = 0
    with open(file, "rb") as handle:
        while chunk := handle.read(CHECKSUM_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def remove_unfinished(root: str | Path) -> list[Path]:
    """Delete what interrupted writes and deletes left under `root` (`step_N.tmp`, `*.deleting`):
    never loadable, they only take space. Only while nothing writes a checkpoint there (a run calls
    it at its start and after each commit). Returns the deleted paths."""
    root = Path(root)
    leftovers = sorted([*root.glob("*" + TEMP_SUFFIX), *root.glob("*" + DELETING_SUFFIX)]) if root.is_dir() else []
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def prune(root: str | Path, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints (None: keep all), never the one
    `latest` names. Returns the deleted paths."""
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep}")
    protected = latest_checkpoint(root)
    doomed = [path for path in committed_checkpoints(root)[:-keep] if path != protected]
    for path in doomed:
        _delete(path)
    return doomed


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
    if path.name.endswith(DELETING_SUFFIX):
        raise ValueError(f"{path} is a checkpoint being deleted; load a committed one")
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return path


def step_of(path: str | Path) -> int:
    match = COMMITTED.fullmatch(Path(path).name)
    if match is None:
        raise ValueError(f"{path}: not a checkpoint directory name (expected step_<number>[.<revision>])")
    return int(match[1])


def load_plain(path: str | Path) -> dict:
    """A `torch.save` file holding only tensors and plain Python values (dicts, lists, tuples,
    numbers, strings, None). Anything else (a pickled class or function: what would run code on
    load) is refused with an error naming the file."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).splitlines()[-1] if str(error) else type(error).__name__
        raise ValueError(f"{path}: refused to load: it holds more than tensors and plain Python values "
                         f"(a checkpoint file that could run code when read). {reason}") from None
