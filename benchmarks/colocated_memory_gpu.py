"""Colocated time-sharing, trainer side: device memory and time of each phase of one step.

One FSDP2 rank (a one-process group: NCCL on a GPU, gloo on CPU) trains a random-init Qwen2 built
with `rlactors.models`, then goes through what `trainer.offload=true` does around a rollout:

    trained   the trainer on the device after one update (parameters, gradients gone, AdamW state)
    offload   parameters and optimizer state to host memory (`rlactors.trainer.offload.move_state`)
    engine    a stand-in for the engine's weights + KV cache: `--engine-fraction` of the device
              memory free now, allocated and written (on CPU: `--cpu-engine-bytes` of host memory)
    freed     the stand-in released (the engine asleep)
    onload    the trainer state back on the device
    update    one more optimizer step

Needs torch and transformers only (no Ray, no vLLM), so it runs on a bare GPU machine from a
checkout; on CPU the moves are no-ops and the sizes tiny, which checks the script itself:

    python benchmarks/colocated_memory_gpu.py                    # GPU: --layers 12 --hidden 1024
    python benchmarks/colocated_memory_gpu.py --preset tiny      # CPU check (seconds)

Each phase reports `rlactors.runtime.phases.memory_figures()` (host RSS; on a GPU also the allocator's
allocated/reserved bytes and the device's free bytes) and its seconds. Also checked: the logits
after the round trip equal those before it (moves copy exactly). Prints one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

try:
    import rlactors  # noqa: F401
except ImportError:  # a bare checkout on a machine without the venv
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import torch.distributed as dist

from rlactors.models import build_char_tokenizer, tiny_model_config
from rlactors.runtime.phases import memory_figures
from rlactors.trainer import fsdp, offload


def build_model(preset: str, num_layers: int | None, hidden_size: int | None):
    """A random-init Qwen2 of a preset's shape, optionally resized (GPU sizes need no download)."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    config = tiny_model_config(preset, "qwen2", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    if hidden_size:
        config.update(dict(hidden_size=hidden_size, intermediate_size=hidden_size * 11 // 4,
                           num_attention_heads=hidden_size // 64, num_key_value_heads=max(1, hidden_size // 256),
                           head_dim=64))
    if num_layers:
        config.num_hidden_layers = num_layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def train_step(model, optimizer, input_ids: torch.Tensor) -> float:
    logits = model(input_ids=input_ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gpu = torch.cuda.is_available()
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--layers", type=int, default=12 if gpu else None)
    parser.add_argument("--hidden", type=int, default=1024 if gpu else None)
    parser.add_argument("--batch", type=int, default=8 if gpu else 2)
    parser.add_argument("--seq-len", type=int, default=1024 if gpu else 32)
    parser.add_argument("--engine-fraction", type=float, default=0.8,
                        help="share of the device memory free after the offload that the stand-in engine takes")
    parser.add_argument("--cpu-engine-bytes", type=int, default=64 << 20)
    args = parser.parse_args()

    mesh = fsdp.init_distributed(0, 1, "127.0.0.1", fsdp.free_port())
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    model = fsdp.shard_model(build_model(args.preset, args.layers, args.hidden), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(4, 250, (args.batch, args.seq_len), generator=generator).to(device)
    phases: dict[str, dict] = {}

    def phase(name: str, start: float) -> None:
        synchronize(device)
        phases[name] = {"seconds": time.perf_counter() - start, **memory_figures()}

    start = time.perf_counter()
    losses = [train_step(model, optimizer, input_ids)]
    phase("trained", start)
    with torch.no_grad():
        logits_before = model(input_ids=input_ids[:1], use_cache=False).logits.float().cpu()

    start = time.perf_counter()
    offloaded_bytes = offload.move_state(model, optimizer, offload.HOST)
    offload.release_cached_memory(device)
    phase("offload", start)

    start = time.perf_counter()
    if device.type == "cuda":
        engine_bytes = int(args.engine_fraction * torch.cuda.mem_get_info()[0])
        engine = torch.empty(engine_bytes, dtype=torch.uint8, device=device)
    else:
        engine_bytes = args.cpu_engine_bytes
        engine = torch.empty(engine_bytes, dtype=torch.uint8)
    engine.fill_(1)  # written, so the memory is really resident (pages on CPU)
    phase("engine", start)
    start = time.perf_counter()
    del engine
    offload.release_cached_memory(device)
    phase("freed", start)

    start = time.perf_counter()
    onloaded_bytes = offload.move_state(model, optimizer, device)
    phase("onload", start)
    with torch.no_grad():
        logits_after = model(input_ids=input_ids[:1], use_cache=False).logits.float().cpu()

    start = time.perf_counter()
    losses.append(train_step(model, optimizer, input_ids))
    phase("update", start)

    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "offloaded_bytes": offloaded_bytes,
        "onloaded_bytes": onloaded_bytes,
        "engine_standin_bytes": engine_bytes,
        "logits_equal_after_round_trip": bool(torch.equal(logits_before, logits_after)),
        "losses": losses,
        "phases": phases,
    }
    if device.type == "cuda":
        result["device_freed_by_offload_bytes"] = (phases["trained"]["device_allocated_bytes"]
                                                   - phases["offload"]["device_allocated_bytes"])
        result["peak_device_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
