"""Checks that refuse an impossible run before Ray or any actor starts.

`build_run` calls them in this order, each as soon as what it reads exists:

    check_config(config, output_dir)            # the settings alone
    resume_from = check_resume_point(...)       # the checkpoint to load, checked against its manifest
    model_path = ensure_run_model(config.model, output_dir)
    check_model(config, model_path)             # the context fits the model
    warn_if_checkpoints_will_not_fit(config, model_path, output_dir)
    val_requests = check_prompts(config, tokenizer, dataset.rows, train_files, val_files)

Each refuses what would otherwise fail only at the first batch, after minutes of engine and
trainer start-up, or fail inside the engine for one prompt: a training temperature of 0, a
custom reward function that does not load, a resume path that is no checkpoint, a tracker in
pipeline.loggers whose package is missing, dynamic sampling over groups of one, fewer sequences
than mini-batches, a context longer than the model's, LoRA targets that match no layer of the
model, and a prompt that leaves no room for its response. A failure is a `PreflightError` naming the setting
(dotted path), file or prompt_id and the numbers involved. Nothing here starts Ray or an actor.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

from rlactors.config import Config, ConfigError
from rlactors.data import DataError, PromptRow, read_parquet_rows, to_request, tokenize_prompt
from rlactors.pipelines.checkpointing import (
    DRIVER_FILE,
    checkpoint_bytes,
    checkpoint_root,
    find_resume_point,
    free_bytes,
)
from rlactors.trainer import checkpoint
from rlactors.types import PromptRequest


class PreflightError(ConfigError, DataError):
    """The config, its model or its data make the run impossible. Both a `ConfigError` (the
    command line prints it without a traceback) and a `DataError` (a prompt can be the cause)."""


# --------------------------------------------------------------------------------------------
# The settings alone


def check_config(config: Config, output_dir: str | Path) -> None:
    """Cross-section settings that could only fail once the run is under way."""
    check_sampling(config)
    check_batches(config)
    check_reward_function(config.reward.custom_function)
    check_reward_models(config.reward.models)
    check_resume(config.pipeline.resume, output_dir)
    check_trackers(config.pipeline.loggers)


def check_trackers(loggers: list[str]) -> None:
    """A tracker whose package is missing would otherwise fail only when the first metrics are logged."""
    from rlactors.metrics.trackers import TrackerError, check_installed

    try:
        check_installed(loggers)
    except TrackerError as error:
        raise PreflightError(str(error)) from None


def check_sampling(config: Config) -> None:
    rollout, data = config.rollout, config.data
    if rollout.sampling.temperature <= 0:
        raise PreflightError(
            f"rollout.sampling.temperature={rollout.sampling.temperature}: training needs a temperature > 0 "
            "(the trainer's logprobs divide the logits by it, and greedy groups have no spread to learn from); "
            "greedy decoding belongs in rollout.validation_sampling.temperature"
        )
    for name, sampling in (("sampling", rollout.sampling), ("validation_sampling", rollout.validation_sampling)):
        if sampling.max_response_tokens >= rollout.max_model_len:
            raise PreflightError(
                f"rollout.{name}.max_response_tokens={sampling.max_response_tokens} leaves no room for a prompt "
                f"in rollout.max_model_len={rollout.max_model_len}"
            )
        if data.max_prompt_tokens is not None and data.max_prompt_tokens + sampling.max_response_tokens > rollout.max_model_len:
            raise PreflightError(
                f"data.max_prompt_tokens={data.max_prompt_tokens} + rollout.{name}.max_response_tokens="
                f"{sampling.max_response_tokens} = {data.max_prompt_tokens + sampling.max_response_tokens} > "
                f"rollout.max_model_len={rollout.max_model_len}: a prompt the data accepts could not be answered; "
                "lower one of the first two or raise the last (null data.max_prompt_tokens allows whatever fits)"
            )


def check_batches(config: Config) -> None:
    group_size = config.rollout.sampling.num_samples_per_prompt
    if config.buffer.dynamic_sampling and group_size < 2:
        raise PreflightError(
            f"buffer.dynamic_sampling rejects groups whose {config.buffer.dynamic_sampling_metric!r} has zero "
            f"variance, and every group of rollout.sampling.num_samples_per_prompt={group_size} has: no batch could "
            "ever fill; use groups of 2 or more or turn dynamic sampling off"
        )
    num_sequences = config.pipeline.batch_size_prompts * group_size
    if num_sequences < config.trainer.num_mini_batches:
        raise PreflightError(
            f"pipeline.batch_size_prompts={config.pipeline.batch_size_prompts} x rollout.sampling."
            f"num_samples_per_prompt={group_size} = {num_sequences} sequences per batch cannot make "
            f"trainer.num_mini_batches={config.trainer.num_mini_batches} mini-batches"
        )


def check_reward_function(spec: str | None) -> None:
    """A configured `reward.custom_function` imports, is callable, and takes veRL's four
    positional arguments (data_source, solution_str, ground_truth, extra_info)."""
    if spec is None:
        return
    from rlactors.reward.scoring import load_user_function

    try:
        function = load_user_function(spec)
    except Exception as error:  # user code: an import can raise anything
        raise PreflightError(f"reward.custom_function={spec!r} does not load: {type(error).__name__}: {error}") from None
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # some builtins have no signature to check
    try:
        signature.bind("data_source", "solution_str", "ground_truth", {})
    except TypeError as error:
        raise PreflightError(
            f"reward.custom_function={spec!r}: {function.__name__}{signature} cannot be called as "
            f"compute_score(data_source, solution_str, ground_truth, extra_info): {error}"
        ) from None


def check_reward_models(models: list) -> None:
    """Each of `reward.models` holds a model folder, and a judge's verdict function loads."""
    from rlactors.reward.model_scorer import located

    for index, model in enumerate(models):
        located(index, model)


def check_resume(resume: str, output_dir: str | Path) -> None:
    """`pipeline.resume` is "auto", "never", or a committed checkpoint (or a root whose `latest`
    names one); "auto" over a `latest` that names a missing checkpoint is refused too."""
    try:
        path = find_resume_point(resume, output_dir)
    except (FileNotFoundError, ValueError) as error:
        raise PreflightError(f"pipeline.resume={resume!r}: {error}") from None
    if path is not None and not (path / DRIVER_FILE).is_file():
        raise PreflightError(
            f"pipeline.resume={resume!r}: {path} is not a run checkpoint (no {DRIVER_FILE}); give a "
            "checkpoint directory (step_N) or its checkpoints/ root, or 'auto' / 'never'"
        )


def check_resume_point(resume: str, output_dir: str | Path, on_damaged: str = "stop") -> Path | None:
    """The checkpoint a resume will load, checked against its manifest before any actor starts
    (`rlactors.trainer.checkpoint.damage`). A damaged one stops the run with one line naming the
    folder and the file and the newest intact earlier checkpoint, and how to resume from it; with
    `on_damaged="previous"` (pipeline.on_damaged_checkpoint) the run resumes from that one."""
    path = find_resume_point(resume, output_dir)
    problem = checkpoint.damage(path) if path is not None else None
    if problem is None:
        return path
    earlier = [p for p in checkpoint.committed_checkpoints(path.parent)
               if checkpoint.step_of(p) <= checkpoint.step_of(path) and p != path and (p / DRIVER_FILE).is_file()]
    intact = next((p for p in reversed(earlier) if checkpoint.damage(p) is None), None)
    if intact is not None and on_damaged == "previous":
        print(f"checkpoint {path} is damaged ({problem}): resuming from {intact}, the newest intact one before it")
        return intact
    advice = (f"the newest intact checkpoint before it is {intact}: resume from it with pipeline.resume={intact} "
              "(or pipeline.on_damaged_checkpoint=previous)" if intact is not None else "no earlier checkpoint is intact")
    raise PreflightError(f"checkpoint {path} is damaged: {problem}; {advice}")


def warn_if_checkpoints_will_not_fit(config: Config, model_path: str | Path, output_dir: str | Path) -> int | None:
    """Print a warning when the run's checkpoint folder has less free space than one checkpoint
    takes: the last one's size when there is one, else about three times the model's weight files
    (the weights and Adam's two moments), twice that with a critic. Returns the estimate (None: the
    run writes no checkpoints)."""
    if config.pipeline.checkpoint_every_steps <= 0:
        return None
    root = checkpoint_root(output_dir)
    latest = checkpoint.latest_checkpoint(root) if root.is_dir() else None
    if latest is not None:
        needed, basis = checkpoint_bytes(latest), f"the last checkpoint, {latest.name}"
    else:
        weights = sum(file.stat().st_size for pattern in ("*.safetensors", "*.bin") for file in Path(model_path).glob(pattern))
        copies = 6 if config.algorithm.advantage == "gae" else 3
        needed, basis = copies * weights, f"about {copies}x the model's weight files (weights and Adam's moments)"
    free = free_bytes(root)
    if free < needed:
        print(f"warning: {root} has {free / (1 << 20):.0f} MiB free, and a checkpoint of this run takes "
              f"{needed / (1 << 20):.0f} MiB ({basis}): the checkpoint at step {config.pipeline.checkpoint_every_steps} "
              "will not fit unless space is freed")
    return needed


# --------------------------------------------------------------------------------------------
# The model


def model_context_tokens(model_path: str | Path) -> int | None:
    """The longest context the model's config.json declares (`max_position_embeddings`), or None
    when it declares none or scales it with RoPE (vLLM then derives a longer one itself). Never
    below what vLLM accepts: it may refuse less, never more (it also reads other keys)."""
    try:
        model = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = model.get("text_config") or model
    for key in ("rope_scaling", "rope_parameters"):
        scaling = text.get(key) or model.get(key)
        if isinstance(scaling, dict) and (scaling.get("factor") is not None
                                          or any(isinstance(v, dict) and v.get("factor") is not None
                                                 for v in scaling.values())):
            return None
    value = text.get("max_position_embeddings")
    if not isinstance(value, int) or value <= 0:
        return None
    # vLLM lets a `model_max_length` in config.json stretch the limit up to it.
    override = text.get("model_max_length")
    return max(value, override) if isinstance(override, int) else value


def check_model(config: Config, model_path: str | Path) -> None:
    """`rollout.max_model_len` within the model's context: vLLM refuses to start otherwise
    (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN says to go past it). Routing is recorded only for a
    mixture-of-experts model: the engines would fail to start finding no router; and replayed only
    through routers whose weighing the trainer knows (`check_router_rules`). LoRA's target
    modules match some layer of the model (`check_lora_targets`)."""
    check_lora_targets(config.model.lora, model_path)
    if config.rollout.record_routing:
        from rlactors.models.moe import is_moe_config

        try:
            model = json.loads((Path(model_path) / "config.json").read_text())
        except (OSError, ValueError):
            model = None
        if model is not None and not is_moe_config(model):
            raise PreflightError(
                f"trainer.routing_replay=rollout (rollout.record_routing) needs a mixture-of-experts model; the "
                f"model in {Path(model_path) / 'config.json'} ({model.get('model_type')}) has no experts"
            )
        if model is not None and config.trainer.routing_replay == "rollout":
            check_router_rules(model_path)
    limit = model_context_tokens(model_path)
    if limit is None or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0") not in ("", "0"):
        return
    if config.rollout.max_model_len > limit:
        raise PreflightError(
            f"rollout.max_model_len={config.rollout.max_model_len} > max_position_embeddings={limit} of the model "
            f"in {Path(model_path) / 'config.json'}: the engines would refuse to start"
        )


def check_lora_targets(lora, model_path: str | Path) -> None:
    """`model.lora.target_modules` match some layer of the model: otherwise each trainer rank fails
    putting the adapters on, after Ray and the engines have started. The adapters are put on a
    meta-device build of the model (its config.json alone, no weights read), as the trainer does."""
    if not lora.enabled:
        return
    from rlactors.placement.memory import adapter_parameter_count

    try:
        adapter_parameter_count(model_path, lora)
    except ValueError as error:  # names model.lora.target_modules (`rlactors.models.lora.add_adapters`)
        raise PreflightError(str(error)) from None


def check_router_rules(model_path: str | Path) -> None:
    """Every router class of the model (built on the meta device) has a rule in
    `rlactors.trainer.routing_replay.ROUTER_RULES`: replay through another would fail only at the
    first replayed forward pass, after the whole start-up; and a model whose routers replay does
    not find would silently route itself."""
    from rlactors.placement.memory import meta_model
    from rlactors.trainer.routing_replay import find_routers, router_rule

    config_file = Path(model_path) / "config.json"
    try:
        model = meta_model(model_path)
        routers = {type(router): router for _, router in find_routers(model)}.values()
        if not routers:
            raise ValueError(f"routing replay finds no top-k router (a ...TopKRouter module) in {type(model).__name__}")
        for router in routers:
            router_rule(router)
    except ValueError as error:
        raise PreflightError(f"trainer.routing_replay=rollout: the model in {config_file}: {error}") from None


# --------------------------------------------------------------------------------------------
# The prompts


def prompt_budget(config: Config, sampling_name: str) -> int:
    """Most prompt tokens a prompt answered with `rollout.<sampling_name>` may have."""
    rollout = config.rollout
    budget = rollout.max_model_len - getattr(rollout, sampling_name).max_response_tokens
    if config.data.max_prompt_tokens is not None:
        budget = min(budget, config.data.max_prompt_tokens)
    return budget


def _too_long_message(config: Config, sampling_name: str, kind: str, too_long: list[tuple[PromptRow, int]],
                      file: str) -> str:
    row, num_tokens = too_long[0]
    rollout, max_prompt_tokens = config.rollout, config.data.max_prompt_tokens
    response_tokens = getattr(rollout, sampling_name).max_response_tokens
    if max_prompt_tokens is not None and num_tokens > max_prompt_tokens:
        why = f"{num_tokens} tokens > data.max_prompt_tokens={max_prompt_tokens}"
    else:
        why = (f"{num_tokens} prompt tokens + rollout.{sampling_name}.max_response_tokens={response_tokens} = "
               f"{num_tokens + response_tokens} > rollout.max_model_len={rollout.max_model_len}")
    message = f"{kind} prompt_id {row.prompt_id!r} in {file}: {why}"
    if len(too_long) > 1:
        message += (f" (and {len(too_long) - 1} more {kind} prompts over the budget of {prompt_budget(config, sampling_name)} "
                    f"tokens, the longest {max(n for _, n in too_long)})")
    return message + "; shorten or remove these prompts, or raise rollout.max_model_len"


def _file_of(prompt_id: str, files: list[str], skip_bad_rows: bool) -> str:
    """The data file holding `prompt_id` (read again only to name it in an error)."""
    if len(files) == 1:
        return files[0]
    for path in files:
        if any(row.prompt_id == prompt_id for row in read_parquet_rows(path, skip_bad_rows)[0]):
            return path
    return " or ".join(files)


def check_prompts(config: Config, tokenizer, train_rows: list[PromptRow], train_files: list[str],
                  val_files: list[str]) -> list[PromptRequest]:
    """Tokenize every training and validation prompt as the driver will, refuse any that is empty or
    leaves too little room for its response; returns the validation requests."""
    data = config.data
    train_budget = prompt_budget(config, "sampling")
    too_long: list[tuple[PromptRow, int]] = []
    for row in train_rows:
        try:
            num_tokens = len(tokenize_prompt(row, tokenizer, data.chat_template))
        except DataError as error:
            raise PreflightError(f"{_file_of(row.prompt_id, train_files, data.skip_bad_rows)}: {error}") from None
        if num_tokens > train_budget:
            too_long.append((row, num_tokens))
    if too_long:
        file = _file_of(too_long[0][0].prompt_id, train_files, data.skip_bad_rows)
        raise PreflightError(_too_long_message(config, "sampling", "training", too_long, file))

    val_budget = prompt_budget(config, "validation_sampling")
    val_requests = []
    for path in val_files:
        requests, too_long = [], []
        for row in read_parquet_rows(path, data.skip_bad_rows)[0]:
            try:
                request = to_request(row, tokenizer, data.chat_template)
            except DataError as error:
                raise PreflightError(f"{path}: {error}") from None
            if len(request.prompt_token_ids) > val_budget:
                too_long.append((row, len(request.prompt_token_ids)))
            requests.append(request)
        if too_long:
            raise PreflightError(_too_long_message(config, "validation_sampling", "validation", too_long, path))
        val_requests += requests
    check_environments(config.rollout.environment.name,
                       [(row.prompt_id, getattr(row.extra_info, "environment", None)) for row in train_rows]
                       + [(request.prompt_id, request.extra_info.get("environment")) for request in val_requests])
    return val_requests


def check_environments(configured: str | None, row_specs: list[tuple[str, str | None]]) -> None:
    """Every environment the run will build (the configured one, and each a row names in
    `extra_info.environment`) loads; the error names the spec and the first prompt_id using it."""
    from rlactors.environments import load_environment

    first_use = {configured: "rollout.environment.name"} if configured else {}
    for prompt_id, spec in row_specs:
        if spec and spec not in first_use:
            first_use[spec] = f"prompt_id {prompt_id!r} (extra_info.environment)"
    for spec, where in first_use.items():
        try:
            load_environment(spec)
        except Exception as error:  # noqa: BLE001 - reported with where it was named
            raise PreflightError(f"{where}: {error}") from None
