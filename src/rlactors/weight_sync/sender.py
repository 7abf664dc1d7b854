"""`WeightSender`: one trainer rank's side of every weight sync, over any transport.

    sender = WeightSender(rank=0)
    stats = sender.send(lambda: model.state_dict().items(), engines, policy_version=3, settings=settings,
                        split=checkpoint_layout(model))

`engines` maps each replica index to (RolloutEngine handle, incarnation); `settings` is a
`WeightSyncSettings`. The first sync, and any sync whose engines, incarnations or settings differ
from the last one's, builds the trainer engine anew through vLLM's `WeightTransferTrainerFactory`
(`trainer_init`: for NCCL a rendezvous, for shm fresh segments); the others reuse it. Every rank
of the trainer calls `send` with the same arguments (the gathers are collectives); rank 0 sends
and returns the sync's figures, the other ranks return None.

Verification (`settings.verify`, for tests and on demand): the engines keep the sha256 of each
tensor they received, and rank 0 compares them with what it sent; an engine with a difference is
reported in `failed`, naming the tensor, like one that died (the driver restarts it). Only our
transports keep digests (shm, object_store); with vLLM's `nccl` and `ipc` engines nothing is
compared, and the engines' `weight_checksums()` can be compared with each other instead.

Engine failures do not raise here: an engine that fails leaves the sync and is named in the
figures' `failed` (with no engine left, or a broken NCCL collective, every one is) and the driver
restarts it; `synced` lists the engines that hold the new weights, `actor_died` the failed ones
whose actor died (Ray restarts those; the others are killed first). Only a failure of the trainer
side raises. Limits of vLLM's `nccl` and `ipc` trainer engines, which this wraps as they are: an
engine that dies mid-broadcast leaves rank 0 in the broadcast until the trainer's call bound
(`trainer.call_timeout_s`) ends the run, and a sync that breaks off on rank 0 leaves a multi-rank
trainer's other ranks in their gathers (ours join the gathers before they report).
"""

from __future__ import annotations

import time

import torch

from rlactors.models.moe import Split, identity_split
from rlactors.runtime.phases import peak_extra_bytes, start_peak_memory
from rlactors.weight_sync.choice import WeightSyncSettings, nccl_world_size
from rlactors.weight_sync.client import EngineSyncClient, WeightSyncError
from rlactors.weight_sync.layout import segment_bytes_for
from rlactors.weight_sync.source import NamedTensorSource
from rlactors.weight_sync.trainer_engines import (
    ObjectStoreInitInfo,
    SharedMemoryInitInfo,
    register_trainer_engines,
)


class WeightSender:
    def __init__(self, rank: int):
        self.rank = rank
        self.engine = None
        self.client: EngineSyncClient | None = None
        self._key = None
        self.num_inits = 0

    def send(self, named_tensors, engines: dict[int, tuple[object, int]], policy_version: int,
             settings: WeightSyncSettings, split: Split = identity_split) -> dict | None:
        """`split`: each whole tensor to the checkpoint tensors vLLM's loader reads
        (`rlactors.models.moe.checkpoint_layout`; dense models keep their names)."""
        key = (tuple(sorted((index, incarnation) for index, (_, incarnation) in engines.items())), settings)
        if not engines:  # every engine is reviving: each gets the weights when it is back
            return None if self.rank else {"transport": settings.transport, "policy_version": policy_version,
                                           "weight_sync_s": 0.0, "weight_bytes": 0, "synced": [], "failed": {}}
        start = time.perf_counter()
        baseline = start_peak_memory()
        init_s, sending, broke_off = 0.0, False, None
        try:
            if key != self._key:
                self._key = None
                self._init(named_tensors, {index: handle for index, (handle, _) in engines.items()}, settings,
                           policy_version, split)
                self._key = key
            else:
                self.source.use(named_tensors)  # the trainer engine reads this sync's tensors
                if self.rank == 0:
                    self.client.begin(policy_version)
            init_s = time.perf_counter() - start
            sending = True
            self.engine.send_weights()
        except WeightSyncError as error:
            # The sync reached no engine, or NCCL's collective broke: the driver's to handle (each
            # engine is reported failed), not a trainer failure. The other ranks are in the gathers,
            # or done with them: our engines join them all when a send breaks off; before a send
            # started, one pass does. (vLLM's nccl and ipc engines do not: see the module docstring.)
            self._key, broke_off = None, str(error)
            if not sending:
                for _ in self.source:
                    pass
        except BaseException:
            self._key = None  # whatever broke, the next sync starts the transport afresh
            raise
        if self.rank != 0:
            return None
        if settings.verify and broke_off is None and self.client.live:
            self._verify()
        synced = [] if broke_off is not None else sorted(set(self.client.live) & set(engines))
        failed = {index: (self.client.failed.get(index) if self.client is not None else None) or broke_off
                  for index in engines if index not in synced}
        elapsed = time.perf_counter() - start
        num_bytes = getattr(self.engine, "num_bytes", None) or self._metadata_bytes()
        return {
            "transport": settings.transport,
            "policy_version": policy_version,
            "weight_sync_s": elapsed,
            "init_s": init_s,
            "weight_bytes": num_bytes,
            "bytes_per_s": num_bytes / max(elapsed, 1e-9),
            "num_buckets": len(getattr(self.engine, "buckets", ())) or None,
            "num_tensors": len(self.source.metadata()),
            "peak_extra_bytes": peak_extra_bytes(baseline),
            "synced": synced,
            "failed": failed,
            "actor_died": sorted(self.client.actor_died & set(failed)) if self.client is not None else [],
        }

    def _init(self, named_tensors, handles: dict, settings: WeightSyncSettings, policy_version: int,
              split: Split) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        register_trainer_engines()
        if self.rank == 0 and self.client is not None and self.client.transport == "nccl":
            # The engines of the last group leave it before a new one forms (each holds a
            # communicator); best effort: an engine of it that died holds nothing.
            self.client.begin(policy_version)
            try:
                self.client.call("shutdown_weight_transfer")
            except WeightSyncError:
                pass
        self.shutdown()
        self.client = None
        dtype = settings.dtype or engine_dtype(handles, settings.call_timeout_s)
        self.source = NamedTensorSource(named_tensors, getattr(torch, dtype), split)
        self.client = EngineSyncClient(handles, settings.transport, settings.call_timeout_s, settings.workers_per_engine)
        self.client.begin(policy_version)
        self.engine = WeightTransferTrainerFactory.trainer_init(
            self._init_info(settings, len(handles)), client=self.client, source=self.source)
        self.num_inits += 1

    def _init_info(self, settings: WeightSyncSettings, num_engines: int):
        if settings.transport == "shm":
            return SharedMemoryInitInfo(rank=self.rank, bucket_bytes=settings.bucket_bytes, digest=settings.verify)
        if settings.transport == "object_store":
            return ObjectStoreInitInfo(rank=self.rank, bucket_bytes=settings.bucket_bytes, digest=settings.verify)
        if settings.transport == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            return IPCTrainerInitInfo(rank=self.rank, packed=True, packed_buffer_size_bytes=self._buffer_bytes(settings))
        if settings.transport == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            address, port = rendezvous_address() if self.rank == 0 else ("", 0)
            return NCCLTrainerInitInfo(rank=self.rank, master_address=address, master_port=port,
                                       world_size=nccl_world_size(num_engines, settings.workers_per_engine),
                                       packed=True, packed_buffer_size_bytes=self._buffer_bytes(settings))
        raise ValueError(f"unknown weight transport {settings.transport!r}")

    def _buffer_bytes(self, settings: WeightSyncSettings) -> int:
        """vLLM's packed buffers must hold the largest tensor (an embedding often outgrows a bucket)."""
        return segment_bytes_for([(m.name, m.dtype, m.shape) for m in self.source.metadata()], settings.bucket_bytes)

    def _verify(self) -> None:
        sent = getattr(self.engine, "sent_digests", None)
        if not sent:
            return  # vLLM's engines keep none
        for index, received in self.client.call("received_digests").items():
            missing = sorted(set(sent) - set(received))
            wrong = sorted(name for name in sent if name in received and received[name] != sent[name])
            if missing or wrong:  # the engine holds weights nobody sent: it fails like one that died
                self.client.failed[index] = "verify: " + "; ".join(
                    ([f"{len(wrong)} tensor(s) differ from what was sent, first {wrong[0]!r}"] if wrong else [])
                    + ([f"{len(missing)} never arrived, first {missing[0]!r}"] if missing else []))
                self.client.live.remove(index)

    def _metadata_bytes(self) -> int:
        return sum(meta.dtype.itemsize * torch.Size(meta.shape).numel() for meta in self.source.metadata())

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = None
        self._key = None


def engine_dtype(handles: dict, timeout_s: float) -> str:
    """The dtype of the first engine that answers (they all run the same model). One that does not
    answer is left to the sync, which names it in `failed`; with none answering nothing is sent,
    and the dtype does not matter."""
    import ray

    for index in sorted(handles):
        try:
            return ray.get(handles[index].health.remote(), timeout=timeout_s)["dtype"]
        except (ray.exceptions.RayError, TimeoutError):
            continue
    return "float32"


def rendezvous_address() -> tuple[str, int]:
    """This node's IP and a free port, for the NCCL group's TCP store."""
    import socket

    import ray

    address = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    with socket.socket() as probe:
        probe.bind(("", 0))
        return address, probe.getsockname()[1]


