"""`EngineSyncClient`: vLLM's `VLLMWeightSyncClient` protocol over our `RolloutEngine` actors.

A trainer engine (vLLM's `nccl`/`ipc`, our `rlactors_shm`/`rlactors_object_store`) drives a sync
through four calls; this client fans each out to the engines of the sync, at once, and waits at
most `call_timeout_s`. The engines' own bookkeeping rides the same calls: `start_weight_update`
pauses generation (or wakes sleeping weights), `finish_weight_update` labels the engine with the
policy version and resumes it. vLLM's trainer engines call `finish_weight_update()` without a
version: the client carries the version of the sync (`policy_version`).

Failures: an engine that raises, dies or does not answer in time is dropped from the rest of the
sync and named in `failed` (index -> error); the others go on. NCCL is the exception: its
broadcast is one collective, so any failure a call reports fails the sync (an engine that dies
inside the broadcast itself is not seen here: see `rlactors.weight_sync.sender`). With no engine
left the call raises `WeightSyncError`, naming each engine's error.
"""

from __future__ import annotations

import ray

from rlactors.runtime.calls import error_text, gather
from rlactors.weight_sync.choice import nccl_engine_init_info


class WeightSyncError(RuntimeError):
    """A weight sync reached none of its engines, or NCCL's collective broke."""


class EngineSyncClient:
    def __init__(self, engines: dict[int, object], transport: str, call_timeout_s: float,
                 workers_per_engine: int = 1):
        """`engines`: replica index -> RolloutEngine handle, the engines of every sync until re-init."""
        self.engines = dict(engines)
        self.transport = transport
        self.call_timeout_s = call_timeout_s
        self.workers_per_engine = workers_per_engine
        self.policy_version = 0  # set before each sync
        self.failed: dict[int, str] = {}
        self.actor_died: set[int] = set()
        self.live = sorted(self.engines)

    def begin(self, policy_version: int) -> None:
        """A new sync, labelled `policy_version`, to every engine of the client."""
        self.policy_version = policy_version
        self.failed = {}
        self.actor_died: set[int] = set()  # failed engines whose actor itself died
        self.live = sorted(self.engines)

    # ---- vLLM's VLLMWeightSyncClient protocol

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        if self.transport == "nccl":
            infos = {index: nccl_engine_init_info(init_info, position, self.workers_per_engine)
                     for position, index in enumerate(sorted(self.engines))}
            self._fan("init_weight_transfer_engine", lambda index: (infos[index],))
        else:
            self._fan("init_weight_transfer_engine", lambda index: (init_info,))

    def start_weight_update(self) -> None:
        self._fan("start_weight_update", lambda index: (self.policy_version,))

    def update_weights(self, update_info) -> None:
        self._fan("update_weights", lambda index: (update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = self.policy_version if weight_version is None else int(weight_version)
        self._fan("finish_weight_update", lambda index: (version,))

    # ----

    def call(self, method: str, *args) -> dict[int, object]:
        """`method(*args)` on every live engine: index -> result (failures go to `failed`)."""
        return self._fan(method, lambda index: args)

    def _fan(self, method: str, arguments) -> dict[int, object]:
        results, errors, not_answered = gather(
            {index: getattr(self.engines[index], method).remote(*arguments(index)) for index in self.live},
            self.call_timeout_s)
        for index in not_answered:
            self._fail(index, f"{method}: no answer within {self.call_timeout_s:g} s (rollout.call_timeout_s)")
        for index, error in errors.items():  # the engine raised or died: it leaves this sync
            self._fail(index, f"{method}: {error_text(error)}")
            if isinstance(error, ray.exceptions.RayActorError):
                self.actor_died.add(index)  # Ray restarts it if it may: a kill now would cost a restart
        if self.failed and (not self.live or self.transport == "nccl"):
            raise WeightSyncError(f"weight sync (policy_version {self.policy_version}) failed: " + "; ".join(
                f"engine {index}: {error}" for index, error in sorted(self.failed.items())))
        return results

    def _fail(self, index: int, error: str) -> None:
        self.failed.setdefault(index, error)
        if index in self.live:
            self.live.remove(index)
