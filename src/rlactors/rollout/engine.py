"""RolloutEngine: one vLLM engine (v1 `AsyncLLM`) as a long-lived Ray actor.

Protocol (Ray actor methods; everything else is private):

    engine = create_engine(model_path, rollout_config)      # RolloutEngine actor, resources set
    ray.get(engine.ready.remote())                          # starts vLLM (~35 s on 2 CPU cores)
    for ref in engine.generate.remote(requests, sampling):  # streaming generator
        group = ray.get(ref)                                # one Group per prompt, completion order
    # weight syncs: driven by a sender (rlactors.weight_sync), see "Weight updates" below
    ray.get(engine.sleep.remote()); ray.get(engine.wake_up.remote())
    ray.get(engine.abort.remote(group_ids))                 # None aborts everything in flight
    ray.get(engine.health.remote()); engine.state_dict / load_state_dict
    ray.get(engine.phase_log.remote())                      # [{phase, monotonic_s, memory, ...}]
    ray.get(engine.new_run.remote())                        # kept for another run (rlactors.pipelines.warm)

`generate(requests, sampling)`: `requests` is a list of `PromptRequest` (or an object ref of one,
which Ray resolves); `sampling` a `SamplingConfig`, a dict of its fields, or one of either per
request. It is a streaming generator (`num_returns="streaming"`): each `Group` is yielded as soon
as all its samples finish, so long responses never hold back the rest of the batch. With
`with_summaries=True` each Group is followed by its `GroupSummary`, so the caller can route Groups
without reading them (the router does). Results are kept in the object store
(`rlactors.runtime.transport`), never sent inside the reply to the caller. How the samples are
generated, what a `Sample` holds (its logprobs, the policy version of each token), multi-turn
episodes, responses continued across interruptions: `rlactors.rollout.generation`.

Weight updates (`init_weight_transfer_engine` once per sender, then per sync `start_weight_update`,
`update_weights` per bucket, `finish_weight_update`), how generation pauses for them and what an
unfinished one leaves: `rlactors.rollout.weights`. A LoRA run's engines (`rollout.lora_rank`) take
the adapter alone instead (`load_adapter`: the same pause and version label; every later request
names it). Sleep (colocated mode: `sleep`, `wake_up`), what
it frees on each platform and its wake order: `rlactors.rollout.sleep`. Requests arriving during
either wait at the admission gate (`rlactors.rollout.admission`) and enter vLLM after it.

Phase log (`phase_log()`, see `rlactors.runtime.phases`): generate calls, sleep, each wake (with its tags)
and each weight load, with the memory of vLLM's worker process (which holds the device memory).

CPU placement: vLLM binds the model's OpenMP threads to its chosen cores; the actor pins its own
process, and so the engine-core process it starts, to the remaining cores (`health()` lists them as
`front_end_cpu_cores`), so neither preempts the model threads (`keep_front_end_off_model_cores`).

Failures (`rollout.engine_core`): if vLLM cannot start, `ready()` and every later call raise
RuntimeError("vLLM engine failed to start: <vLLM's own error>"); once the engine core dies, every
call (one waiting on it too) raises vLLM's EngineDeadError and `health()` gives the cause in `error`.
vLLM's processes die with the actor (`rlactors.rollout.vllm_plugin`).

Another run (`new_run`, for engines kept between runs, `rlactors.pipelines.warm`): the policy
version goes back to 0, the phase log and counters start empty, and the engine serves by the new
run's per-run rollout settings (`RolloutConfig.PER_RUN`; a replica Ray restarts gets them with
`ready`); it still holds the last run's weights, so it refuses to generate until a weight update
has loaded the new run's.

Checkpoint (`state_dict`): the `policy_version` only. Weights belong to the trainer: after a
restore, or a restart, the trainer sends them again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import ray

from rlactors.config import RolloutConfig
from rlactors.models.lora import adapter_digest
from rlactors.placement.cluster import unplaced_options
from rlactors.rollout.adapters import adapter_bytes, load_adapter_in_vllm
from rlactors.rollout.admission import AdmissionGate
from rlactors.rollout.engine_core import (
    VllmCalls,
    count_progress,
    dead_detail,
    dead_error,
    prepare_environment,
    start_vllm,
)
from rlactors.rollout.generation import GenerateCall, Requests, run_group
from rlactors.rollout.samples import SamplingArg, sampling_per_request, summarize_group
from rlactors.rollout.sleep import SLEEP_TAGS, tags_to_wake
from rlactors.rollout.weights import WeightUpdate, check_update_start, close_update_in_vllm, vllm_update_info
from rlactors.runtime.device import default_dtype, detect_platform
from rlactors.runtime.phases import PhaseLog
from rlactors.runtime.state_clock import LevelClock
from rlactors.runtime.transport import results_in_object_store
from rlactors.runtime.vllm_features import detect as detect_vllm_features
from rlactors.types import PromptRequest
from rlactors.weight_sync.choice import RLACTORS_BACKEND
from rlactors.weight_sync.layout import update_bytes

# Requests already admitted reach vLLM's engine core within milliseconds; past this it is stuck.
GATE_TIMEOUT_S = 60.0


@ray.remote
class RolloutEngine:
    def __init__(self, model_path: str, config: RolloutConfig, dtype: str = "auto", policy_version: int = 0,
                 seed: int = 0, weight_backend: str = RLACTORS_BACKEND):
        self.model_path = str(model_path)
        self.config = config
        self.weight_backend = weight_backend  # vLLM's weight-transfer backend (rlactors.weight_sync.choice)
        if weight_backend == "ipc":
            # CUDA IPC handles hold classes and dtypes that vLLM's msgpack channel to its workers
            # carries only by pickle, which vLLM allows with this set (before it is imported).
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        self.platform = detect_platform()
        self.error_file = prepare_environment(self.platform, config)  # before vLLM is imported
        self.start_error: str | None = None  # vLLM failed to start: every later call fails with this
        self.dtype = default_dtype(self.platform) if dtype == "auto" else dtype
        self.seed = seed
        self.policy_version = policy_version
        self.asleep = False
        self.weights_mixed = False  # an update began and has not finished: some tensors may be new, some old
        self._gate = AdmissionGate()  # closed while weights change or the engine sleeps (rlactors.rollout.admission)
        self.llm = None
        self._vllm: VllmCalls | None = None  # every call into vLLM once it has started (rlactors.rollout.engine_core)
        self.progress = None  # engine-core outputs processed (`count_progress`): a hung core stops it
        self.vllm_features = None  # what the installed vLLM offers (rlactors.runtime.vllm_features), at start
        self.vocab_size = 0
        self.front_end_cpu_cores: list[int] = []  # CPU: this process's cores, kept off the model's
        self._start_lock = asyncio.Lock()
        self._update: WeightUpdate | None = None  # between start_ and finish_weight_update
        self._requests = Requests()  # in vLLM now, and counts over all (rlactors.rollout.generation)
        self._sleeping_tags: list[str] = []  # vLLM allocations asleep, of SLEEP_TAGS
        self._weights_discarded = False  # level-2 sleep: the weights hold nothing until a load
        self.phases = PhaseLog()
        self._weights_of_last_run = False  # `new_run` until its first weight update: generate refuses
        self.adapter = None  # vLLM's LoRARequest of the adapter every request uses (`load_adapter`), if any

    # ---------------------------------------------------------------- lifecycle

    async def ready(self, config: RolloutConfig | None = None) -> dict:
        """Start the vLLM engine if not started; returns `health()` (raises: see Failures above).
        With `config`, serve by its per-run fields (`use_run_settings`): how a replica Ray restarted
        (its constructor has the settings of the run that started it) gets those of a later run
        that took it from another (`rlactors.pipelines.warm`)."""
        if config is not None:
            self.use_run_settings(config)
        async with self._start_lock:
            if self.start_error is not None:
                raise RuntimeError(self.start_error)
            if self.llm is None:
                try:
                    self.vllm_features = detect_vllm_features()
                    logging.getLogger(__name__).info(self.vllm_features.describe())
                    self.vllm_features.require()
                    self.llm, self.front_end_cpu_cores = start_vllm(self.model_path, self.config, self.platform,
                                                                    self.dtype, self.seed, self.error_file,
                                                                    self.weight_backend)
                except RuntimeError as error:
                    self.start_error = str(error)
                    raise
                self._vllm = VllmCalls(self.llm, self.platform, self.error_file, lambda: self.config.health_timeout_s)
                self.vocab_size = self.llm.model_config.get_vocab_size()
                self._requests.max_num_seqs = self.llm.vllm_config.scheduler_config.max_num_seqs
                self.progress = count_progress(self.llm)
                await self._vllm("ready", self.llm.update_weight_version(str(self.policy_version)))
                if self.config.record_routing and self.platform == "cpu":  # elsewhere vLLM records it
                    await self._vllm("start_routing_capture", self.llm.collective_rpc("rlactors_start_routing_capture"))
        if self.llm.errored:
            raise dead_error(self.llm, "ready", self.error_file)
        return self.health()

    def health(self) -> dict:
        """Answers at once, also mid-generate or mid-update (a liveness probe); `error` says why not
        healthy: vLLM failed to start, its engine core died, or it is hung (`VllmCalls.hung_error`)."""
        errored = self.llm is not None and self.llm.errored
        hung = self._vllm.hung_error("health") if self._vllm is not None and not errored else None
        return {
            "started": self.llm is not None,
            "healthy": self.llm is not None and not errored and hung is None,
            "error": self.start_error or (dead_detail(self.llm, self.error_file) if errored else None)
            or (str(hung) if hung is not None else None),
            # Seconds the engine core has left a heartbeat unanswered (rlactors.rollout.engine_core).
            "core_silent_s": self._vllm.core_silent_s() if self._vllm is not None else 0.0,
            "policy_version": self.policy_version,
            "asleep": self.asleep,
            "weights_mixed": self.weights_mixed,
            "num_in_flight_samples": len(self._requests.in_flight),
            # A count that stands still while samples are in flight and nothing pauses them: the
            # engine core hangs (the router's watchdog kills such a replica).
            "num_engine_outputs": self.progress.num_outputs if self.progress is not None else None,
            "paused": self.asleep or self._update is not None,
            "num_interrupted": self._requests.num_interrupted,
            "num_version_disagreements": self._requests.num_version_disagreements,
            # Seconds generating, paused (a weight update or sleep) and idle since the run began,
            # and the running requests integrated over them (occupancy: `rollout_occupancy`).
            "time_s": self._requests.clock.seconds(),
            "running_request_s": self._requests.running.total(),
            "max_num_seqs": self._requests.max_num_seqs,
            "platform": self.platform,
            "dtype": self.dtype,
            "front_end_cpu_cores": self.front_end_cpu_cores,
            "sleeping_tags": list(self._sleeping_tags),
            "pid": os.getpid(),
            "vllm": self.vllm_features.describe() if self.vllm_features is not None else None,
        }

    async def new_run(self, config: RolloutConfig | None = None) -> None:
        """Serve another run from policy_version 0, with an empty phase log and counters, and that
        run's `config` (its `RolloutConfig.PER_RUN` fields; the others must be those this engine
        started with). Only an idle, healthy engine can: nothing in flight, no weight update open.
        Until the next weight update it holds the last run's weights, and `generate` refuses."""
        await self.ready()
        if self._requests.in_flight or self._update is not None or self.weights_mixed:
            raise RuntimeError(f"new_run: the engine is busy ({len(self._requests.in_flight)} request(s) in flight, "
                               f"weight update open: {self._update is not None or self.weights_mixed})")
        if config is not None:
            self.use_run_settings(config)
        self.policy_version = 0
        self._requests.num_interrupted = self._requests.num_version_disagreements = 0
        self._requests.user_aborted.clear()
        self._requests.clock.reset("idle")
        self._requests.running = LevelClock()
        self.phases = PhaseLog()
        self._weights_of_last_run = True
        await self._vllm("new_run", self.llm.update_weight_version("0"))

    def use_run_settings(self, config: RolloutConfig) -> None:
        """Serve by `config`'s `RolloutConfig.PER_RUN` fields (sampling, episodes, interruptions);
        its other fields must be those this engine started with."""
        started, asked = self.config.start_settings(), config.start_settings()
        if started != asked:
            differ = sorted(name for name in started if started[name] != asked[name])
            raise ValueError(f"this engine was started with other rollout.{', rollout.'.join(differ)}")
        self.config = config

    def state_dict(self) -> dict:
        return {"policy_version": self.policy_version}

    async def load_state_dict(self, state: dict) -> None:
        self.policy_version = int(state["policy_version"])
        if self.llm is not None:
            await self._vllm("load_state_dict", self.llm.update_weight_version(str(self.policy_version)))

    # ---------------------------------------------------------------- generation

    @ray.method(num_returns="streaming")
    async def generate(self, requests: list[PromptRequest], sampling: SamplingArg | list[SamplingArg] = None,
                       with_summaries: bool = False):
        """Yield one Group per request as each completes, each followed by its GroupSummary if
        `with_summaries` (see the module docstring)."""
        await self.ready()
        if self.asleep:
            raise RuntimeError("RolloutEngine is asleep: call wake_up() before generate()")
        if self._weights_of_last_run:
            raise RuntimeError("RolloutEngine holds the last run's weights: load this run's (a weight update) "
                               "before generate()")
        per_request = sampling_per_request(sampling, len(requests))
        await self._record("generate", num_requests=len(requests))
        call = GenerateCall(self.llm, self._gate, self._requests, lambda: (self.policy_version, self.adapter),
                            self.config, self.vocab_size, self.model_path, self.error_file,
                            routing_in_worker=self.platform == "cpu")  # where `ready` starts our capture
        tasks = [asyncio.create_task(run_group(call, request, setting))
                 for request, setting in zip(requests, per_request, strict=True)]
        try:
            for next_done in asyncio.as_completed(tasks):
                group = await next_done
                yield group
                if with_summaries:  # after the Group, with no await between: it confirms the Group arrived
                    yield summarize_group(group)
        finally:
            for task in tasks:
                task.cancel()  # the consumer went away: vLLM aborts the cancelled requests

    async def abort(self, group_ids: list[str] | None = None) -> int:
        """End the named groups' (or all) in-flight samples now with finish_reason "abort", keeping
        their tokens. Returns the number of vLLM requests aborted."""
        await self.ready()
        request_ids = self._requests.abort(group_ids)
        await self._vllm("abort", self.llm.abort(request_ids))
        return len(request_ids)

    # ---------------------------------------------------------------- weights

    async def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Ready vLLM's weight-transfer engine for a sender (NCCL: join its group; shm: map its segments)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.ready()
        await self._vllm("init_weight_transfer_engine",
                         self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    async def shutdown_weight_transfer(self) -> None:
        if self._update is not None:
            raise RuntimeError("shutdown_weight_transfer with a weight update open")
        await self._vllm("shutdown_weight_transfer", self.llm.collective_rpc("rlactors_shutdown_weight_transfer"))

    async def start_weight_update(self, policy_version: int) -> None:
        """Stop generating (or wake sleeping weights) and open a weight update to `policy_version`."""
        await self._pause_for_update(policy_version)
        self.weights_mixed = True  # from the first tensor loaded until finish_weight_update
        await self._vllm("start_weight_update", self.llm.start_weight_update())

    async def _pause_for_update(self, policy_version: int) -> None:
        await self.ready()
        check_update_start(policy_version, self.policy_version, self._update)
        pause_start = time.perf_counter()
        await self._gate.close(GATE_TIMEOUT_S)  # nothing enters vLLM until these weights are whole again
        self._requests.note_activity(self._gate)
        # With the gate closed, what is in vLLM is in `in_flight`: an engine with nothing there has
        # nothing to stop or wait for, and skips vLLM's pause (which ends in a fixed 20 ms sleep).
        self._update = WeightUpdate(policy_version, pause_start, was_asleep=self.asleep,
                                    paused=not self.asleep and bool(self._requests.in_flight))
        if self.asleep:
            if "weights" in self._sleeping_tags:
                await self._wake(["weights"])  # the KV cache stays freed until wake_up()
        elif self._update.paused:
            mode = "abort" if self.config.partial_rollout else "wait"  # see rlactors.rollout.weights
            await self._vllm("start_weight_update", self.llm.pause_generation(mode=mode, clear_cache=True))
            if mode == "wait" and self._requests.in_flight:
                # vLLM's "wait" drains the requests it runs; those it had queued (more than
                # max_num_seqs) or preempted would run after the update under the new weights,
                # labelled with the old version. Interrupted, they restart under the new weights
                # (`rlactors.rollout.generation`: without partial rollouts an interrupted turn restarts).
                await self._vllm("start_weight_update", self.llm.abort(list(self._requests.in_flight)))
        self._update.sync_start_s = time.perf_counter()

    async def update_weights(self, update_info: dict) -> None:
        """Load one bucket: vLLM's update info of this engine's backend, or `{"bucket": ref}` of the
        object_store transport (the bucket is fetched here and its bytes passed on inline)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if self._update is None:
            raise RuntimeError("update_weights without start_weight_update")
        update_info = await vllm_update_info(update_info)
        self._update.weight_bytes += update_bytes(update_info)
        await self._vllm("update_weights", self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    async def finish_weight_update(self, policy_version: int) -> dict:
        """Close the update, label later tokens `policy_version`, resume generating. Returns timing:
        weight_sync_s (start to finish, without the wait for in-flight requests, which is pause_s)."""
        update = self._update
        if update is None or update.policy_version != policy_version:
            raise RuntimeError(f"finish_weight_update({policy_version}) without a matching start_weight_update")
        await close_update_in_vllm(self._vllm, self.weight_backend, policy_version)
        return await self._resume_after_update(update)

    async def load_adapter(self, folder: str, policy_version: int, digest: bool = False) -> dict:
        """A LoRA run's weight update: the peft adapter in `folder` (on this node's filesystem)
        replaces the one served, as `policy_version`, with the pause, version label and timing of a
        full update (`finish_weight_update`); with `digest`, also the sha256 of the adapter file it
        loaded (a sync's `verify`: hashing is a sixth of an adapter sync, paid only when asked).
        Every request admitted after it names this adapter."""
        if not self.config.lora_rank:
            raise RuntimeError("load_adapter: this engine serves no LoRA adapters (rollout.lora_rank=0)")
        await self._pause_for_update(policy_version)
        update = self._update
        self.weights_mixed = True  # until the adapter is whole in every worker
        sha256 = {"adapter_sha256": adapter_digest(folder)} if digest else {}  # the bytes vLLM reads next
        self.adapter = await load_adapter_in_vllm(self._vllm, folder, policy_version)
        update.weight_bytes = adapter_bytes(folder)
        return await self._resume_after_update(update) | sha256

    async def _resume_after_update(self, update: WeightUpdate) -> dict:
        policy_version = update.policy_version
        self._update = None
        self.policy_version = policy_version
        self.weights_mixed = self._weights_discarded = self._weights_of_last_run = False
        await self._record("load_weights", policy_version=policy_version, weight_bytes=update.weight_bytes)
        if update.paused:
            await self._vllm("finish_weight_update", self.llm.resume_generation())
        self._open_gate_if_ready()
        return update.timing()

    async def load_weights(self, buckets: list, policy_version: int) -> dict:
        """A whole update pulled by the engine: object-store buckets (lists of (HF name, tensor), or
        their refs) loaded in one call, through the same protocol (a revived replica's reload when
        the weights were sent from a driver, not a trainer)."""
        await self.start_weight_update(policy_version)
        for bucket in buckets:
            await self.update_weights({"bucket": bucket})
        return await self.finish_weight_update(policy_version)

    async def weight_checksums(self) -> dict[str, str]:
        """sha256 of every parameter as the engine holds it (vLLM's layout), all workers (`rank<r>:<name>`)."""
        return merged(await self._vllm("weight_checksums", self.llm.collective_rpc("rlactors_weight_checksums")))

    async def received_digests(self) -> dict[str, str]:
        """sha256 of each tensor of the last update sent with digests (see `rlactors.weight_sync.sender`)."""
        return merged(await self._vllm("received_digests", self.llm.collective_rpc("rlactors_received_digests")))

    async def worker_memory(self, what: str) -> dict | None:
        """`start` resets the peak memory of vLLM's first worker; `peak` reads its peak extra bytes since."""
        method = {"start": "rlactors_start_peak_memory", "peak": "rlactors_peak_extra_bytes"}[what]
        return (await self._vllm("worker_memory", self.llm.collective_rpc(method)))[0]

    # ---------------------------------------------------------------- sleep

    async def sleep(self) -> dict | None:
        """Free the KV cache and offload (level 1) or discard (level 2) the weights on GPU; on CPU
        only pause generation. In-flight requests are interrupted and treated like a weight-update
        interruption (`on_abort`). Returns the phase-log entry; None if already asleep."""
        await self.ready()
        if self.asleep:
            return None
        level = self.config.sleep_level
        await self._gate.close(GATE_TIMEOUT_S)  # what is interrupted waits at the gate until wake_up
        self._requests.note_activity(self._gate)
        await self._vllm("sleep", self.llm.sleep(level=level, mode="abort" if self.config.partial_rollout else "wait"))
        self.asleep = True
        self._sleeping_tags = list(SLEEP_TAGS)  # vLLM's executor marks both asleep at every level >= 1
        self._weights_discarded = level == 2
        entry = await self._record("sleep", level=level)
        if self.platform == "cpu" and self.config.suspend_while_asleep:
            self._vllm.suspend_when_idle()  # continued by the next call into vLLM
        return entry

    async def wake_up(self, tags: list[str] | None = None) -> dict | None:
        """Wake `tags` (of "weights", "kv_cache"; None: all still asleep), weights first; generation
        resumes once nothing sleeps. Returns the phase-log entry; None if nothing was asleep."""
        await self.ready()
        wake = tags_to_wake(self._sleeping_tags, tags, self._weights_discarded)
        return await self._wake(wake) if wake else None

    async def _wake(self, tags: list[str]) -> dict:
        await self._vllm("wake_up", self.llm.wake_up(tags=tags))  # vLLM resumes scheduling once no tag sleeps
        self._sleeping_tags = [tag for tag in self._sleeping_tags if tag not in tags]
        self.asleep = bool(self._sleeping_tags)
        self._open_gate_if_ready()
        return await self._record("wake_up", tags=tags)

    def _open_gate_if_ready(self) -> None:
        """Let requests into vLLM again once no weight update is open and nothing sleeps."""
        if self._update is None and not self.asleep:
            self._gate.open()
            self._requests.note_activity(self._gate)

    # ---------------------------------------------------------------- phase log

    async def _record(self, phase: str, **details) -> dict:
        """Log a phase with the memory of vLLM's worker process (`VllmCalls.phase_memory`)."""
        return self.phases.record(phase, await self._vllm.phase_memory(phase), **details)

    def phase_log(self) -> list[dict]:
        """This engine's last phases (see `rlactors.runtime.phases`), oldest first."""
        return self.phases.entries()


def merged(per_worker: list[dict]) -> dict:
    return {name: value for worker in per_worker for name, value in worker.items()}


def create_engine(model_path: str, config: RolloutConfig, dtype: str = "auto", policy_version: int = 0,
                  seed: int = 0, max_restarts: int = 0, placement_options: dict | None = None,
                  weight_backend: str = RLACTORS_BACKEND, **options: Any):
    """Start a RolloutEngine actor (vLLM itself starts on the first `ready()` or other call).
    `placement_options` are its resources from the run's plan (`Placement.engine_options`); without
    them it asks for `tensor_parallel_size` GPUs when the cluster has GPUs."""
    resources = placement_options or unplaced_options(config.num_cpus_per_engine, config.tensor_parallel_size)
    actor_options = results_in_object_store({**resources, "max_restarts": max_restarts, "max_concurrency": 10_000,
                                             **options})
    return RolloutEngine.options(**actor_options).remote(model_path, config, dtype, policy_version, seed,
                                                         weight_backend)
