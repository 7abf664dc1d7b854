"""The node's folder of the current Ray session, where actors leave notes that must outlive their
process (an engine's error file, a reward scorer's worker pid). It sits beside the session's logs
and goes with them."""

from __future__ import annotations

import os
import tempfile


def session_dir() -> str:
    """This node's folder of the Ray session, or the temp dir outside Ray."""
    import ray

    if not ray.is_initialized():
        return tempfile.gettempdir()
    context = ray.get_runtime_context()
    return os.path.join(context.get_temp_dir(), context.get_session_name())
