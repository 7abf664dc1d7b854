"""LoRA: an adapter-only weight sync against a full one, and the trainer's peak memory with and
without adapters, side by side in one run.

The model is the `medium` preset (~113M parameters, float32 on CPU). Two one-rank trainer groups
(FSDP2 on gloo) train it: a full fine-tune, and LoRA adapters of `--rank` on every linear layer of
the decoder (`model.lora`). One rollout engine serving LoRA (`rollout.lora_rank`) takes both kinds
of sync, alternately, as a run would send them (`TrainerGroup.send_weights`):
- full: every weight over shm (`WeightSender`, the transport a one-node CPU run picks);
- adapter: the adapter alone, written as a peft folder under /dev/shm and loaded by the engine in
  place of the last (`rlactors.weight_sync.adapters`).
One warm-up sync each, then `--num-syncs` each; per kind the median `weight_sync_s` (the sender's
figure: gathers, transport and the engine's load, pause and resume included) and the bytes.

Trainer memory: each group runs `--num-updates` PPO updates on the same small random batch (the
optimizer's state appears at the first step; activations are alike with and without adapters).
`trainer_peak_bytes` is the median over the updates of the rank's peak resident memory in each,
above what its process holds without a model (measured after dropping the run's model and
optimizer, then loading them again): the CPU stand-in for a GPU's device memory, where Python,
torch and Ray take none. The allocator gives back what it keeps of freed memory before each reading. `trainer_state_bytes`
is the rank's parameters, gradients and optimizer state alone. One rank: FSDP2 keeps the gathered
model between passes there (nothing to reshard to), in both groups alike.

Final line: `sync_bytes_ratio` (adapter / full), `sync_time_ratio` (median adapter sync / median
full sync; target <= 0.1 at rank 16), `trainer_peak_bytes_ratio` (LoRA / full; target <= 0.6) and
`trainer_state_bytes_ratio`.

    .venv/bin/python benchmarks/lora_sync.py [--rank 16] [--num-syncs 5] [--num-updates 3]

The median: one update's peak moved by up to a fifth between runs of the full fine-tune (when
the allocator hands freed blocks back to the system decides it), none of the adapter's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import ray
import torch

from rlactors.config import AlgorithmConfig, LoraConfig, RolloutConfig, TrainerConfig
from rlactors.models import build_tiny_model
from rlactors.trainer.batch import TrainBatch
from rlactors.weight_sync.choice import WeightSyncSettings

NUM_SEQUENCES, NUM_TOKENS = 4, 64


def trimmed(worker) -> int:
    """On a trainer rank (through `__ray_call__`): its resident bytes once the allocator gave back
    what it keeps of freed memory; the high-water mark starts again from there."""
    import ctypes
    import gc

    from rlactors.runtime.phases import start_peak_memory

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    worker.benchmark_baseline = start_peak_memory()
    return worker.benchmark_baseline["host"]


def without_model(worker) -> int:
    """On a trainer rank: its resident bytes with the run's model and optimizer dropped (what the
    process holds without them: Python, torch, Ray, the process group)."""
    worker._reset_run()
    return trimmed(worker)


def peak_bytes(worker) -> int:
    """On a trainer rank: its peak resident bytes since the last `trimmed`."""
    from rlactors.runtime.phases import peak_extra_bytes

    return worker.benchmark_baseline["host"] + peak_extra_bytes(worker.benchmark_baseline)["host"]


def state_bytes(worker) -> int:
    """On a trainer rank: the bytes of its parameters, gradients and optimizer state (its shards)."""
    def local(tensor) -> int:
        tensor = getattr(tensor, "_local_tensor", tensor)
        return tensor.numel() * tensor.element_size()

    held = sum(local(p) + (local(p.grad) if p.grad is not None else 0) for p in worker.model.parameters())
    return held + sum(local(value) for state in worker.optimizer.state.values() for value in state.values()
                      if torch.is_tensor(value))


def update_once(group) -> None:
    """One PPO update on a fixed random batch of NUM_SEQUENCES x NUM_TOKENS (old logprobs from the
    group itself): activations the same with and without adapters, small beside the state."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 250, (16,), generator=generator).tolist() for _ in range(NUM_SEQUENCES)]
    responses = [torch.randint(4, 250, (NUM_TOKENS - 16,), generator=generator).tolist() for _ in range(NUM_SEQUENCES)]
    batch = TrainBatch(prompts, responses, [0] * NUM_SEQUENCES)
    batch.set_field("advantages", [torch.randn(NUM_TOKENS - 16, generator=generator) for _ in range(NUM_SEQUENCES)])
    batch.set_field("old_logprobs", group.compute_logprobs(batch)["logprobs"])
    group.update_policy(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-syncs", type=int, default=5)
    parser.add_argument("--num-updates", type=int, default=3)
    args = parser.parse_args()

    from rlactors.rollout.engine import create_engine
    from rlactors.trainer.group import TrainerGroup

    work = Path(tempfile.mkdtemp(prefix="lora-sync-"))
    model_path = str(build_tiny_model(work / "medium", "medium", seed=0))
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    engine = create_engine(model_path, RolloutConfig(max_model_len=256, lora_rank=args.rank))
    trainer = TrainerConfig(num_workers=1, num_cpus_per_worker=1)
    groups = {"full": TrainerGroup("actor", model_path, trainer, AlgorithmConfig()),
              "adapter": TrainerGroup("actor", model_path, trainer, AlgorithmConfig(), lora=lora)}
    ray.get(engine.ready.remote())
    peaks, states, all_peaks = {}, {}, {}
    for kind, group in groups.items():
        worker = group.workers[0]
        process_bytes = ray.get(worker.__ray_call__.remote(without_model))
        group.start_run(model_path, trainer, AlgorithmConfig(), lora=lora if kind == "adapter" else None)
        update_peaks = []
        for _ in range(args.num_updates):
            ray.get(worker.__ray_call__.remote(trimmed))  # the peak of training, not of the load's copies
            update_once(group)
            update_peaks.append(ray.get(worker.__ray_call__.remote(peak_bytes)) - process_bytes)
        peaks[kind], all_peaks[kind] = int(statistics.median(update_peaks)), update_peaks
        states[kind] = ray.get(worker.__ray_call__.remote(state_bytes))
    settings = {"full": WeightSyncSettings("shm", RolloutConfig().weight_bucket_bytes, "float32", 600.0),
                "adapter": WeightSyncSettings("shm", 0, "float32", 600.0, adapter_dir=str(work / "adapters"))}
    syncs: dict[str, list[dict]] = {kind: [] for kind in groups}
    version = 0
    for round_index in range(args.num_syncs + 1):  # round 0 is the warm-up of each
        for kind, group in groups.items():
            version += 1
            stats = group.send_weights({0: (engine, 0)}, version, settings[kind])
            if stats["failed"] or stats["synced"] != [0]:
                raise RuntimeError(f"{kind} sync {version} failed: {stats['failed']}")
            if round_index:
                syncs[kind].append(stats)
    for group in groups.values():
        group.shutdown()
    ray.kill(engine)
    ray.shutdown()

    seconds = {kind: statistics.median(s["weight_sync_s"] for s in stats) for kind, stats in syncs.items()}
    num_bytes = {kind: stats[-1]["weight_bytes"] for kind, stats in syncs.items()}
    for kind in groups:
        print(f"{kind:>8}: {num_bytes[kind] / 1e6:8.2f} MB per sync, median {seconds[kind] * 1e3:7.1f} ms; "
              f"trainer rank peak {peaks[kind] / 2**20:6.0f} MiB, state {states[kind] / 2**20:6.0f} MiB")
    print(json.dumps({
        "sync_bytes_ratio": round(num_bytes["adapter"] / num_bytes["full"], 4),
        "sync_time_ratio": round(seconds["adapter"] / seconds["full"], 4),
        "trainer_peak_bytes_ratio": round(peaks["adapter"] / peaks["full"], 4),
        "trainer_state_bytes_ratio": round(states["adapter"] / states["full"], 4),
        "preset": "medium", "rank": args.rank, "num_syncs": args.num_syncs, "served_lora": True,
        "sync_s": {kind: round(value, 4) for kind, value in seconds.items()}, "sync_bytes": num_bytes,
        "trainer_peak_bytes": peaks, "trainer_peak_bytes_per_update": all_peaks, "trainer_state_bytes": states,
        "update_batch": [NUM_SEQUENCES, NUM_TOKENS],
    }))


if __name__ == "__main__":
    main()
