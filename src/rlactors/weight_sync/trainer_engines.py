"""Trainer-side engines of our two transports, registered with vLLM's `WeightTransferTrainerFactory`
beside its `nccl` and `ipc` ones, so a trainer rank drives every transport the same way:
`trainer_init(init_info, client=..., source=...)` once, `send_weights()` per sync.

- `rlactors_shm`: two shared-memory segment files (in /dev/shm when it has room), mapped by every
  engine at init and unlinked right after, so nothing is left if a process dies. Bucket k is
  written into segment k % 2 while the engines load bucket k - 1 from the other: the trainer waits
  for bucket k - 2's load (same segment) before writing. Extra memory: the two segments.
- `rlactors_object_store`: each bucket is `ray.put` by rank 0 and its ref sent; the engine actor
  fetches it and passes the bytes to its vLLM worker. One bucket is in flight while the next is
  gathered, and each is dropped once loaded: no copy of the model stays in the object store.

Every rank calls `send_weights` (each gather is a collective); only the sender (rank 0) talks to
the engines, through the client (`rlactors.weight_sync.client.EngineSyncClient`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from rlactors.weight_sync.layout import Entry, bucket_info, plan_buckets, segment_bytes_for, views
from rlactors.weight_sync.vllm_engine import digest

NUM_SEGMENTS = 2
SHM_FOLDER = "/dev/shm"


@dataclass
class SharedMemoryInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "rlactors_shm"
    bucket_bytes: int = 64 << 20
    digest: bool = False  # keep the sha256 of every tensor sent, for `received_digests` to match


@dataclass
class ObjectStoreInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "rlactors_object_store"
    bucket_bytes: int = 64 << 20
    digest: bool = False


class Pipeline:
    """At most one update in flight: `submit` waits for the previous one (raising its error) before
    sending the next, so the caller can prepare bucket k + 1 while the engines load bucket k.
    `start` (the engines' `start_weight_update`, which pauses their generation) runs once, at the
    first `submit` or `wait`: the first bucket is gathered and packed while the engines still
    generate, so they pause for the loads, not for the gathers too (a model of one bucket: only
    for its load)."""

    def __init__(self, send, start=None):
        self._send, self._start = send, start
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        self._pending: Future | None = None

    def _started(self) -> None:
        start, self._start = self._start, None
        if start is not None:
            start()

    def submit(self, update_info: dict) -> None:
        self._started()
        self.wait()
        self._pending = self._executor.submit(self._send, update_info)

    def wait(self) -> None:
        self._started()  # a sync with nothing to send still opens (and then closes) the update
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        # A failed send leaves no thread behind to join: the client's calls are bounded.
        self._executor.shutdown(wait=False)


class _BucketedEngine(TrainerWeightTransferEngine):
    """What both of ours share: the layout from the source's metadata, and the digests."""

    def __init__(self, *, client, source, is_sender: bool, bucket_bytes: int, keep_digests: bool):
        super().__init__(client=client, source=source, is_sender=is_sender)
        metas = [(m.name, m.dtype, m.shape) for m in source.metadata()]
        self.segment_bytes = segment_bytes_for(metas, bucket_bytes)
        self.buckets: list[list[Entry]] = plan_buckets(metas, self.segment_bytes)
        self.keep_digests = keep_digests
        self.sent_digests: dict[str, str] = {}
        self.num_bytes = sum(entry.num_bytes for bucket in self.buckets for entry in bucket)

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None:
            raise ValueError(f"the {init_info.backend} weight transport needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     bucket_bytes=init_info.bucket_bytes, keep_digests=init_info.digest)
        if engine.is_sender:
            engine._open()  # the sender's side of init_weight_transfer_engine
        return engine

    def _gathered(self):
        """(bucket index, entry, tensor) in source order, checked against the layout."""
        entries = [(index, entry) for index, bucket in enumerate(self.buckets) for entry in bucket]
        count = 0
        for name, tensor in self.source:
            if count >= len(entries) or entries[count][1].name != name:
                expected = entries[count][1].name if count < len(entries) else "nothing more"
                raise ValueError(f"weight source yielded {name!r} where its metadata put {expected!r}")
            index, entry = entries[count]
            if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                raise ValueError(f"weight {name!r}: metadata said {entry.dtype} {entry.shape}, "
                                 f"the gather gave {tensor.dtype} {tuple(tensor.shape)}")
            count += 1
            yield index, entry, tensor
        if count != len(entries):
            raise ValueError(f"weight source yielded {count} tensors, its metadata {len(entries)}")

    def send_weights(self) -> None:
        if not self.is_sender:
            for _ in self.source:  # join each gather
                pass
            return
        self.sent_digests = {}
        pipeline = Pipeline(self.client.update_weights, start=self.client.start_weight_update)
        gathered = self._gathered()
        try:
            self._send_buckets(pipeline, gathered)
            pipeline.wait()
        except BaseException:
            for _ in gathered:  # the other ranks wait in the remaining gathers: join them, then raise
                pass
            raise
        finally:
            pipeline.close()
        self.client.finish_weight_update()

    def _note(self, name: str, tensor: torch.Tensor) -> None:
        if self.keep_digests:
            self.sent_digests[name] = digest(tensor)


class SharedMemoryTrainerEngine(_BucketedEngine):
    init_info_cls = SharedMemoryInitInfo

    def _open(self) -> None:
        folder = segment_folder(NUM_SEGMENTS * self.segment_bytes)
        paths = [os.path.join(folder, f"rlactors-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}-{k}")
                 for k in range(NUM_SEGMENTS)]
        try:
            self.segments = [torch.from_file(path, shared=True, size=self.segment_bytes, dtype=torch.uint8)
                             for path in paths]
            self.client.init_weight_transfer_engine({"segment_paths": paths, "segment_bytes": self.segment_bytes})
        finally:
            for path in paths:  # mapped by every engine that answered; nothing to leak from here on
                if os.path.exists(path):
                    os.unlink(path)

    def _send_buckets(self, pipeline: Pipeline, gathered) -> None:
        current, filled = None, None
        for index, entry, tensor in gathered:
            if index != current:
                if filled is not None:
                    # Waits for bucket index - 2's load first: its segment is the one written next.
                    pipeline.submit(filled)
                current = index
                filled = {**bucket_info(self.buckets[index]), "segment": index % NUM_SEGMENTS,
                          "digest": self.keep_digests}
                targets = dict(views(self.segments[index % NUM_SEGMENTS], filled))
            targets[entry.name].copy_(tensor)
            self._note(entry.name, targets[entry.name])
        if filled is not None:
            pipeline.submit(filled)

    def shutdown(self) -> None:
        self.segments = []


class ObjectStoreTrainerEngine(_BucketedEngine):
    init_info_cls = ObjectStoreInitInfo

    def _open(self) -> None:
        self.client.init_weight_transfer_engine({})  # nothing to set up: the buckets travel by ref

    def _send_buckets(self, pipeline: Pipeline, gathered) -> None:
        import ray

        current, bucket = None, []
        for index, entry, tensor in gathered:
            if index != current and bucket:
                pipeline.submit({"bucket": ray.put(bucket), "digest": self.keep_digests})
                bucket = []
            current = index
            tensor = tensor.to("cpu").contiguous()
            bucket.append((entry.name, tensor))
            self._note(entry.name, tensor)
        if bucket:
            pipeline.submit({"bucket": ray.put(bucket), "digest": self.keep_digests})


def segment_folder(num_bytes: int) -> str:
    """/dev/shm when it has room for the segments (containers often give it 64 MB), else the temp dir."""
    if os.path.isdir(SHM_FOLDER) and shutil.disk_usage(SHM_FOLDER).free > num_bytes + (64 << 20):
        return SHM_FOLDER
    return tempfile.gettempdir()


def register_trainer_engines() -> None:
    """Add ours to vLLM's trainer-side registry (once per process)."""
    for name, engine in (("rlactors_shm", SharedMemoryTrainerEngine), ("rlactors_object_store", ObjectStoreTrainerEngine)):
        if name not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(name, engine)
