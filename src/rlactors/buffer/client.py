"""The driver's side of the `ReplayBuffer` actor: one method per call of its protocol
(`rlactors.buffer.replay`), each answered within a bound or a TimeoutError naming the call.

    buffer = BufferClient.create(config.buffer, batch_size_prompts, trigger_parameter_sync_step,
                                 ledger_dir, options=placement.near("actor"))
    buffer.add_prompts(requests, epoch)
    requests = buffer.reserve(max_count, producer_id, timeout_s=0.5)   # None: not now, ask again
    buffer.put_refs(scored_group_refs)                                # refs to await, one per group
    sampled = buffer.sample(batch_size, policy_version, timeout_s=1.0) # None: not enough queued yet
    buffer.ack(sampled.batch_id)

Two kinds of waiting, told apart here so no caller mistakes one for the other: `reserve` and
`sample` may wait inside the buffer for `timeout_s` (backpressure, too few groups queued) and then
answer None, "not now"; a buffer that does not answer at all within BUFFER_TIMEOUT_S on top of
that is stuck, and raises. A dead buffer raises Ray's ActorDiedError, which names it and why.
"""

from __future__ import annotations

import ray

from rlactors.buffer.records import SampledBatchRef
from rlactors.buffer.replay import ReplayBuffer
from rlactors.config import BufferConfig
from rlactors.runtime.calls import get_within
from rlactors.types import Group, PromptRequest

# The buffer answers from memory (reserve and sample add their own, explicit waits): past this it is stuck.
BUFFER_TIMEOUT_S = 300.0
# Writing or reading the buffer's parquet files is local disk work on what it holds in memory:
# seconds even for a large queue; past this the buffer actor is stuck.
BUFFER_FILES_TIMEOUT_S = 600.0


def wait_ran_out(error: BaseException) -> bool:
    """Whether `error` is the buffer's own bounded wait ending empty-handed (reserve or sample with a
    timeout: not now, ask again), as opposed to a stuck or dead buffer."""
    return isinstance(error, ray.exceptions.RayTaskError) and isinstance(error, TimeoutError)


class BufferClient:
    def __init__(self, actor: ray.actor.ActorHandle):
        self.actor = actor  # the ReplayBuffer itself: what a teardown kills

    @classmethod
    def create(cls, config: BufferConfig, batch_size_prompts: int, trigger_parameter_sync_step: int,
               ledger_dir: str | None, options: dict | None = None) -> BufferClient:
        return cls(ReplayBuffer.options(**(options or {})).remote(
            config, batch_size_prompts, trigger_parameter_sync_step, ledger_dir=ledger_dir))

    def _ask(self, method: str, *args, wait_s: float | None = None):
        return get_within(getattr(self.actor, method).remote(*args), BUFFER_TIMEOUT_S + (wait_s or 0.0),
                          f"replay_buffer.{method}")

    def _ask_waiting(self, method: str, *args, timeout_s: float | None):
        """A call that may wait inside the buffer up to `timeout_s`: None when that wait ran out."""
        try:
            return self._ask(method, *args, timeout_s, wait_s=timeout_s)
        except TimeoutError as error:
            if timeout_s is not None and wait_ran_out(error):
                return None
            raise

    # ---------------------------------------------------------------- the producers' side

    def add_prompts(self, requests: list[PromptRequest], epoch: int) -> int:
        return self._ask("add_prompts", requests, epoch)

    def reserve(self, max_count: int, producer_id: str, timeout_s: float | None = None) -> list[PromptRequest] | None:
        """Up to `max_count` prompts to generate ([] once every epoch is handed out); None when the
        producers stayed as far ahead as the staleness bound allows for `timeout_s`."""
        return self._ask_waiting("reserve", max_count, producer_id, timeout_s=timeout_s)

    def put_refs(self, groups: list[Group | ray.ObjectRef]) -> list[ray.ObjectRef]:
        """Put each group (or ref to one, resolved by the buffer) on its own; the refs of the puts,
        for the caller to await within its own bound (scoring runs before a put can land)."""
        return [self.actor.put.remote([group]) for group in groups]

    # ---------------------------------------------------------------- the trainer's side

    def sample(self, batch_size: int, current_version: int, timeout_s: float | None = None) -> SampledBatchRef | None:
        """A batch of `batch_size` groups, stale ones evicted first; None when fewer were queued
        within `timeout_s`."""
        return self._ask_waiting("sample", batch_size, current_version, timeout_s=timeout_s)

    def ack(self, batch_id: int) -> bool:
        return self._ask("ack", batch_id)

    def set_policy_version(self, policy_version: int) -> None:
        self._ask("set_policy_version", policy_version)

    # ---------------------------------------------------------------- reading, and checkpoints

    def metrics(self) -> dict[str, float]:
        return self._ask("metrics")

    def num_pending(self) -> int:
        """Prompts added and not yet handed out to a producer (`metrics()["num_pending"]`)."""
        return int(self.metrics()["num_pending"])

    def ledger(self, epoch: int | None = None) -> list[dict]:
        return self._ask("ledger", epoch)

    def health(self) -> dict:
        return self._ask("health")

    def save(self, path: str) -> None:
        get_within(self.actor.save.remote(str(path)), BUFFER_FILES_TIMEOUT_S, f"replay_buffer.save({path})")

    def load(self, path: str) -> None:
        get_within(self.actor.load.remote(str(path)), BUFFER_FILES_TIMEOUT_S, f"replay_buffer.load({path})")
