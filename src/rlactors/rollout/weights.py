"""What a rollout engine needs of weights beyond vLLM's weight-transfer engines: the check of an
object-store bucket before its bytes go to vLLM, and the methods vLLM mixes into its workers.

A *bucket* of the `object_store` transport is a list of `(name, tensor)` pairs, put into Ray's
object store by the sender (`rlactors.weight_sync.trainer_engines`). Names are those of the
Hugging Face model's `state_dict()` (`model.layers.0.self_attn.q_proj.weight`, ...); tensors may be
in any float dtype (vLLM casts them into its parameters). The engine's own model class maps HF
names onto its fused parameters in `load_weights`, so no name translation happens here.
"""

from __future__ import annotations

import torch


def check_bucket(bucket: object) -> list[tuple[str, torch.Tensor]]:
    """Validate one bucket; returns it as CPU-contiguous (name, tensor) pairs."""
    if not isinstance(bucket, list | tuple):
        raise TypeError(f"weight bucket: expected a list of (name, tensor), got {type(bucket).__name__}")
    checked = []
    for item_index, item in enumerate(bucket):
        if not (isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"weight bucket, item {item_index}: expected a (name, tensor) pair")
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight bucket, {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"weight bucket, {name!r}: expected a float tensor, got {tensor.dtype}")
        checked.append((name, tensor.detach().to("cpu").contiguous()))
    return checked


def inline_update_info(named_tensors: list[tuple[str, torch.Tensor]], digest: bool) -> dict:
    """The `update_weights` info of our vLLM engine that carries the bytes themselves: vLLM's
    utility channel (msgpack) would turn tensors into nested lists, so they cross as raw bytes plus
    dtype and shape (one memcpy a side; bfloat16 survives, which numpy lacks)."""
    return {
        "names": [name for name, _ in named_tensors],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
        "data": [t.contiguous().view(torch.uint8).numpy().tobytes() for _, t in named_tensors],
        "digest": digest,
    }


class WorkerExtension:
    """Methods vLLM mixes into its worker class (engine arg `worker_extension_cls`), called by name
    through `collective_rpc` (a pickled callable does not survive vLLM's multiprocess executor)."""

    def rlactors_memory(self) -> dict[str, int]:
        """This worker process's memory (`rlactors.runtime.phases.memory_figures`), for the engine's phase log."""
        from rlactors.runtime.phases import memory_figures

        return memory_figures()

    def rlactors_weight_checksums(self) -> dict[str, str]:
        """sha256 of every parameter's bytes as this worker holds them, named `rank<r>:<name>`
        (vLLM 0.32's `compute_weight_checksums` does the same; older ones lack it)."""
        from rlactors.weight_sync.vllm_engine import digest

        model = self.model_runner.get_model()
        return {f"rank{self.rank}:{name}": digest(parameter) for name, parameter in model.named_parameters()}

    def rlactors_shutdown_weight_transfer(self) -> None:
        """Release the weight-transfer engine's connection to its sender (vLLM 0.32's
        `shutdown_weight_transfer_engine`; older ones lack it). The engine actor never calls it
        with an update open."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.shutdown()

    def rlactors_received_digests(self) -> dict[str, str]:
        """sha256 per tensor of the last update that asked for digests (our backend only)."""
        return dict(getattr(self.weight_transfer_engine, "received_digests", {}))

    def rlactors_refresh_tied_head(self) -> None:
        """After vLLM's own engines (nccl, ipc), which do not re-process a tied output head."""
        from rlactors.weight_sync.vllm_engine import refresh_tied_head

        refresh_tied_head(self.model_runner.get_model())

    def rlactors_start_peak_memory(self) -> None:
        from rlactors.runtime.phases import start_peak_memory

        self._rlactors_memory_baseline = start_peak_memory()

    def rlactors_peak_extra_bytes(self) -> dict[str, int]:
        from rlactors.runtime.phases import peak_extra_bytes

        return peak_extra_bytes(self._rlactors_memory_baseline)

