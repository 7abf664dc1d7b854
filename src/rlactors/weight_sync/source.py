"""The trainer's weights as a vLLM `WeightSource`: in the checkpoint's names and layout (what vLLM's
loader reads), each shared tensor once, in the engines' dtype, gathered one tensor at a time (an
FSDP `full_tensor()` is a collective, so every rank iterates in the same order; only the sender
keeps what it gathers)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from rlactors.models.moe import Split, checkpoint_shapes, identity_split


class NamedTensorSource(WeightSource):
    """`named_tensors` is a callable returning a fresh (name, tensor) iterable per pass (e.g.
    `lambda: fsdp.unique_state_items(model)`); tensors may be FSDP DTensors. `dtype` is the wire
    dtype (None: as they are). `split` maps each whole tensor to the checkpoint tensors it is
    saved as (`rlactors.models.moe.checkpoint_layout`: fused experts become one tensor per expert)."""

    def __init__(self, named_tensors, dtype: torch.dtype | None = None, split: Split = identity_split):
        self._named_tensors = named_tensors
        self.dtype = dtype
        self.split = split

    def use(self, named_tensors) -> None:
        """Read the tensors from `named_tensors` from now on (a later sync's weights)."""
        self._named_tensors = named_tensors

    def metadata(self) -> list[ParamMeta]:
        # A DTensor's shape is its global shape: no gather; the split runs on the meta device.
        return [ParamMeta(saved_name, dtype, shape)
                for name, tensor in self._named_tensors()
                for saved_name, dtype, shape in checkpoint_shapes(self.split, name, tuple(tensor.shape),
                                                                   self.dtype or tensor.dtype)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._named_tensors():
            whole = tensor.detach()
            whole = whole.full_tensor() if hasattr(whole, "full_tensor") else whole
            for saved_name, saved in self.split(name, whole):
                yield saved_name, saved if self.dtype is None else saved.to(self.dtype)


def from_pairs(pairs: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> NamedTensorSource:
    """A source over fixed (name, tensor) pairs (a test's or notebook's weights)."""
    pairs = list(pairs)
    return NamedTensorSource(lambda: iter(pairs), dtype)
