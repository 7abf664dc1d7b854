"""Mixture-of-experts models: the one mapping between the trainer's layout and the checkpoint's,
and what a config says about its experts.

transformers holds each MoE layer's experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]); its checkpoints, and so vLLM's loader, name one tensor per expert
(`mlp.experts.{e}.gate_proj.weight`, ...). Everything that hands the trainer's weights to something
that reads checkpoints (a weight sync, an HF export, an export from a DCP checkpoint) goes through
`checkpoint_layout`, which is transformers' own reverse conversion (`revert_weight_conversion`, the
one `save_pretrained` uses) applied one whole tensor at a time. A dense model maps to itself.

    split = checkpoint_layout(model)          # model: live, FSDP-wrapped or on the meta device
    for name, whole in gathered_tensors:
        for saved_name, saved in split(name, whole): ...

Invariant: `split` of every tensor of a model, written to safetensors, is the folder
`save_pretrained` writes; loading it back gives the fused tensors bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Split = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


def identity_split(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor)]


def checkpoint_layout(model: torch.nn.Module) -> Split:
    """`split(name, whole_tensor)` -> the (checkpoint name, tensor) pairs that tensor is saved as.

    Only names under a fused-experts module are converted: everything else keeps its name and
    tensor, so a dense model (or a layer's attention) pays nothing."""
    if not is_moe_config(getattr(model, "config", None)):
        return identity_split
    from transformers.core_model_loading import revert_weight_conversion

    def split(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if ".experts." not in name:
            return [(name, tensor)]
        return list(revert_weight_conversion(model, {name: tensor}).items())

    return split


def folder_checkpoint_layout(model_path) -> Split:
    """`checkpoint_layout` of the model a folder's config.json describes, built on the meta device
    (nothing allocated): for tensors read from a trainer checkpoint, with no live model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path), local_files_only=True)
    if not is_moe_config(config):
        return identity_split
    with torch.device("meta"):
        return checkpoint_layout(AutoModelForCausalLM.from_config(config))


def checkpoint_shapes(split: Split, name: str, shape: tuple[int, ...], dtype: torch.dtype
                      ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(checkpoint name, dtype, shape) of what `split` makes of a tensor of `shape`, computed on
    the meta device: a weight sync's metadata without gathering anything."""
    return [(saved_name, dtype, tuple(saved.shape))
            for saved_name, saved in split(name, torch.empty(shape, dtype=dtype, device="meta"))]


def is_moe_config(config) -> bool:
    """Whether a transformers config (or its config.json as a dict) routes tokens to experts
    (Qwen2/3-MoE and most other MoE configs name the routed expert count `num_experts` or
    `num_local_experts`)."""
    return num_experts(config) > 0


def num_experts(config) -> int:
    return int(_text_field(config, "num_experts") or _text_field(config, "num_local_experts") or 0)


def num_experts_per_token(config) -> int:
    return int(_text_field(config, "num_experts_per_tok") or 0)


def _text_field(config, name: str):
    """A field of the language model's config (a multimodal config nests it as `text_config`)."""
    read = (lambda c, key: c.get(key)) if isinstance(config, dict) else (lambda c, key: getattr(c, key, None))
    text = read(config, "text_config") or config
    return read(text, name) if text is not None else None


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters one token passes through: all, less the experts it is not routed to (a routed
    expert's tensors, fused or one per expert, count top_k / num_experts of themselves; shared
    experts and the router count whole)."""
    config = getattr(model, "config", None)
    total_experts, routed = num_experts(config), num_experts_per_token(config)
    count = 0
    for name, parameter in model.named_parameters():
        if total_experts and ".experts." in name:
            count += parameter.numel() * routed // total_experts
        else:
            count += parameter.numel()
    return count
