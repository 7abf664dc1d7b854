"""Per-device memory estimate of a plan, from the model's `config.json`.

    num_parameters = count_parameters("/models/Qwen3-8B")          # exact, built on the meta device
    rows = estimate_memory(plan, config, num_parameters, device_memory_bytes=192 << 30)

What is counted, per device, in bytes (activations are not: they depend on micro-batch tokens):
- actor, critic: fp32 parameters, fp32 gradients and AdamW's two fp32 moments (16 bytes per
  parameter), sharded by FSDP over `trainer.num_workers` ranks;
- reference: fp32 parameters (4 bytes per parameter) over the same ranks;
- an actor with LoRA adapters (`model.lora`): the frozen base's fp32 parameters (4 bytes each) and
  16 bytes per adapter parameter; its base is the reference policy, so no reference is counted;
- rollout: the engine's weights in its dtype over its tensor-parallel ranks, and the KV-cache budget
  vLLM takes: `gpu_memory_utilization` x device memory minus those weights;
- reward models (`reward.models`): a classifier replica's weights in its dtype; a judge's engine takes
  `judge.gpu_memory_utilization` x device memory (its weights and KV cache), or its weights when the
  device size is not known.
Colocated devices are checked phase by phase: while the engines generate the trainer's state stays
on the device unless `trainer.offload`, and the reward models are there; while the trainer runs the
engines sleep (their weights and KV cache freed) and so do the reward models (a classifier in host
memory, a judge's engine asleep), so the trainer's state alone must fit. In async mode every role
holds its memory all run long.
"""

from __future__ import annotations

from pathlib import Path

from rlactors.placement.plan import ROLLOUT, ResourcePlan, reward_model_role

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BYTES_PER_PARAMETER = {"actor": 16, "critic": 16, "reference": 4}


def count_parameters(model_path: str | Path) -> int | None:
    """Parameters of the model folder's architecture (tied weights once), or None without a
    readable config.json. Built on torch's meta device: nothing is allocated or downloaded.
    An MoE model counts every expert: memory holds them all."""
    model = meta_model(model_path)
    return None if model is None else sum(parameter.numel() for parameter in model.parameters())


def parameter_counts(model_path: str | Path) -> tuple[int, int] | None:
    """(all parameters, those one token passes through: `rlactors.models.moe.active_parameters`)
    of the model folder's architecture, from one meta-device build; None without a config.json.
    A dense model's two counts are equal."""
    from rlactors.models.moe import active_parameters

    model = meta_model(model_path)
    return None if model is None else (sum(p.numel() for p in model.parameters()), active_parameters(model))


def adapter_parameter_count(model_path: str | Path, lora_config) -> int | None:
    """The trainable parameters of `model.lora`'s adapters on the model folder's architecture
    (peft's own layers on a meta-device build), or None without a config.json."""
    from rlactors.models.lora import add_adapters

    model = meta_model(model_path)
    if model is None:
        return None
    import torch

    with torch.device("meta"):
        add_adapters(model, lora_config)
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)


def reward_model_parameter_counts(config) -> dict[str, int | None]:
    """Each reward model's parameters (`reward.models`, by name; None without a readable config.json)."""
    counts = {}
    for model in config.reward.models:
        meta = meta_model(model.path, classifier=model.kind == "classifier")
        counts[model.name] = None if meta is None else sum(parameter.numel() for parameter in meta.parameters())
    return counts


def meta_model(model_path: str | Path, classifier: bool = False):
    """The model folder's architecture built on torch's meta device (nothing allocated or read but
    config.json), or None without a config.json; a config transformers cannot build is a ValueError."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        model_config = AutoConfig.from_pretrained(str(model_path), local_files_only=True)
        with torch.device("meta"):
            if classifier:
                return AutoModelForSequenceClassification.from_config(model_config)
            return AutoModelForCausalLM.from_config(model_config)
    except (ValueError, KeyError, OSError) as error:
        raise ValueError(f"{config_file}: cannot build the model: {error}") from error


def estimate_memory(plan: ResourcePlan, config, num_parameters: int, device_memory_bytes: int | None = None,
                    num_adapter_parameters: int = 0, reward_model_parameters: dict[str, int | None] | None = None
                    ) -> list[dict]:
    """One row per device: bytes per role, the KV-cache budget, peak bytes and whether it fits.
    `num_adapter_parameters`: those of the actor's LoRA adapters (`adapter_parameter_count`), if any;
    `reward_model_parameters`: each reward model's, by name (`reward_model_parameter_counts`; a model
    missing or None there is not counted)."""
    counts = reward_model_parameters or {}
    reward_model_bytes = {}
    for model in config.reward.models:
        weights = (counts.get(model.name) or 0) * DTYPE_BYTES[model.dtype]
        if model.kind == "judge" and device_memory_bytes is not None:
            weights = int(model.judge.gpu_memory_utilization * device_memory_bytes)
        reward_model_bytes[reward_model_role(model.name)] = weights
    rollout, trainer = config.rollout, config.trainer
    dtype = config.model.dtype if config.model.dtype != "auto" else ("bfloat16" if plan.device_kind == "gpu"
                                                                     else "float32")
    tp = rollout.tensor_parallel_size if plan.device_kind == "gpu" else 1
    offload = trainer.offload
    rows = []
    for bundle in plan.bundles:
        row: dict = {"node": bundle.node, "device": bundle.device}
        trainer_bytes = 0
        for slot in bundle.roles:
            if slot.role == ROLLOUT:
                row["rollout_weights_bytes"] = num_parameters * DTYPE_BYTES[dtype] // tp
            elif slot.role in reward_model_bytes:
                row["reward_models_bytes"] = row.get("reward_models_bytes", 0) + reward_model_bytes[slot.role]
            else:
                role_bytes = num_parameters * BYTES_PER_PARAMETER[slot.role]
                if slot.role == "actor" and config.model.lora.enabled:
                    role_bytes = num_parameters * BYTES_PER_PARAMETER["reference"] + num_adapter_parameters * 16
                row[f"{slot.role}_bytes"] = role_bytes // trainer.num_workers
                trainer_bytes += row[f"{slot.role}_bytes"]
        engine_bytes = row.get("rollout_weights_bytes", 0)
        if device_memory_bytes is not None and engine_bytes:
            engine_bytes = int(rollout.gpu_memory_utilization * device_memory_bytes)
            row["kv_cache_bytes"] = engine_bytes - row["rollout_weights_bytes"]
        reward_bytes = row.get("reward_models_bytes", 0)
        if plan.mode == "colocated":
            generating = engine_bytes + reward_bytes + (0 if offload else trainer_bytes)
            peak = max(generating, trainer_bytes)
        else:
            peak = engine_bytes + reward_bytes + trainer_bytes
        row["peak_bytes"] = peak
        if device_memory_bytes is not None:
            row["fits"] = peak <= device_memory_bytes and row.get("kv_cache_bytes", 1) > 0
        rows.append(row)
    return rows


def memory_verdict(rows: list[dict], device_memory_bytes: int | None) -> str:
    """"" when every device fits (or memory is unknown), else a one-line reason."""
    if device_memory_bytes is None:
        return ""
    for row in rows:
        if row.get("kv_cache_bytes", 1) <= 0:
            return (f"node {row['node']} device {row['device']}: the engine's weights "
                    f"({_gib(row['rollout_weights_bytes'])}) leave no KV cache within rollout.gpu_memory_utilization")
        if not row["fits"]:
            return (f"node {row['node']} device {row['device']}: needs about {_gib(row['peak_bytes'])} of "
                    f"{_gib(device_memory_bytes)} (set trainer.offload=true, lower rollout.gpu_memory_utilization, "
                    f"or add trainer ranks)")
    return ""


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.1f} GiB"
