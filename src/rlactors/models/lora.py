"""LoRA adapters on the actor (`model.lora`), through peft, on a model FSDP2 then shards.

    model = fsdp.load_role_model(path, "actor", seed)
    add_adapters(model, config.model.lora)      # before sharding: the base frozen, the adapters trainable
    with base_only(model): ...                  # the reference policy: every adapter switched off
    with without_dropout(model): ...            # logprob passes: the policy's own logprobs
    merged_state_items(model)                   # (HF name, W + scaling * B @ A): a full sync's tensors
    adapter_state_items(model)                  # (peft name, A or B): the adapter alone
    save_adapter(folder, tensors, config)       # a peft adapter folder (adapter_config.json + safetensors)

The model stays the Hugging Face class (peft's `inject_adapter_in_model`, no `PeftModel` around
it), so sharding, forward passes and checkpoints treat it as any other. In memory an adapted layer
`q_proj` holds `q_proj.base_layer.weight` and `q_proj.lora_A.default.weight` /
`q_proj.lora_B.default.weight`; outside the trainer the base keeps its own names (`q_proj.weight`)
and the adapter takes peft's saved names (`base_model.model.<path>.lora_A.weight`).

Under FSDP2 every tensor here is a DTensor sharded on dim 0: the merge `W + s * B @ A` is computed
shard-wise (the small A is gathered), so nothing is gathered whole before the sender's own gather.
Every function iterates the same tensors in the same order on every rank (the gathers are collectives).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from rlactors.config import LoraConfig

ADAPTER = "default"  # peft's name for the one adapter a model holds here
ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_FOLDER = "adapter"  # a LoRA run's Hugging Face export: the merged model, and its adapter in here


def peft_config(config: LoraConfig, base_model_path: str | None = None):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                          target_modules=config.target_modules, bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=base_model_path)


def add_adapters(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """Put adapters on `model` in place (peft's own LoRA layers; B starts at zero, so the adapted
    model is the base model until it trains) and freeze everything else. A target that matches no
    layer is an error naming it (peft's own message names the patterns)."""
    from peft import inject_adapter_in_model

    try:
        model = inject_adapter_in_model(peft_config(config), model)
    except ValueError as error:
        raise ValueError(f"model.lora.target_modules={config.target_modules!r}: {error}") from error
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_" in name)
    return model


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module path -> peft LoRA layer (`q_proj` and the like), in module order."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def has_adapters(model: torch.nn.Module) -> bool:
    return bool(lora_layers(model))


@contextlib.contextmanager
def base_only(model: torch.nn.Module):
    """Every adapter off within: the model computes as its frozen base (the reference policy).
    The flag peft's layers read in forward is set directly: peft's `enable_adapters` also flips
    `requires_grad`, and under FSDP2, where a layer may hold unsharded views between passes, it
    could not flip it back (the adapters would leave training and the checkpoint)."""
    layers = lora_layers(model).values()
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


@contextlib.contextmanager
def without_dropout(model: torch.nn.Module):
    """The adapters' dropout off within (a logprob pass must compute the policy itself)."""
    dropouts = [module for layer in lora_layers(model).values() for module in layer.lora_dropout.values()
                if module.training]
    for module in dropouts:
        module.eval()
    try:
        yield
    finally:
        for module in dropouts:
            module.train()


def merged_state_items(model: torch.nn.Module, named_items) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_items` (the model's (name, tensor) pairs, e.g. `fsdp.unique_state_items(model)`) with
    each adapted weight merged, `W + scaling * B @ A`, under the base's own name; the adapters'
    own tensors are left out. A model without adapters passes through unchanged."""
    layers = lora_layers(model)
    for name, tensor in named_items:
        if ".lora_" in name:
            continue
        path, adapted_layer, leaf = name.rpartition(".base_layer.")
        if not adapted_layer:
            yield name, tensor
            continue
        if leaf == "weight":
            layer = layers[path]
            a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
            tensor = tensor.detach() + layer.scaling[ADAPTER] * (b.detach() @ a.detach())
        yield f"{path}.{leaf}", tensor


def adapter_state_items(model: torch.nn.Module, named_items) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters' tensors of `named_items`, under the names peft saves them with."""
    for name, tensor in named_items:
        if ".lora_" in name:
            yield peft_name(name), tensor


def peft_name(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (peft's saved name)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def save_adapter(folder: str | Path, tensors: dict[str, torch.Tensor], config: LoraConfig,
                 base_model_path: str | None = None) -> Path:
    """Write a peft adapter folder: `adapter_config.json` (peft's own) and
    `adapter_model.safetensors` holding `tensors` (peft names, whole CPU tensors). vLLM's
    `LoRARequest` and peft's `PeftModel.from_pretrained` both read it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    peft_config(config, base_model_path).save_pretrained(str(folder))
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(folder / ADAPTER_WEIGHTS_FILE))
    return folder


def adapter_digest(folder: str | Path) -> str:
    """sha256 of an adapter folder's tensors file, as this node reads it (a sync's `verify`)."""
    import hashlib

    return hashlib.sha256((Path(folder) / ADAPTER_WEIGHTS_FILE).read_bytes()).hexdigest()
