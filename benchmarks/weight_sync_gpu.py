"""Weight-sync ceilings on one GPU: the trainer-side gather, a bucket's trip through host memory, and
a device-to-device copy. Needs torch and transformers only (no Ray, no vLLM, no rlactors).

A random-init Qwen2 causal LM (`--size`, or the sizes given one by one) is built in bfloat16 on the
device and, by default, wrapped in FSDP2 `fully_shard` over a one-process group (NCCL on CUDA, gloo
on CPU; started here, no torchrun), as a trainer rank holds it. Measured, each as GB/s:

- `gather`: one pass over the model's state dict calling `full_tensor()` on every DTensor (FSDP's
  gather of each weight, a collective even on one rank); with `--no-fsdp`, a `.contiguous()` pass
  over the plain tensors instead (nothing to gather: what a sender pays at best).
- `pack`: the gathered tensors copied one after another into a flat bucket of `--bucket-mib`
  (what a packed sender does before a broadcast or an IPC handle).
- `d2h` / `h2d`: one bucket from the device into pinned host memory and back (pageable host memory
  too, for comparison): the `shm` / `object_store` transports' way through the host.
- `d2d`: one bucket copied on the device: the local ceiling of any transport.

Each figure is the median of `--repeats` timed runs after one warm-up (a run of the bucket copies
repeats the copy until it has moved 1 GiB). `estimated_s` is the model's
bytes over each rate: a floor for a sync that takes that path. On one H200 a 7B model runs in about
a minute, most of it building the model.

    python benchmarks/weight_sync_gpu.py [--size 7b] [--bucket-mib 64] [--no-fsdp]
    python benchmarks/weight_sync_gpu.py --device cpu --size tiny     # the pure parts, anywhere

Prints one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import torch

# Qwen2 / Qwen2.5 shapes (vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, intermediate_size, tie_word_embeddings).
SIZES = {
    "tiny": (1024, 128, 2, 4, 2, 256, True),
    "0.5b": (151936, 896, 24, 14, 2, 4864, True),
    "1.5b": (151936, 1536, 28, 12, 2, 8960, True),
    "3b": (151936, 2048, 36, 16, 2, 11008, True),
    "7b": (152064, 3584, 28, 28, 4, 18944, False),
}
INNER_BYTES = 1 << 30  # each timed run of a bucket copy moves at least this much
FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "intermediate_size", "tie_word_embeddings")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="7b", choices=sorted(SIZES), help="Qwen2 shapes to start from")
    for field in FIELDS[:-1]:
        parser.add_argument("--" + field.replace("_", "-"), type=int, default=None, help=f"override {field}")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each measurement, after a warm-up")
    parser.add_argument("--no-fsdp", action="store_true", help="plain tensors: no process group, no fully_shard")
    args = parser.parse_args(argv)
    if args.bucket_mib < 1 or args.repeats < 1:
        parser.error("--bucket-mib and --repeats must be at least 1")
    return args


def model_config(args: argparse.Namespace):
    from transformers import Qwen2Config

    sizes = dict(zip(FIELDS, SIZES[args.size], strict=True))
    sizes.update({field: getattr(args, field) for field in FIELDS[:-1] if getattr(args, field) is not None})
    return Qwen2Config(max_position_embeddings=4096, **sizes)


def build_model(config, device: torch.device):
    """Random init, in bfloat16, directly on `device`."""
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # both `dtype=` and the older `torch_dtype=` spellings agree on this
    try:
        with device:
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=torch.bfloat16).eval()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def shard(model, device: torch.device):
    """FSDP2 over a one-process group started here (NCCL on CUDA, gloo on CPU)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unique_tensors(model) -> list[torch.Tensor]:
    """The state dict's tensors, a tied one once (what a sender sends)."""
    seen, tensors = set(), []
    for tensor in model.state_dict(keep_vars=True).values():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append(tensor.detach())
    return tensors


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, inner: int = 1) -> float:
    """Median seconds of one `fn()` over `repeats` runs of `inner` calls each, after one warm-up,
    the device synchronized around each run (a bucket's copy on a GPU takes microseconds: a run
    of several keeps the launch and synchronization out of the figure)."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        synchronize(device)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def gather_pass(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.contiguous()
        del whole


def pack_pass(tensors: list[torch.Tensor], bucket: torch.Tensor) -> None:
    """Every gathered tensor into the flat bucket (of the weights' dtype), starting over whenever it
    is full (the same buffer: what is measured is the copying)."""
    offset = 0
    for tensor in tensors:
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        flat = whole.contiguous().view(-1)
        start = 0
        while start < flat.numel():
            if offset == bucket.numel():
                offset = 0
            size = min(flat.numel() - start, bucket.numel() - offset)
            bucket[offset:offset + size].copy_(flat[start:start + size])
            offset += size
            start += size


def gbps(num_bytes: int, seconds: float) -> float:
    return round(num_bytes / max(seconds, 1e-12) / 1e9, 2)


def main(argv=None) -> None:
    args = parse_args(argv)
    began = time.perf_counter()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no GPU here (try --device cpu)")
        torch.cuda.set_device(device)
    config = model_config(args)
    model = build_model(config, device)
    built_s = time.perf_counter() - began
    fsdp = not args.no_fsdp
    if fsdp:
        model = shard(model, device)
    tensors = unique_tensors(model)
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
    bucket_bytes = args.bucket_mib << 20

    gather_s = timed(lambda: gather_pass(tensors), device, args.repeats)
    bucket = torch.empty(bucket_bytes // 2, dtype=torch.bfloat16, device=device)
    pack_s = timed(lambda: pack_pass(tensors, bucket), device, args.repeats)

    source = torch.randint(0, 255, (bucket_bytes,), dtype=torch.uint8, device=device)
    pinned = device.type == "cuda"
    host = torch.empty(bucket_bytes, dtype=torch.uint8, pin_memory=pinned)
    pageable = torch.empty(bucket_bytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    inner = max(1, -(-INNER_BYTES // bucket_bytes))
    d2h_s = timed(lambda: host.copy_(source, non_blocking=pinned), device, args.repeats, inner)
    h2d_s = timed(lambda: target.copy_(host, non_blocking=pinned), device, args.repeats, inner)
    assert torch.equal(target, source), "the bucket came back from host memory changed"
    d2h_pageable_s = timed(lambda: pageable.copy_(source), device, args.repeats, inner)
    h2d_pageable_s = timed(lambda: target.copy_(pageable), device, args.repeats, inner)
    d2d_s = timed(lambda: target.copy_(source), device, args.repeats, inner)

    rates = {"gather": gbps(weight_bytes, gather_s), "pack": gbps(weight_bytes, pack_s),
             "d2h": gbps(bucket_bytes, d2h_s), "h2d": gbps(bucket_bytes, h2d_s),
             "d2h_pageable": gbps(bucket_bytes, d2h_pageable_s), "h2d_pageable": gbps(bucket_bytes, h2d_pageable_s),
             "d2d": gbps(bucket_bytes, d2d_s)}
    estimated_s = {
        "gather": round(gather_s, 4),
        "pack": round(pack_s, 4),
        "host_round_trip": round(weight_bytes / bucket_bytes * (d2h_s + h2d_s), 4),
        "d2d": round(weight_bytes / bucket_bytes * d2d_s, 4),
    }
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}: Qwen2 {args.size} ({weight_bytes / 1e9:.2f} GB in bfloat16, {len(tensors)} tensors, "
          f"{'FSDP2 on one rank' if fsdp else 'plain tensors'}), bucket {args.bucket_mib} MiB")
    print("GB/s: " + ", ".join(f"{key} {value}" for key, value in rates.items()))
    print("whole model, s: " + ", ".join(f"{key} {value}" for key, value in estimated_s.items()))
    if fsdp:
        import torch.distributed as dist

        dist.destroy_process_group()
    print(json.dumps({
        "device": name,
        "size": args.size,
        "config": {field: getattr(config, field) for field in FIELDS},
        "fsdp": fsdp,
        "weight_bytes": weight_bytes,
        "num_tensors": len(tensors),
        "bucket_bytes": bucket_bytes,
        "pinned": pinned,
        "gbps": rates,
        "estimated_s": estimated_s,
        "repeats": args.repeats,
        "build_s": round(built_s, 1),
        "elapsed_s": round(time.perf_counter() - began, 1),
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
