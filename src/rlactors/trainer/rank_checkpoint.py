"""A trainer rank's part of a checkpoint: what `TrainerWorker.save_checkpoint` writes and
`load_checkpoint` restores, on every rank of the group at once (each call holds collectives).

    <checkpoint>/.metadata, *.distcp   model state, and optimizer state where the role trains, as
                                       torch.distributed.checkpoint (DCP) shards of all ranks; a
                                       role that trains keeps only what trains (a LoRA actor: the
                                       adapters; its frozen base is the model folder's)
    <checkpoint>/rank_<r>.pt           rank r's LR scheduler, step counters and RNG states
                                       (`rank_state`), plain values only (`checkpoint.load_plain`)

The directory itself (temp dir, atomic commit, `latest`, manifest) is `rlactors.trainer.checkpoint`'s,
which the driver uses too: it needs no process group and does not import DCP.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from rlactors.trainer import checkpoint

TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)  # a model with nothing frozen keeps everything
# Not strict: the frozen parameters are absent by design. Every trained one is still required:
# `dcp.load` fails for a key of `sharded_state` that the checkpoint lacks.
LOAD_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """The DCP state dict of this rank: {"model"}, and {"optimizer"} where there is one. With an
    optimizer, frozen parameters are left out (`TRAINED_ONLY`): they never change, and loading the
    role's model folder restores them."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    # DCP keeps a frozen tied head (its own name for the frozen embedding): left out here too. The
    # parameters say what trains (a state dict of keep_vars may hold an unsharded view that does not).
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    return {"model": {name: tensor for name, tensor in model_state.items() if name in trained},
            "optimizer": optim_state}


def rank_state(step: int, role: str, num_optimizer_steps: int, num_skipped_steps: int,
               scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> dict:
    """What `rank_<r>.pt` holds: the step, the role, the counters, the scheduler and the RNG states
    (torch, Python, and CUDA where there is a device), so a resumed run draws what it would have."""
    return {
        "step": step, "role": role,
        "num_optimizer_steps": num_optimizer_steps, "num_skipped_steps": num_skipped_steps,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
    }


def save(root: str | Path, step: int, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
         state: dict) -> Path:
    """Write checkpoint `step` under `root`: rank 0 prepares the temp dir, every rank writes its
    shards and its `state` (`rank_state`), rank 0 commits. Returns the committed checkpoint
    (`step_N`, or `step_N.<revision>` for a re-saved step)."""
    if rank == 0:
        checkpoint.prepare_temp_dir(root, step)
    dist.barrier()
    temp = checkpoint.temp_dir(root, step)
    dcp.save(sharded_state(model, optimizer), checkpoint_id=str(temp))
    torch.save(state, temp / f"rank_{rank}.pt")
    dist.barrier()
    if rank == 0:
        checkpoint.commit(root, step)
    dist.barrier()
    return checkpoint.latest_checkpoint(root)


def load(path: Path, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
         scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> dict:
    """Restore model, optimizer, scheduler and RNG states from the committed checkpoint `path`;
    returns this rank's `rank_state` (its step and counters, for the caller to take back)."""
    state = sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=LOAD_TRAINED_ONLY)
    else:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    saved = checkpoint.load_plain(path / f"rank_{rank}.pt")  # refuses a file that would run code
    if scheduler is not None:
        scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"]["torch"])
    random.setstate(saved["rng"]["python"])
    if saved["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["rng"]["cuda"])
    dist.barrier()
    return saved
