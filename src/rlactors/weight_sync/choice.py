"""Which weight transport a run uses, and the per-engine details of vLLM's NCCL rendezvous (pure).

| transport      | runs where                                   | bytes travel                          |
|----------------|----------------------------------------------|---------------------------------------|
| `nccl`         | GPU, trainer and engines on separate devices  | broadcast from trainer rank 0 over NCCL (RCCL on ROCm) |
| `ipc`          | GPU, colocated (engines on the trainer's GPUs) | CUDA IPC handles: no copy through the host |
| `shm`          | every engine on trainer rank 0's node        | two shared-memory segments, filled in turn |
| `object_store` | anywhere (the portable fallback)             | Ray's object store, one bucket at a time |

`auto` picks `ipc` for colocated GPUs, `nccl` for separate GPU pools, `shm` on CPU when every
engine shares rank 0's node and `object_store` otherwise. Where the installed vLLM lacks the
trainer-side engine of `ipc` or `nccl` (vLLM 0.27 has no `nccl` one), `auto` takes `shm` or
`object_store` as on CPU (both load through the model's own `load_weights` on any device).
Each vLLM engine is started with the weight-transfer backend of its transport (`vllm_backend`);
`shm` and `object_store` share one backend of ours (`rlactors.weight_sync.vllm_engine`), which
vLLM loads through our plugin.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

TRANSPORTS = ("auto", "nccl", "ipc", "shm", "object_store")
RLACTORS_BACKEND = "rlactors"  # our vLLM-side engine: shared-memory segments or bytes inline
VLLM_BACKENDS = ("ipc", "nccl")  # transports that are vLLM's own engines, on both sides


@dataclass(frozen=True)
class TransportChoice:
    transport: str  # nccl | ipc | shm | object_store
    reason: str  # one line for the run's log: why this transport

    @property
    def vllm_backend(self) -> str:
        """The `weight_transfer_config.backend` the engines start with."""
        return self.transport if self.transport in ("nccl", "ipc") else RLACTORS_BACKEND


def choose_transport(requested: str, device_kind: str, colocated: bool, engines_on_sender_node: bool,
                     vllm_trainer_backends: Collection[str] = VLLM_BACKENDS) -> TransportChoice:
    """The transport for `rollout.weight_transport` = `requested`. `device_kind` is the run's
    ("gpu" or "cpu", `ClusterShape.device_kind`); `engines_on_sender_node` says whether every
    engine runs on the node of trainer rank 0 (which sends); `vllm_trainer_backends` are the
    trainer-side engines of the installed vLLM (`VllmFeatures.trainer_backends`: vLLM 0.27 has
    `ipc` only). A request that cannot work raises ValueError naming the field."""
    if requested not in TRANSPORTS:
        raise ValueError(f"rollout.weight_transport: {requested!r} is not one of {list(TRANSPORTS)}")
    gpu = device_kind == "gpu"
    if requested in ("nccl", "ipc") and not gpu:
        raise ValueError(f"rollout.weight_transport: {requested} needs GPUs, and this run has none; "
                         "use shm or object_store (or auto)")
    if requested == "nccl" and colocated:
        raise ValueError("rollout.weight_transport: nccl needs the engines on other GPUs than the trainer (one NCCL "
                         "rank per GPU), and colocated runs share them; use ipc (or auto)")
    if requested == "ipc" and not colocated:
        raise ValueError("rollout.weight_transport: ipc shares GPU memory, so the engines must be colocated with the "
                         "trainer (pipeline.mode colocated); use nccl for separate device pools")
    if requested == "shm" and not engines_on_sender_node:
        raise ValueError("rollout.weight_transport: shm needs every engine on trainer rank 0's node, and the plan puts "
                         "some elsewhere; use object_store (or auto)")
    if requested in VLLM_BACKENDS and requested not in vllm_trainer_backends:
        raise ValueError(f"rollout.weight_transport: {requested} needs vLLM's trainer-side {requested} engine, which "
                         "the installed vLLM lacks; use object_store (or auto)")
    if requested != "auto":
        return TransportChoice(requested, f"rollout.weight_transport={requested}")
    if gpu:
        wanted = "ipc" if colocated else "nccl"
        if wanted in vllm_trainer_backends:
            return TransportChoice(wanted, "auto: colocated GPUs share memory through CUDA IPC" if colocated
                                   else "auto: separate GPU pools, broadcast from trainer rank 0")
        fallback = "shm" if engines_on_sender_node else "object_store"
        return TransportChoice(fallback, f"auto: the installed vLLM has no trainer-side {wanted} engine, so "
                                         f"{fallback} ({'every engine on' if engines_on_sender_node else 'some engine off'}"
                                         " trainer rank 0's node)")
    if engines_on_sender_node:
        return TransportChoice("shm", "auto: CPU, every engine on trainer rank 0's node")
    return TransportChoice("object_store", "auto: CPU, some engine on another node than trainer rank 0")


def choose_for_plan(requested: str, plan, num_engines: int, colocated: bool) -> TransportChoice:
    """`choose_transport` for a `rlactors.placement.plan.ResourcePlan`: the sender is actor rank 0.
    On GPUs it reads the installed vLLM's trainer-side engines (which imports part of vLLM); where
    vLLM is not installed (planning from a laptop) it assumes vLLM 0.32's, and the run, on the
    cluster, decides with the cluster's."""
    sender_node = plan.bundle_of("actor", 0)[0].node
    engine_nodes = {bundle.node for engine in range(num_engines) for bundle in plan.engine_bundles(engine)}
    backends = VLLM_BACKENDS
    if plan.cluster.device_kind == "gpu":
        from rlactors.runtime.vllm_features import trainer_backends

        installed = trainer_backends()
        backends = VLLM_BACKENDS if installed is None else installed
    return choose_transport(requested, plan.cluster.device_kind, colocated, engine_nodes <= {sender_node}, backends)


@dataclass(frozen=True)
class WeightSyncSettings:
    """What every sync of a run uses (a `rlactors.weight_sync.sender.WeightSender` argument)."""

    transport: str  # nccl | ipc | shm | object_store (resolved: `choose_transport`)
    bucket_bytes: int
    dtype: str | None  # the engines' dtype, which tensors travel in (None: asked of the first engine)
    call_timeout_s: float
    workers_per_engine: int = 1  # tensor-parallel workers of each engine (NCCL ranks)
    verify: bool = False
    adapter_dir: str | None = None  # a LoRA run's adapter-only syncs write here (`rlactors.weight_sync.adapters`)


def nccl_world_size(num_engines: int, workers_per_engine: int) -> int:
    """Trainer rank 0 plus every worker of every engine."""
    return 1 + num_engines * workers_per_engine


def nccl_engine_init_info(init_info: dict, engine_position: int, workers_per_engine: int) -> dict:
    """The NCCL init info for the `engine_position`-th engine of a sync. vLLM's trainer engine sends
    every engine the same info (rank_offset 1), written for one engine of several data-parallel
    ranks; each of our engines is its own vLLM instance at data-parallel index 0, so its workers
    would all claim ranks 1.. . Each engine instead starts after the workers of the engines before it."""
    return {**init_info, "rank_offset": 1 + engine_position * workers_per_engine}
