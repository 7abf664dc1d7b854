"""Where each tensor of a weight update sits in a bucket (pure: names, dtypes, shapes, offsets).

A weight update is cut, in the source's order, into buckets of at most `segment_bytes`; each
tensor starts at an offset aligned to `ALIGN_BYTES` (any dtype's view of the bytes is then
aligned). A bucket ends at a layer boundary when the next layer's tensors (`layer_of`) fit a bucket
of their own but not the rest of this one: the engine's layerwise reload then finishes every layer
within the bucket that brought it and holds nothing of the segment afterwards. A segment is as big as the larger of the configured bucket size and the largest tensor,
so every tensor fits in one. Both sides compute nothing else: the sender fills the buckets in this
layout and tells the receiver each bucket's entries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

ALIGN_BYTES = 64
LAYER_PREFIX = re.compile(r"^(.*?\.layers\.\d+)\.")  # HF decoder layers: model.layers.12.mlp...


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of its bucket

    @property
    def num_bytes(self) -> int:
        return tensor_bytes(self.dtype, self.shape)


def tensor_bytes(dtype: torch.dtype, shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count * dtype.itemsize


def aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


def segment_bytes_for(metas: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> int:
    """The segment size: `bucket_bytes`, or the largest tensor if bigger (rounded up to the alignment)."""
    largest = max((tensor_bytes(dtype, shape) for _, dtype, shape in metas), default=0)
    return aligned(max(bucket_bytes, largest, 1))


def layer_of(name: str) -> str:
    """The layer a weight belongs to: its decoder layer (`model.layers.12`), else the weight itself."""
    match = LAYER_PREFIX.match(name)
    return match.group(1) if match else name


def layer_runs(metas: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[int]:
    """For each tensor, the bytes that it and the rest of its layer's run of consecutive tensors
    take when laid out from an aligned offset."""
    remaining = [0] * len(metas)
    for index in range(len(metas) - 1, -1, -1):
        name, dtype, shape = metas[index]
        following = index + 1 < len(metas) and layer_of(metas[index + 1][0]) == layer_of(name)
        size = tensor_bytes(dtype, shape)
        remaining[index] = aligned(size) + remaining[index + 1] if following else size
    return remaining


def plan_buckets(metas: list[tuple[str, torch.dtype, tuple[int, ...]]], segment_bytes: int) -> list[list[Entry]]:
    """Cut `metas` (name, dtype, shape), in order, into buckets whose entries fit `segment_bytes`,
    keeping each layer's tensors together where the layer fits a bucket."""
    buckets: list[list[Entry]] = []
    used = 0
    runs = layer_runs(metas)
    for index, (name, dtype, shape) in enumerate(metas):
        size = tensor_bytes(dtype, shape)
        if size > segment_bytes:
            raise ValueError(f"weight {name!r} ({size} bytes) does not fit a segment of {segment_bytes} bytes")
        start = aligned(used)
        layer_starts = index == 0 or layer_of(metas[index - 1][0]) != layer_of(name)
        layer_moves = layer_starts and start + runs[index] > segment_bytes and runs[index] <= segment_bytes
        if not buckets or start + size > segment_bytes or (layer_moves and buckets[-1]):
            buckets.append([])
            start = 0
        buckets[-1].append(Entry(name, dtype, tuple(int(s) for s in shape), start))
        used = start + size
    return buckets


def bucket_info(bucket: list[Entry]) -> dict:
    """A bucket's entries as the plain lists an update carries (names, dtype_names, shapes, offsets)."""
    return {
        "names": [entry.name for entry in bucket],
        "dtype_names": [str(entry.dtype).removeprefix("torch.") for entry in bucket],
        "shapes": [list(entry.shape) for entry in bucket],
        "offsets": [entry.offset for entry in bucket],
    }


def views(segment: torch.Tensor, info: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a uint8 `segment` for the entries of `bucket_info`."""
    named = []
    for name, dtype_name, shape, offset in zip(info["names"], info["dtype_names"], info["shapes"], info["offsets"],
                                               strict=True):
        dtype = getattr(torch, dtype_name)
        size = tensor_bytes(dtype, shape)
        if offset < 0 or offset + size > segment.numel():
            raise ValueError(f"weight {name!r}: bytes {offset}..{offset + size} lie outside the segment "
                             f"of {segment.numel()} bytes")
        named.append((name, segment[offset:offset + size].view(dtype).view(shape)))
    return named


def update_bytes(info: dict) -> int:
    """The bytes an update carries, from its per-tensor dtype names and shapes (any backend's info)."""
    return sum(tensor_bytes(getattr(torch, dtype_name), shape)
               for dtype_name, shape in zip(info.get("dtype_names", ()), info.get("shapes", ()), strict=True))
