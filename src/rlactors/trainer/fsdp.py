"""Plain functions a trainer rank uses: process group, model loading and FSDP2 sharding, forward
passes over micro-batches, the optimizer and its learning-rate schedule, and streaming full
weights out.

Device and backend are detected: CUDA/ROCm devices use NCCL (RCCL on ROCm answers to the same
name) with bf16 compute and fp32 master weights and gradient reduction; CPU uses gloo in fp32.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlactors.config import OptimConfig
from rlactors.models import lora
from rlactors.models.moe import checkpoint_layout
from rlactors.trainer.batch import MicroBatch

ROLES = ("actor", "reference", "critic", "reward_model")


def detect_device() -> tuple[str, str]:
    """(device type, process group backend) of this process."""
    return ("cuda", "nccl") if torch.cuda.is_available() else ("cpu", "gloo")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int,
                     timeout_s: float = 600.0) -> DeviceMesh:
    """Join the group's process group (blocks until all ranks joined, at most `timeout_s`) and
    return a 1-D mesh. Every collective of the group is bounded by `timeout_s`: on gloo a rank
    waiting longer for its peers raises; on NCCL the watchdog aborts the collective and ends the
    rank's process (CUDA work queued after a failed collective is not safe to run), which the
    group sees as the rank dying."""
    device_type, backend = detect_device()
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    if device_type == "cuda":
        torch.cuda.set_device(0)  # Ray gives each rank actor its own visible device
        # 1: on a timed-out or failed collective, abort the communicator and tear the process down
        # (recent torch defaults to 3, the same without the clean-up); never 0, under which a
        # timed-out NCCL collective leaves the rank spinning on the device. TORCH_NCCL_BLOCKING_WAIT
        # (raise in the waiting thread instead) stays off: it blocks the CPU on every collective.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return init_device_mesh(device_type, (world_size,))


def load_role_model(path: str, role: str, seed: int) -> torch.nn.Module:
    """The model of a role, in fp32 on CPU, identical on every rank (seeded before any random init).

    actor and reference: the causal LM of the folder. critic: the same backbone with a one-output
    token-classification head (`AutoModelForTokenClassification`, num_labels=1), randomly
    initialised from `seed`, dropout off so forward passes are deterministic. reward_model: a
    one-label sequence classifier (`AutoModelForSequenceClassification`), its head randomly
    initialised from `seed` unless the folder already holds one; it scores a sequence at its last
    token that is not `pad_token_id` (set from the tokenizer's when the config has none).
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    if role not in ROLES:
        raise ValueError(f"trainer role {role!r}: allowed values are {ROLES}")
    torch.manual_seed(seed)
    kwargs = dict(dtype=torch.float32, local_files_only=True)
    if role == "critic":
        config = AutoConfig.from_pretrained(path, num_labels=1, local_files_only=True)
        config.classifier_dropout = 0.0
        with new_head_expected():
            return AutoModelForTokenClassification.from_pretrained(path, config=config, **kwargs)
    if role == "reward_model":
        config = AutoConfig.from_pretrained(path, num_labels=1, local_files_only=True)
        if config.pad_token_id is None:
            from rlactors.models import load_tokenizer, padding_token_id

            config.pad_token_id = padding_token_id(load_tokenizer(path))
        with new_head_expected():
            return AutoModelForSequenceClassification.from_pretrained(path, config=config, **kwargs)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


@contextlib.contextmanager
def new_head_expected():
    """transformers' errors only while loading a head onto a causal LM's backbone: its load report
    (the new head's weights missing, the LM head's unused) describes what the role asks for."""
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, gradient_checkpointing: bool = False) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer (gathered one at a time), then the root (embeddings, final
    norm, head). Parameters stay fp32 (the optimizer's master copy); on GPU compute is bf16 with
    fp32 gradient reduction."""
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers at base_model.layers to shard")
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mesh.device_type == "cuda":
        model.to(torch.device("cuda", torch.cuda.current_device()))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    # One rank shards nothing: freeing the gathered layers after forward would only make backward
    # gather (copy) them again.
    reshard = mesh.size() > 1
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model


def response_logits(model: torch.nn.Module, micro: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """fp32 logits [B, R, vocab] at the positions predicting each response token, divided by the
    sampling temperature (so logprobs match what the rollout engine sampled from)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute logprobs, got {temperature}")
    logits = model(input_ids=micro.input_ids, use_cache=False).logits
    index = micro.response_positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    logits = torch.gather(logits, 1, index).float()
    return logits / temperature if temperature != 1.0 else logits


def response_values(model: torch.nn.Module, micro: MicroBatch) -> torch.Tensor:
    """Critic values [B, R] at the same positions as `response_logits`: the value of the state
    before each response token."""
    values = model(input_ids=micro.input_ids).logits.squeeze(-1)
    return torch.gather(values, 1, micro.response_positions).float()


def sequence_scores(model: torch.nn.Module, micro: MicroBatch) -> torch.Tensor:
    """A reward model's fp32 score [B] of each whole sequence (prompt and response) of a micro-batch,
    read as the classifier scorer reads it (`rlactors.reward.model_scorer.score_sequences`): the
    model's own pooling, at each row's last token before the right padding."""
    return model(input_ids=micro.input_ids, use_cache=False).logits[:, 0].float()


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Factor on the peak lr at optimizer step `step` (0-based): linear warm-up over
    `warmup_steps`, then constant or cosine decay to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"lr schedule {schedule!r}: allowed values are 'constant', 'cosine'")
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_and_schedule(model: torch.nn.Module, optim_config: OptimConfig
                           ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the model's trainable parameters (all, or a LoRA model's adapters) and its
    learning-rate schedule (`lr_multiplier`)."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=optim_config.lr, betas=optim_config.betas,
                                  eps=optim_config.eps, weight_decay=optim_config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(
        step, optim_config.warmup_steps, optim_config.total_steps, optim_config.lr_schedule,
        optim_config.min_lr_ratio))
    return optimizer, scheduler


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) DTensor; a collective on every rank of its mesh."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def unique_state_items(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of the model's state dict, each shared tensor once (a tied
    lm_head is the embedding: only its first name, `model.embed_tokens.weight`, is yielded)."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield name, tensor


def weight_items(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of the weights an engine or a Hugging Face folder holds: each
    shared tensor once (`unique_state_items`), LoRA adapters merged into the weights they adapt
    (`lora.merged_state_items`; a model without adapters passes through)."""
    return lora.merged_state_items(model, unique_state_items(model))


def gather_whole(named_items, keep: bool, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole tensors of `named_items` as CPU tensors (in `dtype`) where `keep` (rank 0), else {}:
    every rank gathers each tensor in the same order (collectives). For small sets, like an adapter."""
    gathered = {}
    for name, tensor in named_items:
        whole = full_tensor(tensor.detach())
        if keep:
            gathered[name] = whole.to("cpu", dtype=dtype or whole.dtype)
    return gathered


def iter_weight_buckets(model: torch.nn.Module, bucket_bytes: int, keep: bool,
                        dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Gather full tensors one at a time, in the same order on every rank (each gather is a
    collective), and yield buckets of about `bucket_bytes` of CPU tensors where `keep` (rank 0),
    in the checkpoint's names and layout (`rlactors.models.moe.checkpoint_layout`: an MoE layer's
    fused experts become one tensor per expert). Ranks with `keep=False` drop each gathered tensor
    at once and yield nothing; they must still exhaust the iterator. A bucket always holds at least
    one tensor, so a tensor larger than `bucket_bytes` travels alone."""
    split = checkpoint_layout(model)
    bucket: list[tuple[str, torch.Tensor]] = []
    size_bytes = 0
    for name, tensor in weight_items(model):
        whole = full_tensor(tensor.detach())
        if not keep:
            continue
        whole = whole.to("cpu", dtype=dtype or whole.dtype)
        for saved_name, saved in split(name, whole):
            bucket.append((saved_name, saved))
            size_bytes += saved.numel() * saved.element_size()
        if size_bytes >= bucket_bytes:
            yield bucket
            bucket, size_bytes = [], 0
    if bucket:
        yield bucket
