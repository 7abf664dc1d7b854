"""The trainer's weights as a vLLM `WeightSource`: HF-named, each shared tensor once, in the
engines' dtype, gathered one tensor at a time (an FSDP `full_tensor()` is a collective, so every
rank iterates in the same order; only the sender keeps what it gathers)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource


class NamedTensorSource(WeightSource):
    """`named_tensors` is a callable returning a fresh (name, tensor) iterable per pass (e.g.
    `lambda: fsdp.unique_state_items(model)`); tensors may be FSDP DTensors. `dtype` is the wire
    dtype (None: as they are)."""

    def __init__(self, named_tensors, dtype: torch.dtype | None = None):
        self._named_tensors = named_tensors
        self.dtype = dtype

    def use(self, named_tensors) -> None:
        """Read the tensors from `named_tensors` from now on (a later sync's weights)."""
        self._named_tensors = named_tensors

    def metadata(self) -> list[ParamMeta]:
        # A DTensor's shape is its global shape: no gather.
        return [ParamMeta(name, self.dtype or tensor.dtype, tuple(tensor.shape)) for name, tensor in self._named_tensors()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._named_tensors():
            whole = tensor.detach()
            whole = whole.full_tensor() if hasattr(whole, "full_tensor") else whole
            yield name, whole if self.dtype is None else whole.to(self.dtype)


def from_pairs(pairs: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> NamedTensorSource:
    """A source over fixed (name, tensor) pairs (a test's or notebook's weights)."""
    pairs = list(pairs)
    return NamedTensorSource(lambda: iter(pairs), dtype)
