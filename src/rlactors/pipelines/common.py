"""The pieces every driver is made of: plain functions over the actors.

A driver (colocated.py, fully_async.py, or your own notebook cell) reads as: build the `Run`, then
loop `produce` -> `sample` -> `prepare_batch` -> `update` -> `sync_weights`, validating and
checkpointing every few steps. Nothing here holds state of its own beyond the `Run` record.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import torch

from rlactors import algorithms
from rlactors.buffer import ReplayBuffer
from rlactors.config import Config, dump_config
from rlactors.data import PromptDataset, read_parquet_rows, to_request
from rlactors.metrics import MetricsLogger, plot_metrics
from rlactors.models import ensure_model, load_tokenizer
from rlactors.reward.scorer import RewardPool
from rlactors.rollout.router import RolloutRouter
from rlactors.synthetic import write_task
from rlactors.trainer.batch import TrainBatch, response_mask, train_batch_from_groups
from rlactors.trainer.group import TrainerGroup
from rlactors.types import Group, PromptRequest


def init_ray() -> None:
    """Connect to the cluster in RAY_ADDRESS (or the `ray job submit` job's), else start a local Ray."""
    if ray.is_initialized():
        return
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env={"env_vars": env})
    else:
        ray.init(include_dashboard=False, runtime_env={"env_vars": env})


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Run:
    """Everything a driver touches. `policy_version` counts weight publications to the engines."""

    config: Config
    output_dir: Path
    tokenizer: object
    dataset: PromptDataset
    val_requests: list[PromptRequest]
    router: RolloutRouter
    reward: RewardPool
    buffer: ray.actor.ActorHandle
    actor: TrainerGroup
    reference: TrainerGroup | None = None
    critic: TrainerGroup | None = None
    kl_controller: object = None
    num_devices: int = 1  # devices (or CPU workers) the run occupies, for per-device throughput
    step: int = 0
    policy_version: int = 0

    def shutdown(self) -> None:
        for trainer in (self.actor, self.reference, self.critic):
            if trainer is not None:
                trainer.shutdown()
        for engine in self.router.engines:
            ray.kill(engine)
        self.reward.shutdown()
        ray.kill(self.buffer)


def data_files(config: Config, output_dir: Path) -> tuple[list[str], list[str]]:
    """The configured parquet files, or the synthetic task written under the output dir."""
    data = config.data
    if data.train_files:
        return list(data.train_files), list(data.val_files)
    train, test = write_task(data.task, output_dir / "data", data.num_train_rows, data.num_val_rows, seed=data.seed)
    return [str(train)], list(data.val_files) or [str(test)]


def requests_for(rows, tokenizer, config: Config) -> list[PromptRequest]:
    """Tokenize rows; a prompt too long or empty is an error naming its prompt_id, before any actor starts."""
    return [to_request(row, tokenizer, config.data.chat_template, config.data.max_prompt_tokens) for row in rows]


def build_run(config: Config, model_path: str | None = None) -> Run:
    """Validate data, build the model if asked, then start every actor the config needs."""
    output_dir = Path(config.pipeline.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, output_dir / "config.yaml")
    seed_everything(config.pipeline.seed)
    model_path = str(model_path or ensure_model(config.model.path, config.model.preset, config.model.seed,
                                                config.model.architecture))
    tokenizer = load_tokenizer(model_path)
    train_files, val_files = data_files(config, output_dir)
    dataset = PromptDataset.from_files(train_files, seed=config.data.seed, shuffle=config.data.shuffle,
                                       skip_bad_rows=config.data.skip_bad_rows)
    requests_for(dataset.rows, tokenizer, config)  # every training prompt checked up front
    val_rows = [row for path in val_files for row in read_parquet_rows(path, config.data.skip_bad_rows)[0]]
    val_requests = requests_for(val_rows, tokenizer, config)

    init_ray()
    algorithm, sampling = config.algorithm, config.rollout.sampling
    norm_tokens = algorithm.loss_norm_tokens or sampling.max_response_tokens
    actor = TrainerGroup("actor", model_path, config.trainer, algorithm, seed=config.pipeline.seed, norm_tokens=norm_tokens)
    needs_reference = algorithm.use_kl_loss or algorithm.use_kl_in_reward
    reference = TrainerGroup("reference", model_path, config.trainer, algorithm) if needs_reference else None
    critic = (TrainerGroup("critic", model_path, config.trainer, algorithm, seed=config.pipeline.seed, norm_tokens=norm_tokens)
              if algorithm.advantage == "gae" else None)
    # Engines restart after a crash (Ray re-runs the constructor) and the router reloads the
    # current weights into them before they get work again.
    router = RolloutRouter.create(model_path, config.rollout, max_restarts=1, dtype=config.model.dtype)
    router.ready()
    reward = RewardPool(config.reward, max_response_tokens=sampling.max_response_tokens)
    buffer = ReplayBuffer.remote(config.buffer, config.pipeline.batch_size_prompts,
                                 config.pipeline.trigger_parameter_sync_step)
    kl_controller = (algorithms.AdaptiveKLController(algorithm.kl_coef, algorithm.kl_target, algorithm.kl_horizon)
                     if algorithm.kl_controller == "adaptive" else algorithms.FixedKLController(algorithm.kl_coef))
    num_rollout_devices = config.rollout.num_engines * config.rollout.tensor_parallel_size
    num_devices = (max(num_rollout_devices, config.trainer.num_workers) if config.pipeline.mode == "colocated"
                   else num_rollout_devices + config.trainer.num_workers)
    return Run(config, output_dir, tokenizer, dataset, val_requests, router, reward, buffer, actor, reference, critic,
               kl_controller, num_devices)


# --------------------------------------------------------------------------------------------
# Rollout side


def feed_prompts(run: Run, num_prompts: int) -> None:
    """Hand the buffer the next `num_prompts` prompts from the data cursor, each stamped with the
    epoch it belongs to (a batch that crosses an epoch boundary is added in two parts: the ledger
    counts each prompt once per epoch)."""
    dataset = run.dataset
    while num_prompts > 0:
        at_end = dataset.position == len(dataset)
        epoch = dataset.epoch + 1 if at_end else dataset.epoch
        take = min(num_prompts, len(dataset) if at_end else len(dataset) - dataset.position)
        rows = dataset.next_batch(take)
        ray.get(run.buffer.add_prompts.remote(requests_for(rows, run.tokenizer, run.config), epoch))
        num_prompts -= take


def produce(run: Run, max_groups: int, producer_id: str = "driver", timeout_s: float | None = None) -> int:
    """Reserve prompts, generate, score each group as it arrives, and put it in the buffer.
    Returns the number of groups produced (0: nothing could be reserved)."""
    requests = ray.get(run.buffer.reserve.remote(max_groups, producer_id, timeout_s))
    if not requests:
        return 0
    puts = [run.buffer.put.remote([run.reward.score(group_ref)]) for group_ref in run.router.generate(requests)]
    ray.get(puts)
    return len(requests)


# --------------------------------------------------------------------------------------------
# Trainer side


def prepare_batch(run: Run, groups: list[Group]) -> tuple[TrainBatch, dict[str, float]]:
    """Old/reference logprobs, values, token rewards and advantages for one batch of groups."""
    algorithm, temperature = run.config.algorithm, run.config.rollout.sampling.temperature
    groups = sorted(groups, key=lambda g: g.group_id)  # a fixed order, whatever order they finished in
    batch = train_batch_from_groups(groups)
    metrics: dict[str, float] = {}
    batch.set_field("old_logprobs", run.actor.compute_logprobs(batch, temperature)["logprobs"])
    mask = response_mask(batch.response_lengths)
    # How far the engine's sampling distribution is from the trainer's (precision, kernels, stale
    # weights): the KL estimate E[log p_rollout - log p_trainer] over the sampled tokens.
    rollout, _ = batch.padded_field("rollout_logprobs")
    old, _ = batch.padded_field("old_logprobs")
    metrics["rollout/trainer_kl"] = float(algorithms.masked_mean(rollout - old, mask))
    metrics["rollout/logprob_abs_diff_max"] = float(((rollout - old).abs() * mask).max()) if mask.any() else 0.0
    token_rewards = algorithms.scores_to_token_rewards(torch.tensor(batch.scores), mask)
    if run.reference is not None:
        batch.set_field("ref_logprobs", run.reference.compute_logprobs(batch, temperature)["logprobs"])
        if algorithm.use_kl_in_reward:
            ref, _ = batch.padded_field("ref_logprobs")
            token_rewards, current_kl = algorithms.apply_kl_in_reward(token_rewards, old, ref, mask,
                                                                      run.kl_controller.value, algorithm.kl_penalty)
            run.kl_controller.update(float(current_kl), num_steps=len(batch))
            metrics |= {"actor/reward_kl_penalty": float(current_kl), "actor/reward_kl_coef": run.kl_controller.value}
    group_ids = torch.tensor(batch.group_ids)
    if algorithm.advantage == "gae":
        batch.set_field("values", run.critic.compute_values(batch))
        values, _ = batch.padded_field("values")
        advantages, returns = algorithms.gae_advantages(token_rewards, values, mask, algorithm.gamma, algorithm.lam)
        batch.set_padded_field("returns", returns)
    elif algorithm.advantage == "rloo":
        advantages = algorithms.rloo_advantages(token_rewards, mask, group_ids)
    else:
        advantages = algorithms.grpo_advantages(token_rewards, mask, group_ids, norm_by_std=algorithm.norm_by_std)
    batch.set_padded_field("advantages", advantages)
    return batch, metrics


def update(run: Run, batch: TrainBatch) -> dict[str, float]:
    temperature = run.config.rollout.sampling.temperature
    metrics = run.critic.update_critic(batch) if run.critic is not None else {}
    return metrics | run.actor.update_policy(batch, temperature)


def publish_weights(run: Run) -> dict[str, float]:
    """Send the actor's current weights to every engine, labelled `run.policy_version`."""
    start = time.perf_counter()
    refs, num_bytes = run.actor.export_weights()
    run.router.update_weights(refs, run.policy_version)
    del refs  # the buckets live in rank 0's object store until dropped
    ray.get(run.buffer.set_policy_version.remote(run.policy_version))
    elapsed = time.perf_counter() - start
    return {"timing_s/weight_sync": elapsed, "weight_sync/bytes_per_s": num_bytes / max(elapsed, 1e-9)}


def sync_weights(run: Run) -> dict[str, float]:
    """After an update: bump `policy_version` and publish."""
    run.policy_version += 1
    return publish_weights(run)


# --------------------------------------------------------------------------------------------
# Metrics, validation


def rollout_metrics(groups: list[Group], staleness: list[int], max_response_tokens: int) -> dict[str, float]:
    samples = [s for g in groups for s in g.samples]
    lengths = np.array([s.num_response_tokens for s in samples], dtype=float)
    scores = np.array([s.score for s in samples], dtype=float)
    accuracy = [float(s.score_details["acc"]) for s in samples if "acc" in s.score_details]
    metrics = {
        "reward/mean": float(scores.mean()),
        "reward/num_score_errors": float(sum(s.score_error is not None for s in samples)),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= max_response_tokens).mean()),
        "staleness/mean": float(np.mean(staleness)) if staleness else 0.0,
        "staleness/max": float(max(staleness)) if staleness else 0.0,
    }
    if accuracy:
        metrics["reward/acc"] = float(np.mean(accuracy))
    return metrics


def validate(run: Run) -> dict[str, float]:
    """Greedy (by default) accuracy per data source on the validation prompts."""
    if not run.val_requests:
        return {}
    sampling = run.config.rollout.validation_sampling
    scored = ray.get([run.reward.score(ref) for ref in run.router.generate(run.val_requests, sampling)])
    per_source: dict[str, list[float]] = {}
    for group in scored:
        for sample in group.samples:
            value = sample.score_details.get("acc", sample.score)
            per_source.setdefault(group.request.data_source, []).append(float(value or 0.0))
    return {f"val/{source}/acc": float(np.mean(values)) for source, values in sorted(per_source.items())}


def throughput(groups: list[Group], step_s: float, num_devices: int) -> float:
    num_tokens = sum(len(s.prompt_token_ids) + s.num_response_tokens for g in groups for s in g.samples)
    return num_tokens / max(step_s, 1e-9) / max(num_devices, 1)




# --------------------------------------------------------------------------------------------
# The parts of a step loop every driver shares


def begin(run: Run, history: list[dict]) -> MetricsLogger:
    """Resume if asked (re-sending the restored weights to the engines), open the metrics log,
    and validate once before the first step of a fresh run (appended to `history` as step 0)."""
    from rlactors.pipelines.checkpointing import find_resume_point, load_run

    resume_from = find_resume_point(run.config.pipeline.resume, run.output_dir)
    if resume_from is not None:
        load_run(run, resume_from)
        publish_weights(run)  # the engines started from the model folder
        print(f"resumed from {resume_from} at step {run.step}, policy_version {run.policy_version}")
    logger = MetricsLogger(run.output_dir, run.config.pipeline.num_steps, append=resume_from is not None)
    if run.step == 0:
        metrics = validate(run)
        logger.log(0, metrics)
        history.append({"step": 0, **metrics})
    return logger


def end_step(run: Run, logger: MetricsLogger, sampled, metrics: dict[str, float], timings: dict[str, float]) -> dict:
    """Count the step, add rollout metrics and timings, validate and checkpoint when due, log."""
    from rlactors.pipelines.checkpointing import save_run

    pipeline = run.config.pipeline
    run.step += 1
    metrics |= rollout_metrics(sampled.groups, sampled.staleness, run.config.rollout.sampling.max_response_tokens)
    metrics |= {f"timing_s/{name}": seconds for name, seconds in timings.items()}
    metrics["throughput/tokens_per_s_per_device"] = throughput(sampled.groups, timings["step"], run.num_devices)
    metrics["policy_version"] = run.policy_version
    if (pipeline.val_every_steps and run.step % pipeline.val_every_steps == 0) or run.step == pipeline.num_steps:
        metrics |= validate(run)
    if pipeline.checkpoint_every_steps and run.step % pipeline.checkpoint_every_steps == 0:
        save_run(run)
    logger.log(run.step, metrics)
    return {"step": run.step, **metrics}


def finish(run: Run, logger: MetricsLogger) -> None:
    logger.close()
    png = plot_metrics(logger.path, run.output_dir / "metrics.png")
    print(f"metrics: {logger.path}\nplot: {png}")
