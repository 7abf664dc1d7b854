"""Atomic checkpoint directories and the `latest` pointer, and the LR schedule: no Ray."""

import math

import pytest

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
    again = _write(tmp_path, 2, "two again")  # re-saving a step replaces it
    assert (again / "data").read_text() == "two again"
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


def test_dangling_pointer_and_missing_checkpoint_are_errors(tmp_path):
    (tmp_path / "latest").write_text("step_00000009\n")
    with pytest.raises(FileNotFoundError, match="step_00000009"):
        checkpoint.latest_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.resolve_checkpoint(tmp_path / "nothing")


def test_lr_schedule_warmup_then_decay():
    assert [lr_multiplier(s, 4, 100, "constant", 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = [lr_multiplier(s, 2, 12, "cosine", 0.1) for s in range(14)]
    assert cosine[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in zip(cosine[2:], cosine[3:], strict=False))
    assert math.isclose(cosine[7], 0.1 + 0.9 * 0.5) and math.isclose(cosine[12], 0.1) and cosine[13] == cosine[12]
    with pytest.raises(ValueError, match="'linear'"):
        lr_multiplier(5, 0, 10, "linear", 0.0)
