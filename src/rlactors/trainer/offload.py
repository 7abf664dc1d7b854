"""Moving a trainer rank's state between its device and host memory (colocated time-sharing).

What moves: the FSDP2 module (its sharded DTensor parameters and its buffers) and every optimizer
state tensor with at least one dimension (AdamW's `exp_avg`, `exp_avg_sq`). What does not:
0-dim state entries (AdamW's `step`), which stay where the optimizer keeps them, on the host
unless it was built capturable or fused, and gradients, which must already be gone.

Invariants: parameters keep their identity (FSDP2's `_apply` swaps DTensor contents in place), so
the optimizer's references stay valid; nothing is copied when a tensor already is on the target
(on CPU every move is a no-op, yet the calls, and their order, are the same as on a GPU).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import FSDPModule

HOST = torch.device("cpu")


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of a (possibly sharded) tensor."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def drop_gradients(model: torch.nn.Module) -> int:
    """Set every gradient to None; returns how many there were. After an optimizer step there are
    none (`zero_grad(set_to_none=True)`); some are left only by an update that raised midway, and
    they belong to no step that will ever be taken."""
    num_dropped = 0
    for parameter in model.parameters():
        if parameter.grad is not None:
            parameter.grad = None
            num_dropped += 1
    return num_dropped


def move_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device) -> int:
    """Move parameters, buffers and optimizer state to `device`; returns the bytes of parameters
    and optimizer state this rank holds (the figure that leaves or re-enters the device)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # One rank keeps a forward's gathered parameters registered (no reshard after forward):
            # back to the sharded ones, which the optimizer holds, and free the gathered copies.
            module.reshard()
    parameters = list(model.parameters())
    if any(p.device != device for p in parameters) or any(b.device != device for b in model.buffers()):
        model.to(device)
    moved_bytes = sum(local_bytes(p) for p in parameters)
    for state in (optimizer.state.values() if optimizer is not None else ()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device)
                moved_bytes += local_bytes(value)
    return moved_bytes


def release_cached_memory(device: torch.device) -> None:
    """Hand the device memory the caching allocator keeps back to the driver, so another process
    (the rollout engine) can have it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def resident(method):
    """Decorate a `TrainerWorker` method that may be called while the rank is offloaded (weight
    exports and checkpoints at resume, or between colocated steps): the state is on the device for
    the call and goes back to the host afterwards if it was there. Forward and update passes are
    not decorated: those raise when offloaded, since an onload per call would defeat the schedule."""

    @functools.wraps(method)
    def on_device(self, *args, **kwargs):
        was_offloaded = self.offloaded
        self.onload()
        try:
            return method(self, *args, **kwargs)
        finally:
            if was_offloaded:
                self.offload()

    return on_device
