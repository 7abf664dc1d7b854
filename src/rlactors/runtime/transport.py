"""Where actor results live: in the object store, so that rollout data never passes through the driver.

Ray returns a call's result smaller than `max_direct_call_object_size` (100 KiB) inside its reply to
the caller, which keeps it in its own process. For the rollout engines, the reward scorers and the
trainer ranks the caller is the driver: every Group, scored Group and row of logprobs under that size
would arrive in the driver and, passed on, leave it again; at GSM8K lengths (16 samples x ~300
tokens, ~80 KB) most groups are under it. These actors run with the limit at 0: each result is
stored in the object store of the node that made it and the driver receives only its location. The
object still belongs to the caller and outlives the process that made it, so a Group yielded by a
rollout engine that crashes right after stays readable.
"""

from __future__ import annotations

OBJECT_STORE_RESULTS_ENV = {"RAY_max_direct_call_object_size": "0"}


def results_in_object_store(options: dict) -> dict:
    """Ray actor `options` with the result-size limit at 0 added to their runtime_env's env_vars."""
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **OBJECT_STORE_RESULTS_ENV}
    return {**options, "runtime_env": runtime_env}
