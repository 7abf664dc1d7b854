"""Asking the kernel to signal a process when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`).

Used by the processes rlactors starts outside Ray's control, which a SIGKILL of their parent would
otherwise orphan: vLLM's engine core and workers (`rlactors.rollout.vllm_plugin`) and the reward
scorers' worker subprocesses (`rlactors.reward.worker`). The signal comes when the parent *thread*
that started the process exits, so callers check the parent pid before acting on it. Standard
library only: every vLLM process imports this.
"""

from __future__ import annotations

import os
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def request_parent_death_signal(signal_number: int) -> str | None:
    """Have the kernel send `signal_number` to this process when its parent dies. Returns None when
    set, else why not (not Linux, or prctl failed)."""
    if not sys.platform.startswith("linux"):
        return f"no parent-death signal on {sys.platform}"
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal_number, 0, 0, 0) != 0:
        return f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}"
    return None
