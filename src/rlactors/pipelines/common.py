"""The pieces every driver is made of: plain functions over the actors.

A driver (colocated.py, fully_async.py, or your own notebook cell) reads as: build the `Run`, then
loop `produce` -> `sample` -> `prepare_batch` -> `update` -> `sync_weights`, validating and
checkpointing every few steps. Nothing here holds state of its own beyond the `Run` record.

Rollout data never passes through the driver: Groups go engine -> scorer -> buffer -> batch builder
-> trainer ranks as object refs, and the driver reads summaries (ids, lengths, scores, staleness),
metrics and counts (`benchmarks/driver_bytes.py` measures it).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import torch

from rlactors import algorithms, preflight
from rlactors.buffer import ReplayBuffer
from rlactors.buffer.ledger_log import LEDGER_FOLDER
from rlactors.buffer.records import SampledBatchRef
from rlactors.config import Config, TrainerConfig, dump_config
from rlactors.data import PromptDataset, to_request
from rlactors.device import default_dtype
from rlactors.metrics import MetricsLogger, plot_metrics
from rlactors.models import ensure_run_model, load_tokenizer
from rlactors.pipelines.batch_builder import BatchBuilder
from rlactors.pipelines.teardown import run_parts, stop_all
from rlactors.placement import trainer_roles
from rlactors.placement.cluster import Placement, check_visible_everywhere, plan_for_cluster
from rlactors.reward.scorer import RewardPool
from rlactors.rollout.router import RolloutRouter
from rlactors.synthetic import write_task
from rlactors.trainer.batch import TrainBatchRef
from rlactors.trainer.group import TrainerGroup
from rlactors.types import PromptRequest
from rlactors.waits import get_within
from rlactors.weight_sync.choice import WeightSyncSettings, choose_for_plan

# Assembling a batch and its advantages is bookkeeping on data already in the object store: seconds
# even at scale; past this the builder is stuck.
BUILDER_TIMEOUT_S = 600.0
# The buffer answers from memory (reserve and sample add their own, explicit waits): past this it is stuck.
BUFFER_TIMEOUT_S = 300.0


def init_ray() -> None:
    """Connect to the cluster in RAY_ADDRESS (or the `ray job submit` job's), else start a local Ray."""
    if ray.is_initialized():
        return
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env={"env_vars": env})
    else:
        # A new local instance: a bare ray.init() would join whatever `ray start` left running here.
        ray.init(address="local", include_dashboard=False, runtime_env={"env_vars": env})


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
    placement: Placement | None = None  # the run's plan and placement groups
    builder: ray.actor.ActorHandle | None = None  # BatchBuilder: train batches and validation, off the driver
    weight_sync: WeightSyncSettings | None = None  # how the actor's weights reach the engines
    step: int = 0
    policy_version: int = 0

    @property
    def num_devices(self) -> int:
        """Devices (GPUs, or CPU bundles) the run occupies, for per-device throughput."""
        return self.placement.plan.num_devices if self.placement is not None else 1

    def shutdown(self) -> None:
        """Stop every actor (trainer ranks, engines, reward scorers, buffer, builder), each bounded
        and killed if it fails or hangs, then release the placement groups; the errors are
        reported once everything is down (`rlactors.pipelines.teardown`)."""
        stop_all(run_parts((self.actor, self.reference, self.critic), self.router, self.reward, self.buffer,
                           self.builder), self.placement)


def data_files(config: Config, output_dir: Path) -> tuple[list[str], list[str]]:
    """The configured parquet files, or the synthetic task written under the output dir."""
    data = config.data
    if data.train_files:
        return list(data.train_files), list(data.val_files)
    train, test = write_task(data.task, output_dir / "data", data.num_train_rows, data.num_val_rows, seed=data.seed)
    return [str(train)], list(data.val_files) or [str(test)]


def requests_for(rows, tokenizer, config: Config) -> list[PromptRequest]:
    """Tokenize rows; a prompt too long or empty is an error naming its prompt_id (`rlactors.preflight`
    checks every prompt this way before any actor starts)."""
    return [to_request(row, tokenizer, config.data.chat_template, config.data.max_prompt_tokens) for row in rows]


def trainer_settings(config: Config, device_kind: str) -> TrainerConfig:
    """The trainer settings the run's ranks get: on CPU in colocated mode a one-rank trainer left
    unpinned (`trainer.cpu_cores` null) uses every core its process may use, since the engines
    sleep while it trains; with one thread per reserved CPU it would leave the others idle."""
    trainer = config.trainer
    if (device_kind == "cpu" and config.pipeline.mode == "colocated" and trainer.cpu_cores is None
            and trainer.num_workers == 1):
        return trainer.model_copy(update={"cpu_cores": "all"})
    return trainer


def build_run(config: Config, model_path: str | None = None) -> Run:
    """Validate data, build the model if asked, plan the run on the cluster and reserve its
    devices, then start every actor the config needs in its place."""
    output_dir = Path(config.pipeline.output_dir).absolute()  # once: every actor on every node gets this path
    output_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, output_dir / "config.yaml")
    seed_everything(config.pipeline.seed)
    # An impossible run is refused here, before Ray or any actor starts (see rlactors.preflight).
    preflight.check_config(config, output_dir)
    model_path = str(model_path or ensure_run_model(config.model, output_dir))
    preflight.check_model(config, model_path)
    tokenizer = load_tokenizer(model_path)
    train_files, val_files = data_files(config, output_dir)
    dataset = PromptDataset.from_files(train_files, seed=config.data.seed, shuffle=config.data.shuffle,
                                       skip_bad_rows=config.data.skip_bad_rows)
    val_requests = preflight.check_prompts(config, tokenizer, dataset.rows, train_files, val_files)

    init_ray()
    plan = plan_for_cluster(config)  # a run that cannot fit fails here, naming what is missing
    check_visible_everywhere(output_dir, plan)
    # A transport the plan cannot serve is refused here, before any device is reserved.
    transport = choose_for_plan(config.rollout.weight_transport, plan, config.rollout.num_engines,
                                config.pipeline.mode == "colocated")
    placement = Placement.reserve(plan, config.pipeline.placement_timeout_s)
    trainers: dict[str, TrainerGroup] = {}
    router = reward = buffer = builder = None
    try:
        algorithm, sampling = config.algorithm, config.rollout.sampling
        norm_tokens = algorithm.loss_norm_tokens or sampling.max_response_tokens
        trainer_config = trainer_settings(config, plan.cluster.device_kind)
        for role in trainer_roles(config):
            trainers[role] = TrainerGroup(role, model_path, trainer_config, algorithm, seed=config.pipeline.seed,
                                          norm_tokens=norm_tokens, placement=placement)
        if config.trainer.offload and config.pipeline.mode == "colocated":
            # Before the engines start: vLLM claims its share of the device only if it is free, and
            # the first generation then has the device to itself.
            for group in trainers.values():
                group.offload()
        # Engines restart after a crash (Ray re-runs the constructor, in the same bundles) and the
        # trainer sends them the current weights before they get work again (set_weight_loader below).
        router = RolloutRouter.create(model_path, config.rollout, max_restarts=1, placement=placement,
                                      dtype=config.model.dtype, weight_backend=transport.vllm_backend)
        router.ready()
        reward = RewardPool(config.reward, max_response_tokens=sampling.max_response_tokens)
        buffer = ReplayBuffer.options(**placement.near("actor")).remote(
            config.buffer, config.pipeline.batch_size_prompts, config.pipeline.trigger_parameter_sync_step,
            ledger_dir=str(output_dir / LEDGER_FOLDER))
        builder = BatchBuilder.options(**placement.near("actor")).remote(algorithm)
    except BaseException:
        # Everything started so far, in and outside the placement groups; the error stays the one raised.
        stop_all(run_parts(trainers.values(), router, reward, buffer, builder), placement)
        raise
    kl_controller = (algorithms.AdaptiveKLController(algorithm.kl_coef, algorithm.kl_target, algorithm.kl_horizon)
                     if algorithm.kl_controller == "adaptive" else algorithms.FixedKLController(algorithm.kl_coef))
    # The dtype weights travel in: the engines' (what `auto` means where they run), known here
    # without asking an engine (one may be restarting) and not asked by every trainer rank.
    engine_dtype = (config.model.dtype if config.model.dtype != "auto"
                    else default_dtype("cpu" if plan.cluster.device_kind == "cpu" else "cuda"))
    weight_sync = WeightSyncSettings(transport.transport, config.rollout.weight_bucket_bytes, engine_dtype,
                                     config.rollout.call_timeout_s, config.rollout.tensor_parallel_size,
                                     config.rollout.verify_weight_sync)
    actor = trainers["actor"]
    router.set_weight_loader(lambda targets, version: actor.send_weights_ref(targets, version, weight_sync))
    print(f"weight transport: {transport.transport} ({transport.reason})")
    return Run(config, output_dir, tokenizer, dataset, val_requests, router, reward, buffer, actor,
               trainers.get("reference"), trainers.get("critic"), kl_controller, placement, builder, weight_sync)


# --------------------------------------------------------------------------------------------
# Rollout side


def ask_buffer(run: Run, method: str, *args, wait_s: float | None = None):
    """`run.buffer.<method>(*args)`, answered within BUFFER_TIMEOUT_S plus the call's own wait
    `wait_s` (reserve, sample), or a TimeoutError naming the call. A dead buffer raises Ray's
    ActorDiedError, which names the ReplayBuffer and why it died."""
    return get_within(getattr(run.buffer, method).remote(*args), BUFFER_TIMEOUT_S + (wait_s or 0.0),
                      f"replay_buffer.{method}")


def buffer_wait_ran_out(error: BaseException) -> bool:
    """Whether `error` is the buffer's own bounded wait ending empty-handed (reserve or sample with a
    timeout: not now, ask again), as opposed to a stuck or dead buffer."""
    return isinstance(error, ray.exceptions.RayTaskError) and isinstance(error, TimeoutError)


def scoring_bound_s(config: Config, num_groups: int, num_samples: int) -> float:
    """The longest scoring `num_groups` groups can take with every sample running into the reward
    time limit, one after the other; past it a scorer is stuck."""
    return BUFFER_TIMEOUT_S + num_groups * num_samples * config.reward.timeout_s


def feed_prompts(run: Run, num_prompts: int) -> None:
    """Hand the buffer the next `num_prompts` prompts from the data cursor, each stamped with the
    epoch it belongs to (a batch that crosses an epoch boundary is added in two parts: the ledger
    counts each prompt once per epoch). Under the data set's lock, so a checkpoint taken from
    another thread sees the cursor and the buffer agree (`rlactors.pipelines.checkpointing`)."""
    dataset = run.dataset
    with dataset.lock:
        while num_prompts > 0:
            at_end = dataset.position == len(dataset)
            epoch = dataset.epoch + 1 if at_end else dataset.epoch
            take = min(num_prompts, len(dataset) if at_end else len(dataset) - dataset.position)
            rows = dataset.next_batch(take)
            ask_buffer(run, "add_prompts", requests_for(rows, run.tokenizer, run.config), epoch)
            num_prompts -= take


def produce(run: Run, max_groups: int, producer_id: str = "driver", timeout_s: float | None = None) -> int:
    """Reserve prompts, generate, score each group as it arrives, and put it in the buffer (the
    Groups travel as refs: engine -> scorer -> buffer). Returns the number of groups produced (0:
    nothing could be reserved, within `timeout_s` when given)."""
    try:
        requests = ask_buffer(run, "reserve", max_groups, producer_id, timeout_s, wait_s=timeout_s)
    except TimeoutError as error:
        if timeout_s is not None and buffer_wait_ran_out(error):
            return 0  # backpressure: the producers are as far ahead as the staleness bound allows
        raise
    if not requests:
        return 0
    puts = [run.buffer.put.remote([run.reward.score(group_ref)]) for _, group_ref in run.router.generate_refs(requests)]
    num_samples = run.config.rollout.sampling.num_samples_per_prompt
    get_within(puts, scoring_bound_s(run.config, len(puts), num_samples), "replay_buffer.put of scored groups")
    return len(requests)


# --------------------------------------------------------------------------------------------
# Trainer side


def prepare_batch(run: Run, sampled: SampledBatchRef) -> tuple[TrainBatchRef, dict[str, float]]:
    """Old/reference logprobs, values, token rewards and advantages for one sampled batch. The
    batch builder assembles the batch and computes the advantages from the trainers' rows; the
    driver passes refs along and receives lengths and metrics (see `rlactors.pipelines.batch_builder`)."""
    algorithm, temperature = run.config.algorithm, run.config.rollout.sampling.temperature
    timings: dict[str, float] = {}
    with timed(timings, "assemble"):
        batch = get_within(run.builder.assemble.remote(sampled.groups_ref), BUILDER_TIMEOUT_S,
                           "batch_builder.assemble")
    # One trainer after the other, as they would run with the rows fetched here: colocated roles
    # share devices, and three forward passes at once would need three times the activations.
    # Each returns once all its ranks finished, or raises naming the rank that failed.
    old_rows = ref_rows = value_rows = None
    if not old_logprobs_from_update(run.config):
        with timed(timings, "old_log_prob"):
            old_rows = run.actor.logprob_rows(batch, temperature)
    if run.reference is not None:
        with timed(timings, "ref"):
            ref_rows = run.reference.logprob_rows(batch, temperature)
    if algorithm.advantage == "gae":
        with timed(timings, "values"):
            value_rows = run.critic.value_rows(batch)
    kl_coef = run.kl_controller.value if algorithm.use_kl_in_reward else None
    with timed(timings, "adv"):
        batch, metrics, current_kl = get_within(
            run.builder.finish.remote(batch.ref, old_rows, ref_rows, value_rows, kl_coef), BUILDER_TIMEOUT_S,
            "batch_builder.finish")
    metrics |= timings
    if current_kl is not None:
        run.kl_controller.update(current_kl, num_steps=len(batch))
        metrics |= {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_coef": run.kl_controller.value}
    return batch, metrics


def update(run: Run, batch: TrainBatchRef) -> dict[str, float]:
    temperature = run.config.rollout.sampling.temperature
    timings: dict[str, float] = {}
    metrics = {}
    if run.critic is not None:
        with timed(timings, "update_critic"):
            metrics = run.critic.update_critic(batch)
    with timed(timings, "update_actor"):
        actor = run.actor.update_policy(batch, temperature)
    # Without an old-logprob pass the update measured the rollout/trainer gap (`old_logprobs_from_update`).
    for name in ("trainer_kl", "logprob_abs_diff_max"):
        if f"actor/rollout_{name}" in actor:
            actor[f"rollout/{name}"] = actor.pop(f"actor/rollout_{name}")
    return metrics | actor | timings


def old_logprobs_from_update(config: Config) -> bool:
    """Whether the update takes its own logprobs as old ones instead of a pass before it: asked
    (`algorithm.old_logprobs: auto`) and equal by construction. Colocated, the batch was generated
    with the actor's current weights; with one mini-batch and one epoch they stay so until the
    update's only optimizer step; and no KL penalty in the reward needs them before the update."""
    trainer, algorithm = config.trainer, config.algorithm
    return (algorithm.old_logprobs == "auto" and config.pipeline.mode == "colocated"
            and trainer.num_mini_batches == 1 and trainer.num_epochs == 1 and not algorithm.use_kl_in_reward)


@contextlib.contextmanager
def timed(timings: dict[str, float], phase: str):
    """Add the seconds the block takes to `timings["timing_s/<phase>"]` (veRL's names where it has one)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing_s/{phase}"
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def publish_weights(run: Run) -> dict[str, float]:
    """Send the actor's current weights to every live engine, labelled `run.policy_version` (an
    engine the sync fails on is restarted and gets them then, `weight_sync_done`)."""
    start = time.perf_counter()
    targets = run.router.weight_sync_targets(run.policy_version)
    stats = run.actor.send_weights(targets, run.policy_version, run.weight_sync)
    run.router.weight_sync_done(targets, stats)
    ask_buffer(run, "set_policy_version", run.policy_version)
    elapsed = time.perf_counter() - start
    return {"timing_s/weight_sync": elapsed, "weight_sync/bytes_per_s": stats["weight_bytes"] / max(elapsed, 1e-9),
            "weight_sync/num_failed_engines": float(len(stats["failed"]))}


def sync_weights(run: Run) -> dict[str, float]:
    """After an update: bump `policy_version` and publish."""
    run.policy_version += 1
    return publish_weights(run)


# --------------------------------------------------------------------------------------------
# Metrics, validation


def rollout_metrics(sampled: SampledBatchRef, max_response_tokens: int) -> dict[str, float]:
    """Reward, length and staleness metrics of a sampled batch, from the numbers the buffer sent,
    and the prompts the buffer dropped since the previous batch, by kind (rollout_error,
    zero_variance, stale)."""
    lengths = np.array(sampled.response_lengths, dtype=float)
    scores = np.array(sampled.scores, dtype=float)
    accuracy = [value for value in sampled.accuracies if value is not None]
    staleness = sampled.staleness
    metrics = {
        "reward/mean": float(scores.mean()),
        "reward/num_score_errors": float(sampled.num_score_errors),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= max_response_tokens).mean()),
        "staleness/mean": float(np.mean(staleness)) if staleness else 0.0,
        "staleness/max": float(max(staleness)) if staleness else 0.0,
        **{f"buffer/num_dropped_{kind}": float(count) for kind, count in sampled.num_dropped.items()},
    }
    if accuracy:
        metrics["reward/acc"] = float(np.mean(accuracy))
    return metrics


def validate(run: Run) -> dict[str, float]:
    """Greedy (by default) accuracy per data source on the validation prompts."""
    if not run.val_requests:
        return {}
    sampling = run.config.rollout.validation_sampling
    scored = [run.reward.score(ref) for _, ref in run.router.generate_refs(run.val_requests, sampling)]
    bound_s = scoring_bound_s(run.config, len(scored), sampling.num_samples_per_prompt)
    accuracy = get_within(run.builder.validation_accuracy.remote(*scored), bound_s,  # the groups are read there
                          "batch_builder.validation_accuracy")
    return {f"val/{source}/acc": value for source, value in accuracy.items()}


def throughput(sampled: SampledBatchRef, step_s: float, num_devices: int) -> float:
    num_tokens = sum(sampled.prompt_lengths) + sum(sampled.response_lengths)
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


def end_step(run: Run, logger: MetricsLogger, sampled: SampledBatchRef, metrics: dict[str, float],
             timings: dict[str, float]) -> dict:
    """Count the step, add rollout metrics and timings, validate and checkpoint when due, log."""
    from rlactors.pipelines.checkpointing import save_run

    pipeline = run.config.pipeline
    run.step += 1
    metrics |= rollout_metrics(sampled, run.config.rollout.sampling.max_response_tokens)
    run.reward.check_step(len(sampled.scores), sampled.num_score_errors, sampled.groups_ref)  # stops a run scoring nothing
    metrics |= {f"timing_s/{name}": seconds for name, seconds in timings.items()}
    metrics["throughput/tokens_per_s_per_device"] = throughput(sampled, timings["step"], run.num_devices)
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
