"""Atomic, durable checkpoint directories and the `latest` pointer, pruning, refusing checkpoint
files that would run code, and the LR schedule: no Ray."""

import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import RunsCode

from rlactors.trainer import checkpoint
from rlactors.trainer.fsdp import lr_multiplier


def _write(root, step, payload):
    temp = checkpoint.prepare_temp_dir(root, step)
    (temp / "data").write_text(payload)
    return checkpoint.commit(root, step)


def test_commit_moves_into_place_and_points_latest(tmp_path):
    assert checkpoint.latest_checkpoint(tmp_path) is None
    first = _write(tmp_path, 1, "one")
    assert first.name == "step_00000001" and not checkpoint.temp_dir(tmp_path, 1).exists()
    assert checkpoint.latest_checkpoint(tmp_path) == first
    second = _write(tmp_path, 2, "two")
    assert checkpoint.resolve_checkpoint(tmp_path) == second
    assert checkpoint.step_of(second) == 2
    again = _write(tmp_path, 2, "two again")  # re-saving a step replaces it (under a revision name)
    assert (again / "data").read_text() == "two again"
    assert checkpoint.latest_checkpoint(tmp_path) == again and checkpoint.step_of(again) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001", "step_00000002.1"]
    third = _write(tmp_path, 2, "two, third time")  # the canonical name is free again
    assert third.name == "step_00000002" and (third / "data").read_text() == "two, third time"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001", "step_00000002"]


def test_half_written_checkpoint_is_ignored(tmp_path):
    done = _write(tmp_path, 3, "three")
    # A kill mid-write leaves a temp directory and the old pointer.
    partial = checkpoint.prepare_temp_dir(tmp_path, 4)
    (partial / "__0_0.distcp").write_bytes(b"\x00" * 10)
    assert checkpoint.resolve_checkpoint(tmp_path) == done
    with pytest.raises(ValueError, match="unfinished checkpoint"):
        checkpoint.resolve_checkpoint(partial)
    # The next save of that step starts from an empty directory.
    assert list(checkpoint.prepare_temp_dir(tmp_path, 4).iterdir()) == []


def test_the_manifest_names_a_missing_truncated_or_changed_file(tmp_path):
    temp = checkpoint.prepare_temp_dir(tmp_path, 1)
    (temp / "actor").mkdir()
    (temp / "actor" / "__0_0.distcp").write_bytes(b"weights" * 100)
    (temp / "driver.json").write_text("{}")
    done = checkpoint.commit(tmp_path, 1)
    assert checkpoint.damage(done) is None
    shard = done / "actor" / "__0_0.distcp"
    shard.write_bytes(b"weights" * 50)  # a truncated file: found by its size, nothing read
    assert checkpoint.damage(done) == "actor/__0_0.distcp is 350 bytes, its manifest says 700"
    shard.write_bytes(b"Weights" + b"weights" * 99)  # the same size, one byte changed
    assert "actor/__0_0.distcp changed since it was written" in checkpoint.damage(done)
    shard.unlink()
    assert checkpoint.damage(done) == "actor/__0_0.distcp is missing"
    (done / checkpoint.MANIFEST).unlink()  # a checkpoint from before manifests: nothing to check it by
    assert checkpoint.damage(done) is None


def test_what_interrupted_writes_and_deletes_left_is_removed_and_nothing_else(tmp_path):
    done = _write(tmp_path, 3, "three")
    (checkpoint.prepare_temp_dir(tmp_path, 4) / "__0_0.distcp").write_bytes(b"\x00" * 10)  # a kill mid-write
    (tmp_path / "step_00000002.deleting").mkdir()  # a kill mid-delete
    removed = checkpoint.remove_unfinished(tmp_path)
    assert [path.name for path in removed] == ["step_00000002.deleting", "step_00000004.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", done.name]
    assert checkpoint.remove_unfinished(tmp_path / "no such root") == []
    # A commit removes them too: the next checkpoint of a run that resumed past a half-written one.
    checkpoint.prepare_temp_dir(tmp_path, 6)
    _write(tmp_path, 5, "five")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", done.name, "step_00000005"]


def test_dangling_pointer_and_missing_checkpoint_are_errors(tmp_path):
    (tmp_path / "latest").write_text("step_00000009\n")
    with pytest.raises(FileNotFoundError, match="step_00000009"):
        checkpoint.latest_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.resolve_checkpoint(tmp_path / "nothing")


def test_resaving_a_step_never_leaves_latest_dangling(tmp_path, monkeypatch):
    """After every rename, replace and delete a re-save makes, `latest` names a complete checkpoint
    holding the old or the new data (a kill at any of those points leaves a loadable one)."""
    _write(tmp_path, 1, "one")
    _write(tmp_path, 2, "old")
    seen, broken = [], []

    def check(what):
        try:
            seen.append((what, (checkpoint.latest_checkpoint(tmp_path) / "data").read_text()))
        except (FileNotFoundError, NotADirectoryError) as error:
            broken.append(f"after {what}: {error}")

    def watched(function, what):
        def call(*args, **kwargs):
            result = function(*args, **kwargs)
            check(what)
            return result
        return call

    monkeypatch.setattr(Path, "rename", watched(Path.rename, "rename"))
    monkeypatch.setattr(os, "replace", watched(os.replace, "replace"))
    monkeypatch.setattr(shutil, "rmtree", watched(shutil.rmtree, "rmtree"))
    temp = checkpoint.prepare_temp_dir(tmp_path, 2)
    (temp / "data").write_text("new")
    checkpoint.commit(tmp_path, 2)
    assert not broken, broken
    assert seen and {data for _, data in seen} <= {"old", "new"} and seen[-1][1] == "new"


def test_commit_fsyncs_every_file_and_the_pointer(tmp_path, monkeypatch):
    synced = []
    fsync = os.fsync

    def recording_fsync(descriptor):
        synced.append(os.path.realpath(f"/proc/self/fd/{descriptor}"))
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    temp = checkpoint.prepare_temp_dir(tmp_path, 5)
    (temp / "actor").mkdir()
    (temp / "actor" / "rank_0.pt").write_bytes(b"state")
    (temp / "driver.json").write_text("{}")
    final = checkpoint.commit(tmp_path, 5)
    # Written under the temp name, so synced there before the rename.
    for relative in ("", "actor", "actor/rank_0.pt", "driver.json"):
        assert os.path.realpath(temp / relative) in synced, relative
    root = os.path.realpath(tmp_path)
    assert root in synced  # the renames' directory entries
    pointer = os.path.realpath(tmp_path / "latest.tmp")
    assert pointer in synced and synced.index(pointer) < len(synced) - 1 and synced[-1] == root
    assert checkpoint.latest_checkpoint(tmp_path) == final


def test_prune_keeps_the_newest_and_never_the_latest(tmp_path):
    for step in range(1, 6):
        _write(tmp_path, step, str(step))
        checkpoint.prune(tmp_path, keep=2)
    assert [p.name for p in checkpoint.committed_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    assert checkpoint.prune(tmp_path, keep=None) == []
    # A run resumed from an earlier step re-saves it: `latest` names it, so it stays. (And what a
    # kill in the middle of an earlier delete left goes.)
    (tmp_path / ("step_00000002" + checkpoint.DELETING_SUFFIX)).mkdir()
    resaved = _write(tmp_path, 1, "one again")
    deleted = checkpoint.prune(tmp_path, keep=1)
    assert [p.name for p in deleted] == ["step_00000004"]
    assert checkpoint.committed_checkpoints(tmp_path) == [resaved, tmp_path / "step_00000005"]
    assert checkpoint.latest_checkpoint(tmp_path) == resaved
    assert not any(p.name.endswith(checkpoint.DELETING_SUFFIX) for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="keep"):
        checkpoint.prune(tmp_path, keep=0)


def test_a_checkpoint_file_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"step": 1, "rng": {"python": RunsCode(marker)}}, tmp_path / "rank_0.pt")
    with pytest.raises(ValueError, match=r"rank_0\.pt: refused to load"):
        checkpoint.load_plain(tmp_path / "rank_0.pt")
    assert not marker.exists()
    # What a trainer rank file holds loads: tensors, numbers, strings, None, tuples, lists, dicts.
    import random

    plain = {"step": 3, "role": "actor", "scheduler": {"base_lrs": [0.1], "lr_lambdas": [None]},
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": None}}
    torch.save(plain, tmp_path / "rank_1.pt")
    loaded = checkpoint.load_plain(tmp_path / "rank_1.pt")
    random.setstate(loaded["rng"]["python"])
    assert loaded["scheduler"] == plain["scheduler"] and torch.equal(loaded["rng"]["torch"], plain["rng"]["torch"])


def test_lr_schedule_warmup_then_decay():
    assert [lr_multiplier(s, 4, 100, "constant", 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = [lr_multiplier(s, 2, 12, "cosine", 0.1) for s in range(14)]
    assert cosine[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in zip(cosine[2:], cosine[3:], strict=False))
    assert math.isclose(cosine[7], 0.1 + 0.9 * 0.5) and math.isclose(cosine[12], 0.1) and cosine[13] == cosine[12]
    with pytest.raises(ValueError, match="'linear'"):
        lr_multiplier(5, 0, 10, "linear", 0.0)
