"""The rollout engine's side of a weight update that needs no vLLM: when one may start, its timing,
and an object-store bucket turned into the inline bytes vLLM gets."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlactors.rollout.weights import WeightUpdate, check_update_start, vllm_update_info


def test_an_update_starts_only_forward_and_never_after_one_that_did_not_finish():
    check_update_start(3, 3, None)  # the same version again: a re-send after a restore
    with pytest.raises(ValueError, match="older than the loaded 3"):
        check_update_start(2, 3, None)
    with pytest.raises(RuntimeError, match="policy_version 4 never finished"):
        check_update_start(5, 3, WeightUpdate(4, pause_start_s=0.0, was_asleep=False))


def test_the_timing_of_an_update_splits_the_pause_from_the_load():
    update = WeightUpdate(7, pause_start_s=10.0, was_asleep=False, sync_start_s=12.5)
    timing = update.timing()
    assert timing["policy_version"] == 7 and timing["pause_s"] == 2.5
    assert timing["weight_sync_s"] > 0


def test_a_bucket_becomes_inline_bytes_and_other_update_info_passes_unchanged():
    backend_info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
    assert asyncio.run(vllm_update_info(backend_info)) is backend_info
    bucket = [("w", torch.tensor([1.0, 2.0], dtype=torch.bfloat16))]
    info = asyncio.run(vllm_update_info({"bucket": bucket, "digest": True}))
    assert info["names"] == ["w"] and info["dtype_names"] == ["bfloat16"] and info["shapes"] == [[2]]
    assert info["data"] == [bucket[0][1].view(torch.uint8).numpy().tobytes()] and info["digest"] is True
    with pytest.raises(TypeError, match="expected a float tensor"):
        asyncio.run(vllm_update_info({"bucket": [("w", torch.tensor([1]))]}))
