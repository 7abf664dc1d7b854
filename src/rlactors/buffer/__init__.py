"""The staleness-aware replay buffer: the `ReplayBuffer` actor (`replay`), its accounting as a plain
class (`core`), the records and pure rules it decides with (`records`), and its parquet checkpoint
files (`storage`)."""

from rlactors.buffer.core import BufferCore
from rlactors.buffer.records import DynamicSamplingExhausted, SampledBatchRef, capacity_groups
from rlactors.buffer.replay import ReplayBuffer
from rlactors.buffer.storage import load_buffer_state, save_buffer_state

__all__ = ["BufferCore", "DynamicSamplingExhausted", "ReplayBuffer", "SampledBatchRef", "capacity_groups",
           "load_buffer_state", "save_buffer_state"]
