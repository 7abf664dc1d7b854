"""Per-actor phase logs: what an actor did when, and the memory its process held right then.

    log = PhaseLog()
    log.record("sleep", memory_figures(), level=1)   # -> {"index", "phase", "monotonic_s", "memory", "level"}
    log.entries()                                    # oldest first, at most `max_entries`

Rollout engines and trainer ranks keep one each (sleep / wake / weight load / offload / onload /
forward / update / export) and hand it out through their `phase_log()` method, so the order of a
colocated step can be checked on every actor, and its memory read per phase on a GPU.

Invariants: a log holds the last `max_entries` entries, so a long run costs a fixed amount of
memory; `index` numbers every entry ever recorded (a gap at the front says how many fell off).
`monotonic_s` is `time.monotonic()`, CLOCK_MONOTONIC on Linux, the same clock for every process
of one host: entries of actors on one node can be ordered against each other, across nodes not.
"""

from __future__ import annotations

import resource
import time
from collections import deque

PHASE_LOG_TIMEOUT_S = 60.0  # handing out a log is a copy of at most 1024 small dicts; past this the actor is stuck


class PhaseLog:
    def __init__(self, max_entries: int = 1024):
        self._entries: deque[dict] = deque(maxlen=max_entries)
        self.num_recorded = 0

    def record(self, phase: str, memory: dict[str, int] | None = None, **details) -> dict:
        """Append one entry and return (a copy of) it."""
        entry = {"index": self.num_recorded, "phase": phase, "monotonic_s": time.monotonic(),
                 "memory": dict(memory or {}), **details}
        self._entries.append(entry)
        self.num_recorded += 1
        return dict(entry)

    def entries(self) -> list[dict]:
        return [dict(entry) for entry in self._entries]


def host_rss_bytes() -> int:
    """This process's resident memory now (Linux /proc); elsewhere its peak, all `resource` offers."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_figures() -> dict[str, int]:
    """Memory of this process: host RSS always; on CUDA/ROCm also the caching allocator's
    allocated and reserved bytes and the device's free and total bytes (`mem_get_info`, which sees
    every process on the device, e.g. a sleeping engine's freed KV cache). Only where this process
    already has a device context: creating one costs device memory, which is what is measured."""
    import torch

    figures = {"host_rss_bytes": host_rss_bytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free_bytes, total_bytes = torch.cuda.mem_get_info()
        figures |= {"device_allocated_bytes": torch.cuda.memory_allocated(),
                    "device_reserved_bytes": torch.cuda.memory_reserved(),
                    "device_free_bytes": free_bytes, "device_total_bytes": total_bytes}
    return figures


def start_peak_memory() -> dict[str, int]:
    """Begin measuring this process's peak memory: resets the kernel's RSS high-water mark (and
    torch's device peak where a device context exists); returns the baseline for `peak_extra_bytes`."""
    import torch

    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current RSS (Linux)
    except OSError:
        pass
    baseline = {"host": host_rss_bytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
        baseline["device"] = torch.cuda.memory_allocated()
    return baseline


def peak_extra_bytes(baseline: dict[str, int]) -> dict[str, int]:
    """Peak memory above `baseline` since `start_peak_memory`: host (RSS high-water mark) and device."""
    import torch

    extra = {"host": max(_status_bytes("VmHWM") - baseline["host"], 0)}
    if "device" in baseline:
        extra["device"] = max(torch.cuda.max_memory_allocated() - baseline["device"], 0)
    return extra


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0
