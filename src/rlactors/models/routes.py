"""MoE routing as a sample carries it: which experts the rollout engine sent each position of
prompt + response to, at every layer (`Sample.routed_experts`, [positions, layers, top_k]).

The engine records it per vLLM request (`rlactors.rollout.routing_capture`), the engine actor
joins a sample's requests (`merge`: a response resumed under new weights keeps the routing of the
positions it had), and the trainer reads it back as a tensor with -1 where nothing was recorded
(`as_tensor`), which `rlactors.trainer.routing_replay` routes by. numpy and torch only.
"""

from __future__ import annotations

import numpy as np

from rlactors.types import Sample


def routing_dtype(num_experts: int) -> np.dtype:
    """Expert ids are uint8 where the model has fewer than 255 experts, else uint16: the largest
    value is kept free to mark a position with no record (`unrecorded_expert`)."""
    return np.dtype(np.uint8 if num_experts < 255 else np.uint16)


def unrecorded_expert(dtype: np.dtype) -> int:
    """The stored value of a position the engine never ran: the dtype's largest."""
    return int(np.iinfo(dtype).max)


def decode(routes: bytes, shape: list[int]) -> np.ndarray:
    """The [positions, layers, top_k] expert ids in their stored dtype (uint8 or uint16)."""
    count = int(np.prod(shape)) if shape else 0
    if count == 0:
        return np.zeros((0, 0, 0), dtype=np.uint8)
    itemsize, rest = divmod(len(routes), count)
    if rest or itemsize not in (1, 2):
        raise ValueError(f"routed experts of {len(routes)} bytes do not hold shape {shape} of uint8 or uint16")
    return np.frombuffer(routes, dtype=np.uint8 if itemsize == 1 else np.uint16).reshape(shape)


def merge(sample: Sample, routes: bytes, shape: list[int]) -> None:
    """Add one vLLM request's routing to `sample`: the request ran positions 0.. of prompt +
    response so far; positions the sample already has keep theirs (recorded when they were
    generated, under the weights that generated them), the rest are appended."""
    new = decode(routes, shape)
    if not sample.routed_experts_shape:
        _store(sample, new)
        return
    old = decode(sample.routed_experts, sample.routed_experts_shape)
    if old.shape[1:] != new.shape[1:] or old.dtype != new.dtype:
        raise ValueError(f"routing of shape {list(new.shape[1:])} ({new.dtype}) after {list(old.shape[1:])} ({old.dtype})")
    _store(sample, np.concatenate([old, new[len(old):]]))


def truncate(sample: Sample, num_positions: int) -> None:
    """Keep the routing of the first `num_positions` positions (a turn restarted from scratch)."""
    if sample.routed_experts_shape and sample.routed_experts_shape[0] > num_positions:
        _store(sample, decode(sample.routed_experts, sample.routed_experts_shape)[:num_positions])


def _store(sample: Sample, routing: np.ndarray) -> None:
    """A routing of 0 positions is stored as none (b"", []), never as [0, layers, top_k]: its
    bytes cannot tell its dtype or layers apart, so it would not match the next request's."""
    if len(routing):
        sample.routed_experts, sample.routed_experts_shape = routing.tobytes(), list(routing.shape)
    else:
        sample.routed_experts, sample.routed_experts_shape = b"", []


def as_tensor(sample: Sample, num_positions: int):
    """[num_positions, layers, top_k] int16 expert ids, -1 where the engine recorded none (past its
    record, or its unrecorded marker); None when the sample carries no routing."""
    import torch

    if not sample.routed_experts_shape:
        return None
    stored = decode(sample.routed_experts, sample.routed_experts_shape)[:num_positions]
    routes = torch.full((num_positions, *stored.shape[1:]), -1, dtype=torch.int16)
    values = torch.from_numpy(stored.astype(np.int32))
    values[values == unrecorded_expert(stored.dtype)] = -1
    routes[:len(stored)] = values.to(torch.int16)
    return routes
