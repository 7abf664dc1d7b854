"""The configuration sections of a run, one pydantic model per component, and `Config`, their root.
Every field has a description; unknown keys are errors (`Section`). Loading, overrides and error
messages: `rlactors.config.loading`; the algorithm's section: `rlactors.config.algorithm`."""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlactors.config.algorithm import AlgorithmConfig
from rlactors.config.lora import LoraConfig
from rlactors.config.reward_model import RewardModelConfig
from rlactors.config.section import Section

# What `pipeline.loggers` is when not set; tensorboard in it may be missing (see that field).
DEFAULT_LOGGERS = ("jsonl", "tensorboard")


class ModelConfig(Section):
    path: str = Field(
        ".cache/models/small",
        description="Local Hugging Face model folder (config.json, safetensors, tokenizer). "
        "A real checkpoint such as a Qwen3-8B folder loads through the same code. A folder without a "
        "model is an error, unless `build_if_missing` is on or the folder is inside pipeline.output_dir: "
        "then a random-init `preset` model is built there.",
    )
    preset: Literal["tiny", "small", "medium"] | None = Field(
        None,
        description="Size of the random-init model built at `path` when it is allowed to be built "
        "(tiny ~0.3M, small ~3M, medium ~110M params); null never builds one.",
    )
    build_if_missing: bool = Field(
        False, description="Build a random-init `preset` model at `path` if that folder is absent or empty "
        "(announced on stdout). Off, a `path` outside pipeline.output_dir without a model is an error, so a "
        "mistyped path never trains a new random model.",
    )
    architecture: Literal["qwen2", "qwen3", "qwen3_moe"] = Field(
        "qwen2", description="Architecture of a model built from `preset`: qwen3_moe gives every layer 8 experts, "
        "2 routed per token (see rlactors.models.MOE_SIZES).",
    )
    seed: int = Field(0, description="Seed of the random init of a model built from `preset`.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype for rollout and training; auto is float32 on CPU, bfloat16 on GPU."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters on the actor (rank 0: none).")

    @model_validator(mode="after")
    def _build_needs_a_preset(self) -> ModelConfig:
        if self.build_if_missing and self.preset is None:
            raise ValueError("model.build_if_missing needs model.preset (tiny or small): the size of the model to build")
        return self


class SamplingConfig(Section):
    num_samples_per_prompt: int = Field(8, ge=1, description="Responses generated per prompt (the group size).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling probability mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 disables it.")
    max_response_tokens: int = Field(8, ge=1, description="Most tokens generated per response.")
    stop: list[str] = Field(default_factory=list, description="Strings that end a response (not included).")
    seed: int | None = Field(None, description="Sampling seed; null draws a fresh one per request.")
    ignore_eos: bool = Field(
        False, description="Keep generating past end-of-sequence up to max_response_tokens (benchmarks)."
    )
    greedy_baseline: bool = Field(
        False, description="Also generate one greedy response per prompt, scored like the others and never trained: "
        "ReMax's baseline (`Group.baseline`). Set by algorithm.advantage=remax, which needs it."
    )


class ValidationSamplingConfig(SamplingConfig):
    """Validation sampling: greedy, one response per prompt, unless set otherwise. Its own defaults
    (not a default instance of SamplingConfig) so that setting one field keeps the others greedy."""

    num_samples_per_prompt: int = Field(1, ge=1, description="Responses generated per validation prompt.")
    temperature: float = Field(0.0, ge=0.0, description="Validation sampling temperature; 0 (greedy) by default.")


class EnvironmentConfig(Section):
    name: str | None = Field(
        None, description="Multi-turn environment of every prompt: a built-in (calculator, python, guess_number) or "
        "`path/to/module.py:Name` / `package.module:Name` (`rlactors.environments.protocol`). A row's "
        "`extra_info.environment` overrides it; null with no such row is single-turn generation.",
    )
    tool_call_format: Literal["plain", "hermes"] = Field(
        "plain", description="How tool calls are written: `[name input]` (plain, learnable by the tiny models) or "
        "Hermes/Qwen `<tool_call>{json}</tool_call>`.",
    )
    max_turns: int = Field(4, ge=1, description="Most model turns per episode.")
    max_turn_tokens: int | None = Field(
        None, ge=1, description="Most tokens of one model turn; null: the rest of sampling.max_response_tokens, which "
        "bounds the whole episode's response (model and observation tokens together).",
    )
    step_timeout_s: float = Field(
        30.0, gt=0, description="Most seconds an environment may take to start, reset or answer one turn; past it "
        "its process is killed and the sample fails with an error naming it.",
    )
    chat_template: bool | None = Field(
        None, description="Render observations as tool messages of the model's chat template (true) or insert "
        "them verbatim (false); null follows data.chat_template.",
    )


class RolloutConfig(Section):
    num_engines: int = Field(1, ge=1, description="vLLM engine replicas (data parallel).")
    tensor_parallel_size: int = Field(1, ge=1, description="Devices per engine (tensor parallel).")
    num_cpus_per_engine: float = Field(1.0, gt=0, description="Ray CPUs reserved per engine actor.")
    max_model_len: int = Field(256, ge=8, description="Longest prompt + response in tokens.")
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0,
        description="Share of device memory vLLM may use; on CPU the share of node memory it checks is free at start.",
    )
    cpu_kv_cache_bytes: int = Field(
        1 << 30, ge=1 << 26, description="KV cache size on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE)."
    )
    max_num_seqs: int | None = Field(
        None, ge=1, description="Most sequences an engine runs at once (vLLM's max_num_seqs; more wait in its queue). "
        "The engines' occupancy (`rollout/occupancy`) is their mean running sequences over this; async mode keeps "
        "enough groups in flight to fill it (pipeline.num_groups_in_flight). null: vLLM's default.",
    )
    cpu_cores: list[int] | None = Field(
        None, description="CPU only: cores the engine's compute threads are bound to (VLLM_CPU_OMP_THREADS_BIND); "
        "null keeps vLLM's own binding.",
    )
    enforce_eager: bool = Field(True, description="Skip CUDA graph / torch.compile capture.")
    log_engine_stats: bool = Field(
        False, description="vLLM's per-step statistics and periodic throughput log lines (they cost the engine's "
        "front-end CPU time every step; `vllm.LLM` keeps them off too)."
    )
    enable_sleep_mode: bool = Field(
        True, description="Let colocated engines free KV cache and weights while the trainer runs (GPU only)."
    )
    suspend_while_asleep: bool = Field(
        True, description="CPU only: stop (SIGSTOP) vLLM's engine-core and worker processes while the engine sleeps "
        "and continue them at its next call into vLLM. An idle vLLM CPU engine keeps polling and waking its threads, "
        "which takes cores from the trainer in colocated mode."
    )
    sleep_level: Literal[1, 2] = Field(
        1, description="vLLM sleep level of colocated engines: 1 offloads the weights to host memory and frees the "
        "KV cache; 2 discards the weights too (no host copy), fine because new weights are loaded before waking."
    )
    use_aiter: bool | None = Field(
        None, description="Switch on AMD AITER kernels (VLLM_ROCM_USE_AITER); null means on for ROCm, off elsewhere."
    )
    partial_rollout: bool = Field(
        False, description="On a weight update, interrupt in-flight responses and continue them with new weights."
    )
    weight_transport: Literal["auto", "nccl", "ipc", "shm", "object_store"] = Field(
        "auto", description="How weights go from the trainer to the engines: nccl (separate GPU pools), ipc "
        "(colocated GPUs), shm (shared memory, every engine on trainer rank 0's node), object_store (anywhere); "
        "auto picks by the plan (rlactors.weight_sync.choice).",
    )
    weight_bucket_bytes: int = Field(
        64 << 20, ge=1 << 16, description="Bytes of weights gathered and sent at a time; the buffers of a sync "
        "are about two of these on each side, or of the largest tensor (often the embedding) if bigger.",
    )
    verify_weight_sync: bool = Field(
        False, description="After every weight sync, compare the sha256 of each tensor the engines received with "
        "what the trainer sent (shm and object_store; costs a hash pass over the weights on both sides).",
    )
    record_routing: bool = Field(
        False, description="MoE models: record the experts every token is routed to, per layer, on each sample "
        "(for trainer.routing_replay=rollout, which sets it). Turns vLLM's prefix caching off, so every prompt "
        "position is computed and recorded per request.",
    )
    lora_rank: int = Field(
        0, ge=0, description="Serve the actor's LoRA adapter of this rank, replaced at every weight sync (set from "
        "model.lora unless it merges; 0: the engines hold merged or full weights).",
    )
    on_abort: Literal["resume", "requeue"] = Field(
        "resume", description="What happens to interrupted responses: continue from the partial response, or restart."
    )
    start_timeout_s: float = Field(
        600.0, gt=0, description="Most seconds an engine may take to start (vLLM loading the model): at the start of "
        "the run an error names a replica that takes longer; after a crash such a replica is given up as dead.",
    )
    call_timeout_s: float = Field(
        900.0, gt=0, description="Most seconds an engine may take to answer a weight update (which, without "
        "partial_rollout, first lets in-flight responses finish), sleep, wake-up or state load; past it an error "
        "names the replica and the call.",
    )
    stall_timeout_s: float = Field(
        300.0, gt=0, description="A replica whose generation yields no result for this long is asked health(); "
        "one busy with long responses answers and is left alone.",
    )
    health_timeout_s: float = Field(
        60.0, gt=0, description="A quiet replica that does not answer health() within this is hung: it is killed "
        "(Ray restarts it if it has restarts left) and its requests are re-sent to the others.",
    )
    environment: EnvironmentConfig = Field(
        default_factory=EnvironmentConfig, description="Multi-turn episodes: environment, tool calls, limits.",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Training-time sampling.")
    validation_sampling: ValidationSamplingConfig = Field(
        default_factory=ValidationSamplingConfig, description="Validation-time sampling (greedy by default).",
    )

    # What a started engine serves by and each run may change (requests, episodes, interruptions,
    # the router's timeouts, the trainer's side of weight syncs): an engine kept from another run
    # takes them anew (`RolloutEngine.new_run`). It keeps every other field it was started with.
    PER_RUN: typing.ClassVar[frozenset[str]] = frozenset({
        "sampling", "validation_sampling", "environment", "on_abort", "partial_rollout", "sleep_level",
        "start_timeout_s", "call_timeout_s", "stall_timeout_s", "health_timeout_s", "weight_bucket_bytes",
        "verify_weight_sync"})

    def start_settings(self) -> dict[str, Any]:
        """The fields an engine keeps from its start: two configs that agree on them can share engines."""
        return self.model_dump(mode="json", exclude=set(self.PER_RUN))


class OverlongConfig(Section):
    enable: bool = Field(False, description="Apply DAPO's soft overlong penalty.")
    buffer_tokens: int = Field(4, ge=1, description="Penalty ramps over the last this-many tokens before the limit.")
    penalty_factor: float = Field(1.0, ge=0.0, description="Penalty at the full response length limit.")


class RewardConfig(Section):
    num_workers: int = Field(1, ge=1, description="Reward scorer actors.")
    num_cpus_per_worker: float = Field(
        0.0, ge=0, description="Ray CPUs reserved per scorer actor; 0 lets scorers share CPUs with rollout and trainers."
    )
    max_groups_per_call: int = Field(
        16, ge=1, description="Most groups one scorer call takes when scoring a batch (amortizes the round trip)."
    )
    timeout_s: float = Field(5.0, gt=0, description="Per-sample scoring time limit; the scorer process is killed past it.")
    gsm8k_mode: Literal["strict", "flexible"] = Field(
        "strict", description="GSM8K extraction: number after '####' (strict) or last number (flexible)."
    )
    custom_function: str | None = Field(
        None, description="User scorer as 'module:function' or 'path/to/file.py:function' with veRL's signature."
    )
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description="DAPO overlong shaping.")
    max_failed_steps: int = Field(
        3, ge=0, description="Stop the run after this many steps in a row where scoring failed on every sample; 0 never stops."
    )
    function_weight: float = Field(
        1.0, description="Weight of the rule or user function's score in the reward (with `models`, the sum of the "
        "weighted parts; DAPO's overlong penalty is added to that sum).",
    )
    function_data_sources: list[str] | None = Field(
        None, description="Rows of these data sources are scored by the rule or user function; elsewhere its part is "
        "0 and it is not called (e.g. chat rows a reward model alone scores). None: every row; []: none.",
    )
    models: list[RewardModelConfig] = Field(
        default_factory=list, description="Reward models scoring beside the function, each adding its weighted part.",
    )

    @field_validator("models")
    @classmethod
    def _distinct_names(cls, models: list[RewardModelConfig]) -> list[RewardModelConfig]:
        names = [model.name for model in models]
        repeated = sorted({name for name in names if names.count(name) > 1} | {"function"} & set(names))
        if repeated:
            raise ValueError(f"reward model names must be distinct and not 'function' (the function's part): {repeated}")
        return models


class BufferConfig(Section):
    max_staleness: int = Field(
        0, ge=0, description="Hard bound on trainer version minus a sample's oldest version; 0 is on-policy."
    )
    staleness_threshold: float = Field(
        0.0, ge=0.0, description="Producers may run ahead by (1 + this) x samples per weight sync."
    )
    on_stale: Literal["reissue", "drop"] = Field(
        "reissue", description="Groups evicted for staleness have their prompts re-issued or recorded dropped."
    )
    max_reissues: int = Field(
        3, ge=0, description="Times one prompt may be re-issued after stale evictions before it is recorded dropped."
    )
    dynamic_sampling: bool = Field(False, description="DAPO: reject groups whose metric has zero variance.")
    dynamic_sampling_metric: Literal["score", "acc"] = Field(
        "score", description="Metric whose zero variance rejects a group."
    )
    max_generation_rounds: int = Field(
        10, ge=1, description="Most generation rounds spent filling one training batch under dynamic sampling; "
        "also, rounds in which every group failed in rollout before the run stops with the latest error."
    )
    ledger_flush_rows: int = Field(
        10_000, ge=1, description="Finished ledger rows and events the buffer holds in memory before appending "
        "them to the run's ledger log (output_dir/ledger); a checkpoint appends whatever is waiting."
    )


class OptimConfig(Section):
    lr: float = Field(5e-4, gt=0, description="Peak learning rate of AdamW.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up optimizer steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Schedule after warm-up.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of the peak lr.")
    total_steps: int = Field(1000, ge=1, description="Optimizer steps the schedule spans.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon (added to the root of the second moment).")


class TrainerConfig(Section):
    num_workers: int = Field(1, ge=1, description="FSDP ranks (Ray actors) in each trainer group.")
    num_cpus_per_worker: float = Field(1.0, gt=0, description="Ray CPUs reserved per trainer rank.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Policy optimizer.")
    critic_optim: OptimConfig = Field(default_factory=OptimConfig, description="Critic optimizer (PPO).")
    num_mini_batches: int = Field(1, ge=1, description="Optimizer steps per training batch per epoch.")
    num_epochs: int = Field(1, ge=1, description="Passes over each training batch (PPO epochs).")
    max_tokens_per_micro_batch: int = Field(
        8192, ge=1, description="Token budget of one packed micro-batch (gradient accumulation beyond it)."
    )
    cpu_cores: list[int] | Literal["all"] | None = Field(
        None, description="CPU only: cores every trainer rank's threads are pinned to, one torch thread each; "
        "'all': every core the rank's process may use; null: no pinning, num_cpus_per_worker threads, except a "
        "one-rank trainer in colocated mode, which takes 'all' (the engines sleep while it trains)."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    routing_replay: Literal["trainer", "rollout"] = Field(
        "trainer", description="MoE models, whose routing the trainer's forward passes (old logprobs, reference, "
        "update) use: 'rollout' sends every token to the experts the rollout engine chose for it (recorded with "
        "rollout.record_routing, which this sets), weighted by the trainer's own router; 'trainer': its own top-k.",
    )
    router_aux_loss_coef: float = Field(
        0.0, ge=0.0, description="MoE models: weight of the router's load-balancing loss (transformers' aux_loss, "
        "1.0 when balanced) added to the actor's loss; 0 leaves it out.",
    )
    offload: bool = Field(
        False, description="Colocated mode: trainer ranks keep parameters and optimizer state in host memory while "
        "the engines generate, moving them onto the device for the logprob/value passes and the update and off "
        "again after the weight export (veRL-style time-sharing of every device). The async driver ignores it."
    )
    collective_timeout_s: float = Field(
        600.0, gt=0, description="Bound on one collective of a trainer group's process group (the rendezvous, "
        "all-gathers, reduce-scatters, all-reduces, barriers): a rank whose peers do not join within it raises "
        "instead of waiting (torch's defaults: 30 min on gloo, 10 on NCCL). A collective also waits for the "
        "slowest rank's work before it (a long micro-batch, a checkpoint shard write), hence minutes, not seconds. "
        "A rank that raises or dies needs no timeout: the group stops at its error."
    )
    call_timeout_s: float = Field(
        3600.0, gt=0, description="Bound on one call of a trainer group (start-up, a forward pass or update over a "
        "batch, a weight export, a checkpoint): past it the error names the call and the ranks not done, and every "
        "rank of the group is killed. For a rank hung outside any collective; generous, as a big batch's update "
        "is slow."
    )


class DataConfig(Section):
    train_files: list[str] = Field(
        default_factory=list, description="veRL-schema parquet files; empty uses the synthetic `task`."
    )
    val_files: list[str] = Field(default_factory=list, description="Validation parquet files; empty uses the synthetic `task`.")
    task: Literal["arithmetic", "gsm8k", "math", "calculator", "python", "guess_number", "tools", "countdown"] = Field(
        "arithmetic", description="Synthetic task when no files are given. calculator, python and guess_number "
        "rows name their environment in extra_info.environment; tools interleaves the three. countdown "
        "(`12,...,01=` -> `12,11,...,01`) has long-tailed answer lengths (median ~30 tokens, p99 ~8x, <= 297).",
    )
    num_train_rows: int = Field(4000, ge=1, description="Rows of the synthetic training set.")
    num_val_rows: int = Field(200, ge=1, description="Rows of the synthetic validation set.")
    chat_template: bool = Field(
        False, description="Format prompts with the tokenizer's chat template; off joins message contents."
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Longer prompts are an error naming the prompt_id; with the larger "
        "max_response_tokens it must fit rollout.max_model_len. Null: whatever leaves room for the response.",
    )
    skip_bad_rows: bool = Field(False, description="Skip and count malformed rows instead of failing.")
    shuffle: bool = Field(True, description="Shuffle each epoch from the seed.")
    seed: int = Field(0, description="Shuffle and generator seed.")


class PipelineConfig(Section):
    mode: Literal["colocated", "async"] = Field("colocated", description="Time-share devices, or separate pools.")
    num_steps: int = Field(20, ge=1, description="Training steps to run.")
    batch_size_prompts: int = Field(16, ge=1, description="Prompts (groups) per training step.")
    trigger_parameter_sync_step: int = Field(
        1, ge=1, description="Async mode: trainer updates between weight publications."
    )
    val_every_steps: int = Field(10, ge=0, description="Validate every this many steps (0: only at start and end).")
    checkpoint_every_steps: int = Field(0, ge=0, description="Checkpoint every this many steps (0: never).")
    keep_checkpoints: int | None = Field(
        None, ge=1, description="Keep only the newest this many checkpoints, deleting older ones after each new "
        "one is committed (never the one `latest` names); null keeps all.",
    )
    export_hf_every_steps: int = Field(
        0, ge=0, description="Also write the actor as a Hugging Face folder (output_dir/hf/step_N) every this many "
        "steps; the run always writes one at its end (0: only then).",
    )
    output_dir: str = Field(
        "outputs/run", description="Metrics, plots and checkpoints go here. Made absolute once by the driver; on a "
        "multi-node cluster it must be a path every node sees (a shared filesystem), which the driver checks.",
    )
    placement_timeout_s: float = Field(
        120.0, gt=0, description="Most seconds to wait for the run's placement groups (its devices and CPUs) "
        "before failing with the resources that are missing.",
    )
    num_groups_in_flight: int | None = Field(
        None, ge=1, description="Async mode: groups the producer keeps generating at once, topping up once a quarter "
        "of them finished (within the staleness quota and the buffer's backpressure), so the engines never wait for "
        "a batch's longest response. null: enough to fill every engine's "
        "max_num_seqs with the groups' samples, and at least batch_size_prompts. "
        "Long-tailed responses: about twice that (a group is topped up only once its longest sample ends).",
    )
    batch_timeout_s: float | None = Field(
        None, gt=0, description="Async mode: most seconds the trainer waits for its next batch while no group reaches "
        "the replay buffer (kept or dropped); past it the run stops, saying what the producer, the buffer and each "
        "rollout replica were doing. null: rollout.stall_timeout_s + rollout.health_timeout_s + "
        "rollout.start_timeout_s + the scoring of one group (reward.timeout_s per sample): a hung engine found, "
        "restarted, and a group scored.",
    )
    resume: str = Field("auto", description="'auto' (latest checkpoint in output_dir if any), 'never', or a checkpoint path.")
    on_damaged_checkpoint: Literal["stop", "previous"] = Field(
        "stop", description="When the checkpoint a resume would load is damaged (a file missing, truncated or changed "
        "since it was written, by its manifest): stop before any actor starts, naming the file and the newest "
        "intact earlier checkpoint, or resume from that one ('previous').")
    seed: int = Field(0, description="Global seed.")
    verbose: bool = Field(
        False, description="Show every INFO line of vLLM, Ray and transformers on the terminal, and known-harmless "
        "warnings (also `--verbose`). Either way each process's full log lands under output_dir/logs.",
    )
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: list(DEFAULT_LOGGERS),
        description="Where step metrics go, under the same names in each (`reward/mean`, `val/<source>/acc`, ...), "
        "with the resolved config logged once at start. jsonl (output_dir/metrics.jsonl) must stay in the list: "
        "the driver reads it back for the plot. tensorboard writes output_dir/tensorboard; when the list is jsonl "
        "and tensorboard alone (the default) it is skipped if torch.utils.tensorboard does not import, otherwise "
        "that is an error. wandb and mlflow need `pip install 'rlactors[trackers]'` (a missing one is an error "
        "before the run starts); wandb follows WANDB_MODE (offline: files under output_dir/wandb), mlflow "
        "MLFLOW_TRACKING_URI (unset: a local store in output_dir/mlruns).",
    )
    project: str = Field(
        "rlactors", min_length=1, description="wandb project and mlflow experiment the run is logged under."
    )
    run_name: str | None = Field(
        None, description="Run name in wandb and mlflow; null: the folder name of output_dir."
    )

    @field_validator("loggers")
    @classmethod
    def _jsonl_stays(cls, loggers: list[str]) -> list[str]:
        if "jsonl" not in loggers:
            raise ValueError("must include 'jsonl' (output_dir/metrics.jsonl, which the driver reads back for "
                             "the plot); add the other trackers beside it")
        return list(dict.fromkeys(loggers))


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model to train.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt data.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="vLLM rollout engines.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward scoring.")
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="Replay buffer.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="FSDP trainers.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages and losses.")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Driver loop.")

    @model_validator(mode="after")
    def _observations_render_like_prompts(self) -> Config:
        if self.rollout.environment.chat_template is None:
            self.rollout.environment.chat_template = self.data.chat_template
        return self

    @model_validator(mode="after")
    def _replay_has_its_record(self) -> Config:
        if self.trainer.routing_replay == "rollout":
            self.rollout.record_routing = True
        return self

    @model_validator(mode="after")
    def _engines_serve_the_adapter(self) -> Config:
        lora = self.model.lora
        self.rollout.lora_rank = lora.rank if lora.enabled and not lora.merge else 0
        if self.rollout.lora_rank and self.rollout.sleep_level == 2:
            raise ValueError("rollout.sleep_level=2 discards the engines' base weights, which a LoRA run's "
                             "adapter-only sync cannot restore: use rollout.sleep_level=1 or model.lora.merge=true")
        return self

    @model_validator(mode="after")
    def _remax_has_its_baseline(self) -> Config:
        sampling = self.rollout.sampling
        if self.algorithm.advantage == "remax":
            sampling.greedy_baseline = True
        elif sampling.greedy_baseline:
            raise ValueError("rollout.sampling.greedy_baseline is ReMax's baseline: only algorithm.advantage=remax "
                             f"uses it, not {self.algorithm.advantage}")
        return self


