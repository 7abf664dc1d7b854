"""Adapter-only weight syncs of a LoRA run (`model.lora.merge=false`): the actor's adapter, not its
weights, goes to the engines.

    stats = send_adapter(tensors, engines, policy_version, settings, lora_config, base_model_path)  # rank 0

Every rank gathers the adapter tensors (collectives, in the same order); rank 0 writes them as a
peft folder `<settings.adapter_dir>/policy_version_<N>` in the engines' dtype, and every engine
loads it (`RolloutEngine.load_adapter`, paused like a full update). vLLM loads adapters by path
only, so the folder is the transport: under /dev/shm when the engines share the trainer's node,
the run's own folder (which every node sees) otherwise. Older versions' folders are removed once
a sync is done; an engine revived later gets the adapter from the trainer again. The figures are
the `WeightSender`'s (`synced`, `failed` naming each engine's error, `actor_died`), with
`transport="adapter"`. With `verify`, each engine's sha256 of the file it loaded must be the
written file's.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import torch

from rlactors.config import LoraConfig
from rlactors.models.lora import adapter_digest
from rlactors.weight_sync.choice import WeightSyncSettings
from rlactors.weight_sync.client import EngineSyncClient, WeightSyncError

TRANSPORT = "adapter"
VERSION_PREFIX = "policy_version_"


def send_adapter(tensors: dict[str, torch.Tensor], engines: dict[int, tuple[object, int]], policy_version: int,
                 settings: WeightSyncSettings, lora_config: LoraConfig, base_model_path: str) -> dict:
    """Rank 0's part: `tensors` are the whole adapter tensors by peft name (gathered by every rank,
    `rlactors.trainer.fsdp.gather_whole`), in the engines' dtype."""
    from rlactors.models.lora import save_adapter

    start = time.perf_counter()
    num_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    figures = {"transport": TRANSPORT, "policy_version": policy_version, "init_s": 0.0, "weight_bytes": num_bytes,
               "num_buckets": None, "num_tensors": len(tensors), "synced": [], "failed": {}, "actor_died": []}
    if engines:
        if not settings.adapter_dir:
            raise ValueError("an adapter-only sync needs WeightSyncSettings.adapter_dir: a folder every engine reads")
        root = Path(settings.adapter_dir)
        folder = save_adapter(root / f"{VERSION_PREFIX}{policy_version}", tensors, lora_config, base_model_path)
        client = EngineSyncClient({index: handle for index, (handle, _) in engines.items()}, TRANSPORT,
                                  settings.call_timeout_s)
        client.begin(policy_version)
        try:
            loaded = client.call("load_adapter", str(folder), policy_version, settings.verify)
        except WeightSyncError:
            loaded = {}  # every engine failed: each is named in client.failed
        if settings.verify:
            check_digests(client, loaded, adapter_digest(folder))
        figures.update(synced=sorted(client.live), failed=dict(client.failed), actor_died=sorted(client.actor_died))
        remove_older_versions(root, policy_version)
    elapsed = time.perf_counter() - start
    return figures | {"weight_sync_s": elapsed, "bytes_per_s": num_bytes / max(elapsed, 1e-9)}


def adapter_dir(output_dir: Path, node_ids: set) -> str:
    """Where a run's adapter folders go: /dev/shm when the trainer and the engines share one node
    (`node_ids`, the plan's), else the run's folder, which every node sees."""
    if len(node_ids) == 1 and Path("/dev/shm").is_dir():
        return str(Path("/dev/shm") / f"rlactors-adapters-{hashlib.sha256(str(output_dir).encode()).hexdigest()[:12]}")
    return str(output_dir / "adapters")


def check_digests(client: EngineSyncClient, loaded: dict[int, dict], sent: str) -> None:
    """An engine whose adapter file differs from the one written (a shared filesystem's stale or
    partial copy) fails the sync like one that died."""
    for index, result in loaded.items():
        if result.get("adapter_sha256") != sent and index in client.live:
            client.failed[index] = "verify: the adapter file the engine loaded differs from the one written"
            client.live.remove(index)


def remove_older_versions(root: Path, policy_version: int) -> None:
    """The folders of versions before `policy_version` (no engine reads them again)."""
    for folder in root.glob(f"{VERSION_PREFIX}*"):
        suffix = folder.name.removeprefix(VERSION_PREFIX)
        if suffix.isdigit() and int(suffix) < policy_version:
            shutil.rmtree(folder, ignore_errors=True)
