"""What a rollout engine needs of weights beyond vLLM's weight-transfer engines: the rules and the
record of a weight update, vLLM's side of finishing one, the check of an object-store bucket
before its bytes go to vLLM, and the methods vLLM mixes into its workers.

Weight updates go through vLLM's weight-transfer protocol, driven by a sender
(`rlactors.weight_sync`): `init_weight_transfer_engine` once per sender, then per sync
`start_weight_update(policy_version)` (generation pauses in vLLM, if anything is in flight there),
`update_weights` per bucket
(loaded through the model's own `load_weights` inside vLLM's layerwise reload) and
`finish_weight_update(policy_version)` (prefix cache dropped, version label set, generation
resumes). The transport is the engine's `weight_backend` (`rlactors.weight_sync.choice`). With
`partial_rollout` off the pause first lets the requests vLLM runs finish (their tokens are all the
old version); those it still has queued (more than `max_num_seqs`) or preempted are aborted and
restart from the prompt under the new weights. With it on they are aborted and continued under the new weights from prompt + partial
response (`on_abort="resume"`, max_tokens reduced by what was produced; the response then carries
two versions), or restarted from the prompt (`on_abort="requeue"`; `rlactors.rollout.generation`).
Requests arriving during an update (or sleep) wait at the engine's admission gate and enter vLLM
after it. An update that never finishes (its sender died, a bucket failed) leaves `weights_mixed`
set and refuses the next start: such an engine must restart.

A *bucket* of the `object_store` transport is a list of `(name, tensor)` pairs, put into Ray's
object store by the sender (`rlactors.weight_sync.trainer_engines`). Names are those of the
Hugging Face model's `state_dict()` (`model.layers.0.self_attn.q_proj.weight`, ...); tensors may be
in any float dtype (vLLM casts them into its parameters). The engine's own model class maps HF
names onto its fused parameters in `load_weights`, so no name translation happens here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class WeightUpdate:
    """A weight update between the engine's `start_weight_update` and `finish_weight_update`."""

    policy_version: int  # the version it loads
    pause_start_s: float  # perf_counter when generation began to pause for it
    was_asleep: bool  # generation stays paused after it, until wake_up
    paused: bool = True  # vLLM's scheduler was paused for it (requests were in flight): resume it after
    sync_start_s: float = 0.0  # perf_counter once paused (in-flight requests done), when loading began
    weight_bytes: int = 0  # loaded so far

    def timing(self) -> dict:
        """weight_sync_s: start of loading to now; pause_s: the wait for in-flight requests before it."""
        return {"policy_version": self.policy_version, "weight_sync_s": time.perf_counter() - self.sync_start_s,
                "pause_s": self.sync_start_s - self.pause_start_s}


def check_update_start(policy_version: int, loaded_version: int, open_update: WeightUpdate | None) -> None:
    """Raise unless an update to `policy_version` may start: never to weights older than those
    loaded, and never after one that did not finish (vLLM's worker still holds that one open: only
    a fresh engine can take another)."""
    if policy_version < loaded_version:
        raise ValueError(f"policy_version {policy_version} is older than the loaded {loaded_version}")
    if open_update is not None:
        raise RuntimeError(f"the weight update to policy_version {open_update.policy_version} never "
                           "finished: this engine must restart")


async def close_update_in_vllm(vllm, weight_backend: str, policy_version: int) -> None:
    """vLLM's side of finishing an update, through the engine's `VllmCalls` `vllm`
    (`rlactors.rollout.engine_core`): close it, drop the prefix cache (the KV of the old weights)
    and label later tokens `policy_version`. Generation stays paused."""
    llm = vllm.llm
    await vllm("finish_weight_update", llm.finish_weight_update())
    if weight_backend in ("nccl", "ipc"):  # vLLM's own engines do not re-process a tied output head
        await vllm("finish_weight_update", llm.collective_rpc("rlactors_refresh_tied_head"))
    await vllm("finish_weight_update", llm.reset_prefix_cache())
    await vllm("finish_weight_update", llm.update_weight_version(str(policy_version)))


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


async def vllm_update_info(update_info: dict) -> dict:
    """The update info handed to vLLM: the object_store transport's `{"bucket": bucket or its ref}`
    becomes our engine's inline bytes (`inline_update_info`), fetched and checked here; the info of
    any other backend passes unchanged."""
    import ray  # here: vLLM's worker processes import this module for `WorkerExtension` alone

    if "bucket" not in update_info:
        return update_info
    bucket = update_info["bucket"]
    named_tensors = check_bucket(await bucket if isinstance(bucket, ray.ObjectRef) else bucket)
    return inline_update_info(named_tensors, bool(update_info.get("digest")))


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

    def rlactors_start_routing_capture(self) -> list[int]:
        """Record the experts each token is routed to (`rlactors.rollout.routing_capture`), once;
        returns [layers, top_k]."""
        from rlactors.rollout.routing_capture import RoutingCapture

        if getattr(self, "_rlactors_routing", None) is None:
            self._rlactors_routing = RoutingCapture(self.model_runner)
        return list(self._rlactors_routing.shape_per_token)

    def rlactors_take_routing(self, request_ids: list[str]) -> dict[str, tuple[bytes, list[int]]]:
        """The recorded routing of these finished requests (by their ids in the engine actor)."""
        return self._rlactors_routing.take(request_ids)

    def rlactors_start_peak_memory(self) -> None:
        from rlactors.runtime.phases import start_peak_memory

        self._rlactors_memory_baseline = start_peak_memory()

    def rlactors_peak_extra_bytes(self) -> dict[str, int]:
        from rlactors.runtime.phases import peak_extra_bytes

        return peak_extra_bytes(self._rlactors_memory_baseline)

