"""The trainer side of a sync over shared memory, without engines: when it pauses them."""

from __future__ import annotations

import pytest
import torch

from rlactors.weight_sync.source import NamedTensorSource
from rlactors.weight_sync.trainer_engines import SharedMemoryInitInfo, SharedMemoryTrainerEngine


class RecordingClient:
    """The engines' side as a list of events (vLLM's VLLMWeightSyncClient protocol)."""

    def __init__(self, events: list[str]):
        self.events = events

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.events.append("init")

    def start_weight_update(self) -> None:
        self.events.append("start")  # the engines pause generating here

    def update_weights(self, update_info: dict) -> None:
        self.events.append("update " + ",".join(name for name in update_info["names"]))

    def finish_weight_update(self) -> None:
        self.events.append("finish")


def send(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[str]:
    events: list[str] = []

    def named_tensors():
        for name, tensor in tensors.items():
            events.append(f"gather {name}")
            yield name, tensor

    source = NamedTensorSource(named_tensors)
    engine = SharedMemoryTrainerEngine.trainer_init(SharedMemoryInitInfo(rank=0, bucket_bytes=bucket_bytes),
                                                    client=RecordingClient(events), source=source)
    events.clear()  # metadata() iterated the tensors once, without a gather
    engine.send_weights()
    engine.shutdown()
    return events


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 256])
def test_the_engines_pause_once_the_first_bucket_is_packed_not_before_its_gathers(bucket_bytes):
    tensors = {f"model.layers.{i}.weight": torch.full((8, 8), float(i)) for i in range(3)}  # 256 bytes each
    events = send(tensors, bucket_bytes)
    start = events.index("start")
    assert events.count("start") == 1 and events[-1] == "finish"
    assert "gather model.layers.0.weight" in events[:start]  # the first bucket was gathered while generating
    assert events[start + 1] == "update model.layers.0.weight" + (",model.layers.1.weight,model.layers.2.weight"
                                                                   if bucket_bytes > 1024 else "")
    # Every bucket after the first is gathered while the engines load the one before.
    assert [e for e in events if e.startswith("update")] == (
        ["update model.layers.0.weight,model.layers.1.weight,model.layers.2.weight"] if bucket_bytes > 1024
        else [f"update model.layers.{i}.weight" for i in range(3)])


def test_a_sync_with_nothing_to_send_still_opens_and_closes_the_update():
    assert send({}, 1 << 20) == ["start", "finish"]
