"""The staleness-aware replay buffer: the `ReplayBuffer` actor (`replay`), the driver's typed
`BufferClient` for it (`client`), its accounting as a plain class (`core`), the records and pure
rules it decides with (`records`), its parquet checkpoint files (`storage`) and what they hold
(`resume`), and the run-level log of finished ledger rows and events (`ledger_log`)."""

from rlactors.buffer.client import BufferClient
from rlactors.buffer.core import BufferCore
from rlactors.buffer.ledger_log import LedgerLog, read_checkpoint_ledger
from rlactors.buffer.records import (
           DynamicSamplingExhausted,
           RolloutErrorsExhausted,
           SampledBatchRef,
           capacity_groups,
)
from rlactors.buffer.replay import ReplayBuffer
from rlactors.buffer.storage import load_buffer_state, save_buffer_state

__all__ = ["BufferClient", "BufferCore", "DynamicSamplingExhausted", "LedgerLog", "ReplayBuffer", "RolloutErrorsExhausted",
           "SampledBatchRef", "capacity_groups", "load_buffer_state", "read_checkpoint_ledger", "save_buffer_state"]
