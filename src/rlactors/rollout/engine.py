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

`generate(requests, sampling)`: `requests` is a list of `PromptRequest` (or an object ref of one,
which Ray resolves); `sampling` a `SamplingConfig`, a dict of its fields, or one of either per
request. It is a streaming generator (`num_returns="streaming"`): each `Group` is yielded as soon
as all its samples finish, so long responses never hold back the rest of the batch. Each sample is
its own vLLM request (`n` requests per prompt; the shared prompt hits vLLM's prefix cache). With
`with_summaries=True` each Group is followed by its `GroupSummary`, so the caller can route Groups
without reading them (the router does). Results are kept in the object store
(`rlactors.transport`), never sent inside the reply to the caller.

What a `Sample` holds: `response_token_ids`; `response_logprobs`, the engine's log-probabilities of
the sampled tokens under the *sampling* distribution (vLLM `logprobs_mode="processed_logprobs"`:
log_softmax(logits / temperature), renormalized over the top-k/top-p support when those are set;
at temperature 0 they are the unscaled model's log_softmax(logits)), which is what a trainer
computing log_softmax(logits / temperature) compares against; `token_policy_versions`, one per
token, taken from the labels vLLM's engine core attaches to every step (`WeightVersionSpan`), so
they are exact; `finish_reason` "stop" | "length" | "abort" | "error"; decoded `text`.

Weight updates go through vLLM's weight-transfer protocol, driven by a sender
(`rlactors.weight_sync`): `init_weight_transfer_engine` once per sender, then per sync
`start_weight_update(policy_version)` (generation pauses in vLLM), `update_weights` per bucket
(loaded through the model's own `load_weights` inside vLLM's layerwise reload) and
`finish_weight_update(policy_version)` (prefix cache dropped, version label set, generation
resumes). The transport is the engine's `weight_backend` (`rlactors.weight_sync.choice`). With
`partial_rollout` off the pause first lets in-flight requests finish (their tokens are all the old
version). With it on they are aborted and continued under the new weights from prompt + partial
response (`on_abort="resume"`, max_tokens reduced by what was produced; the response then carries
two versions), or restarted from the prompt (`on_abort="requeue"`). Requests arriving during an
update wait inside vLLM and run after. An update that never finishes (its sender died, a bucket
failed) leaves `weights_mixed` set and refuses the next start: such an engine must restart.

Sleep (colocated mode): `sleep()` pauses generation and, on CUDA/ROCm, frees the KV cache and
offloads the weights to host memory (`rollout.sleep_level` 1) or discards them (level 2); on CPU
vLLM cannot free memory, so it only pauses. `generate` while asleep raises. The wake order is
weights, new weights, KV cache: a weight update while asleep wakes the weights only (vLLM tag
"weights") and loads them, then `wake_up()` wakes the rest ("kv_cache") and generation resumes.
After a level-2 sleep, waking the weights without a load is an error (they hold nothing).

Phase log (`phase_log()`, see `rlactors.phases`): generate calls, sleep, each wake (with its tags)
and each weight load, with the memory of vLLM's worker process (which holds the device memory).

CPU placement: vLLM binds the model's OpenMP threads to its chosen cores; the actor pins its own
process, and so the engine-core process it starts, to the remaining cores (`health()` lists them as
`front_end_cpu_cores`), so neither preempts the model threads (`keep_front_end_off_model_cores`).

Failures (`rollout.engine_core`): if vLLM cannot start, `ready()` and every later call raise
RuntimeError("vLLM engine failed to start: <vLLM's own error>"); once the engine core dies, every
call (one waiting on it too) raises vLLM's EngineDeadError and `health()` gives the cause in `error`.
vLLM's processes die with the actor (`rlactors.rollout.vllm_plugin`).

Checkpoint (`state_dict`): the `policy_version` only. Weights belong to the trainer: after a
restore, or a restart, the trainer sends them again.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from typing import Any

import ray

from rlactors.config import RolloutConfig, SamplingConfig
from rlactors.device import default_dtype, detect_platform
from rlactors.phases import PhaseLog
from rlactors.placement.cluster import unplaced_options
from rlactors.rollout.engine_core import (
    Suspension,
    dead_detail,
    dead_error,
    prepare_environment,
    start_vllm,
    until_dead,
    worker_rss_bytes,
)
from rlactors.rollout.episode import environment_spec, run_episode
from rlactors.rollout.samples import (
    SamplingArg,
    check_prompt,
    error_group,
    extend_sample,
    resolve_sampling,
    sample_seed,
    summarize_group,
)
from rlactors.rollout.vllm_args import sampling_params
from rlactors.rollout.weights import check_bucket, inline_update_info
from rlactors.transport import results_in_object_store
from rlactors.types import Group, PromptRequest, Sample
from rlactors.weight_sync.choice import RLACTORS_BACKEND
from rlactors.weight_sync.layout import update_bytes

SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's sleep-mode allocation tags, in wake order
MEMORY_RPC_TIMEOUT_S = 30.0  # a memory reading is a few calls in the worker; past this the engine is stuck


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
        self.num_interrupted = 0  # responses cut by a weight update or sleep, then resumed or requeued
        self.llm = None
        self.vocab_size = 0
        self.front_end_cpu_cores: list[int] = []  # CPU: this process's cores, kept off the model's
        self._start_lock = asyncio.Lock()
        self._update: dict | None = None  # the weight update between start_ and finish_weight_update
        self._in_flight: dict[str, str] = {}  # vLLM request id -> group_id
        self._request_numbers = itertools.count()  # keeps vLLM request ids unique within this engine
        self._hf_tokenizer = None
        self._user_aborted: set[str] = set()  # group_ids whose samples must end as "abort"
        self._sleeping_tags: list[str] = []  # vLLM allocations asleep, of SLEEP_TAGS
        self._weights_discarded = False  # level-2 sleep: the weights hold nothing until a load
        self.phases = PhaseLog()
        self._suspension = Suspension()  # CPU: vLLM's processes stopped while asleep
        self._num_vllm_calls = 0  # calls into vLLM awaiting an answer: never stopped mid-way
        self._suspend_when_idle = False  # asleep with calls in flight: stop vLLM once the last returns

    # ---------------------------------------------------------------- lifecycle

    async def ready(self) -> dict:
        """Start the vLLM engine if not started; returns `health()` (raises: see Failures above)."""
        async with self._start_lock:
            if self.start_error is not None:
                raise RuntimeError(self.start_error)
            if self.llm is None:
                try:
                    self.llm, self.front_end_cpu_cores = start_vllm(self.model_path, self.config, self.platform,
                                                                    self.dtype, self.seed, self.error_file,
                                                                    self.weight_backend)
                except RuntimeError as error:
                    self.start_error = str(error)
                    raise
                self.vocab_size = self.llm.model_config.get_vocab_size()
                await self._vllm("ready", self.llm.update_weight_version(str(self.policy_version)))
        if self.llm.errored:
            raise dead_error(self.llm, "ready", self.error_file)
        return self.health()

    def health(self) -> dict:
        """Answers at once, also mid-generate or mid-update (a liveness probe); `error` says why not healthy."""
        errored = self.llm is not None and self.llm.errored
        return {
            "started": self.llm is not None,
            "healthy": self.llm is not None and not errored,
            "error": self.start_error or (dead_detail(self.llm, self.error_file) if errored else None),
            "policy_version": self.policy_version,
            "asleep": self.asleep,
            "weights_mixed": self.weights_mixed,
            "num_in_flight_samples": len(self._in_flight),
            "num_interrupted": self.num_interrupted,
            "platform": self.platform,
            "dtype": self.dtype,
            "front_end_cpu_cores": self.front_end_cpu_cores,
            "sleeping_tags": list(self._sleeping_tags),
            "pid": os.getpid(),
        }

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
        per_request = sampling if isinstance(sampling, list) else [sampling] * len(requests)
        if len(per_request) != len(requests):
            raise ValueError(f"got {len(per_request)} sampling settings for {len(requests)} requests")
        await self._record("generate", num_requests=len(requests))
        call_id = uuid.uuid4().hex[:8]  # keeps vLLM request ids unique if a group_id is sent twice
        tasks = [asyncio.create_task(self._run_group(request, setting, call_id))
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

    async def _run_group(self, request: PromptRequest, sampling: SamplingArg, call_id: str) -> Group:
        num_samples = self.config.sampling.num_samples_per_prompt
        try:
            setting = resolve_sampling(sampling, self.config.sampling)
            num_samples = setting.num_samples_per_prompt
            check_prompt(request, self.vocab_size, self.config.max_model_len)
            sampling_params(setting, setting.max_response_tokens, None)  # vLLM's own checks
        except Exception as error:  # noqa: BLE001 - reported on the group, the batch goes on
            return error_group(request, num_samples, f"prompt_id={request.prompt_id!r}: {error}")
        try:
            samples = await asyncio.gather(*(self._run_sample(request, i, setting, call_id)
                                             for i in range(num_samples)))
        finally:
            self._user_aborted.discard(request.group_id)
        return Group(request, list(samples))

    async def _run_sample(self, request: PromptRequest, sample_index: int, setting: SamplingConfig,
                          call_id: str) -> Sample:
        sample = Sample(request.prompt_id, sample_index, list(request.prompt_token_ids))
        spec = environment_spec(request, self.config.environment)
        if spec is not None:  # a multi-turn episode (rlactors.rollout.episode)
            tokenizer = self._tokenizer()
            await run_episode(sample, request, setting, self.config.environment, spec,
                              lambda s, max_tokens, stop: self._generate_turn(s, request, setting, max_tokens, stop,
                                                                              call_id, []),
                              tokenizer, self.config.max_model_len, self.policy_version)
            sample.text = tokenizer.decode(sample.response_token_ids, skip_special_tokens=True)
            return sample
        texts: list[str] = []
        sample.finish_reason = await self._generate_turn(sample, request, setting, setting.max_response_tokens,
                                                         list(setting.stop), call_id, texts)
        if setting.stop:
            sample.text = "".join(texts)
        else:
            sample.text = self.llm.tokenizer.decode(sample.response_token_ids, skip_special_tokens=True)
        return sample

    async def _generate_turn(self, sample: Sample, request: PromptRequest, setting: SamplingConfig, max_tokens: int,
                             stop: list[str], call_id: str, texts: list[str]) -> str:
        """Append up to `max_tokens` model tokens to `sample` (one response, or one turn of an
        episode) and return the finish reason; an interruption by a weight update or sleep resumes
        or restarts this turn (`on_abort`), never earlier ones. `texts` collects vLLM's text pieces."""
        from vllm.inputs.engine import tokens_input

        turn_start = sample.num_response_tokens
        while True:
            if request.group_id in self._user_aborted:
                return "abort"
            remaining = max_tokens - (sample.num_response_tokens - turn_start)
            if remaining <= 0:  # the interruption came exactly at the length limit
                return "length"
            seed = sample_seed(setting.seed, request.group_id, sample.sample_index, sample.num_response_tokens)
            params = sampling_params(setting, remaining, seed, stop)
            # A rendered token input: a raw prompt dict would make vLLM hop every request through
            # its tokenizer thread pool, although token prompts need no tokenizing.
            prompt = tokens_input(request.prompt_token_ids + sample.response_token_ids)
            request_id = f"{request.group_id}/{sample.sample_index}/{call_id}/{next(self._request_numbers)}"
            self._in_flight[request_id] = request.group_id
            final = None
            try:
                async for output in self.llm.generate(prompt, params, request_id):
                    final = output
            except Exception as error:
                from vllm.v1.engine.exceptions import EngineDeadError

                if isinstance(error, EngineDeadError):
                    # The actor is broken; the router restarts it and re-sends its requests.
                    raise dead_error(self.llm, "generate", self.error_file)  # noqa: B904
                sample.error = (f"prompt_id={request.prompt_id!r} sample {sample.sample_index}: "
                                f"{type(error).__name__}: {error}")
                return "error"
            finally:
                self._in_flight.pop(request_id, None)
            completion = final.outputs[0]
            interrupted = completion.finish_reason == "abort" and request.group_id not in self._user_aborted
            self.num_interrupted += interrupted
            if interrupted and self.config.on_abort == "requeue":
                for tokens in (sample.response_token_ids, sample.response_logprobs, sample.token_policy_versions):
                    del tokens[turn_start:]
                texts.clear()
                continue
            texts.append(extend_sample(sample, completion, self.policy_version))
            if not interrupted:
                return completion.finish_reason

    def _tokenizer(self):
        """The model's Hugging Face tokenizer (episodes decode turns, encode observations, render
        the chat template); loaded once."""
        if self._hf_tokenizer is None:
            from transformers import AutoTokenizer

            self._hf_tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._hf_tokenizer

    async def abort(self, group_ids: list[str] | None = None) -> int:
        """End the named groups' (or all) in-flight samples now with finish_reason "abort", keeping
        their tokens. Returns the number of vLLM requests aborted."""
        await self.ready()
        chosen = set(self._in_flight.values()) if group_ids is None else set(group_ids)
        self._user_aborted |= chosen
        request_ids = [rid for rid, gid in self._in_flight.items() if gid in chosen]
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
        await self._vllm("shutdown_weight_transfer", self.llm.shutdown_weight_transfer_engine())

    async def start_weight_update(self, policy_version: int) -> None:
        """Stop generating (or wake sleeping weights) and open a weight update to `policy_version`."""
        await self.ready()
        if policy_version < self.policy_version:
            raise ValueError(f"policy_version {policy_version} is older than the loaded {self.policy_version}")
        if self._update is not None:
            # vLLM's worker still holds that update open: only a fresh engine can take another.
            raise RuntimeError(f"the weight update to policy_version {self._update['policy_version']} never "
                               "finished: this engine must restart")
        self._update = {"policy_version": policy_version, "pause_start": time.perf_counter(),
                        "was_asleep": self.asleep, "weight_bytes": 0}
        if self.asleep:
            if "weights" in self._sleeping_tags:
                await self._wake(["weights"])  # the KV cache stays freed until wake_up()
        else:
            mode = "abort" if self.config.partial_rollout else "wait"  # see the module docstring
            await self._vllm("start_weight_update", self.llm.pause_generation(mode=mode, clear_cache=True))
        self._update["sync_start"] = time.perf_counter()
        self.weights_mixed = True  # from the first tensor loaded until finish_weight_update
        await self._vllm("start_weight_update", self.llm.start_weight_update())

    async def update_weights(self, update_info: dict) -> None:
        """Load one bucket: vLLM's update info of this engine's backend, or `{"bucket": ref}` of the
        object_store transport (the bucket is fetched here and its bytes passed on inline)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if self._update is None:
            raise RuntimeError("update_weights without start_weight_update")
        if "bucket" in update_info:
            bucket = update_info["bucket"]
            named_tensors = check_bucket(await bucket if isinstance(bucket, ray.ObjectRef) else bucket)
            update_info = inline_update_info(named_tensors, bool(update_info.get("digest")))
            del bucket, named_tensors
        self._update["weight_bytes"] += update_bytes(update_info)
        await self._vllm("update_weights", self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    async def finish_weight_update(self, policy_version: int) -> dict:
        """Close the update, label later tokens `policy_version`, resume generating. Returns timing:
        weight_sync_s (start to finish, without the wait for in-flight requests, which is pause_s)."""
        update = self._update
        if update is None or update["policy_version"] != policy_version:
            raise RuntimeError(f"finish_weight_update({policy_version}) without a matching start_weight_update")
        await self._vllm("finish_weight_update", self.llm.finish_weight_update())
        if self.weight_backend in ("nccl", "ipc"):
            await self._vllm("finish_weight_update", self.llm.collective_rpc("rlactors_refresh_tied_head"))
        await self._vllm("finish_weight_update", self.llm.reset_prefix_cache())  # KV of the old weights
        await self._vllm("finish_weight_update", self.llm.update_weight_version(str(policy_version)))
        self._update = None
        self.policy_version = policy_version
        self.weights_mixed = False
        self._weights_discarded = False
        await self._record("load_weights", policy_version=policy_version, weight_bytes=update["weight_bytes"])
        if not update["was_asleep"]:
            await self._vllm("finish_weight_update", self.llm.resume_generation())
        return {"policy_version": policy_version, "weight_sync_s": time.perf_counter() - update["sync_start"],
                "pause_s": update["sync_start"] - update["pause_start"]}

    async def load_weights(self, buckets: list, policy_version: int) -> dict:
        """A whole update pulled by the engine: object-store buckets (lists of (HF name, tensor), or
        their refs) loaded in one call, through the same protocol (a revived replica's reload when
        the weights were sent from a driver, not a trainer)."""
        await self.start_weight_update(policy_version)
        for bucket in buckets:
            await self.update_weights({"bucket": bucket})
        return await self.finish_weight_update(policy_version)

    async def weight_checksums(self) -> dict[str, str]:
        """vLLM's sha256 of every parameter as the engine holds it (its own layout), all workers."""
        return merged(await self._vllm("weight_checksums", self.llm.compute_weight_checksums()))

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
        await self._vllm("sleep", self.llm.sleep(level=level, mode="abort" if self.config.partial_rollout else "wait"))
        self.asleep = True
        self._sleeping_tags = list(SLEEP_TAGS)  # vLLM's executor marks both asleep at every level >= 1
        self._weights_discarded = level == 2
        entry = await self._record("sleep", level=level)
        if self.platform == "cpu" and self.config.suspend_while_asleep:
            self._suspend_when_idle = True
            self._suspend_if_idle()  # continued by the next call into vLLM (`_vllm`)
        return entry

    async def wake_up(self, tags: list[str] | None = None) -> dict | None:
        """Wake `tags` (of "weights", "kv_cache"; None: all still asleep), weights first; generation
        resumes once nothing sleeps. Returns the phase-log entry; None if nothing was asleep."""
        await self.ready()
        unknown = set(tags or ()) - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags {sorted(unknown)}: allowed values are {list(SLEEP_TAGS)}")
        wake = [tag for tag in self._sleeping_tags if tags is None or tag in tags]
        if "weights" in wake and self._weights_discarded:
            raise RuntimeError("the level-2 sleep discarded the weights: load new ones (a weight sync) before "
                               "wake_up, which then wakes the KV cache")
        return await self._wake(wake) if wake else None

    async def _wake(self, tags: list[str]) -> dict:
        await self._vllm("wake_up", self.llm.wake_up(tags=tags))  # vLLM resumes scheduling once no tag sleeps
        self._sleeping_tags = [tag for tag in self._sleeping_tags if tag not in tags]
        self.asleep = bool(self._sleeping_tags)
        return await self._record("wake_up", tags=tags)

    # ---------------------------------------------------------------- phase log

    async def _record(self, phase: str, **details) -> dict:
        """Log a phase with the memory of vLLM's (first) worker process, which holds the device memory;
        this front-end process has no device context, and making one would itself cost memory. On
        CPU that memory is the worker's resident set, read here without a call through vLLM."""
        if self.platform == "cpu":
            return self.phases.record(phase, {"host_rss_bytes": worker_rss_bytes()}, **details)
        memory = await self._vllm(phase, self.llm.collective_rpc("rlactors_memory", timeout=MEMORY_RPC_TIMEOUT_S))
        return self.phases.record(phase, memory[0], **details)

    async def _vllm(self, what: str, call):
        """Await a call into vLLM's engine core; EngineDeadError naming `what` if the core dies first."""
        self._suspension.resume()
        self._suspend_when_idle = False  # a new call: the engine is in use again until the next sleep
        self._num_vllm_calls += 1
        try:
            return await until_dead(self.llm, call, lambda: dead_error(self.llm, what, self.error_file))
        finally:
            self._num_vllm_calls -= 1
            self._suspend_if_idle()

    def _suspend_if_idle(self) -> None:
        """Stop vLLM's processes if asked by `sleep`, still asleep, and no call into vLLM is waiting."""
        if self._suspend_when_idle and self.asleep and not self._num_vllm_calls:
            self._suspend_when_idle = False
            self._suspension.suspend()

    def phase_log(self) -> list[dict]:
        """This engine's last phases (see `rlactors.phases`), oldest first."""
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
