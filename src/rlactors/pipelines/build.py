"""Building a run: the `Run` record every driver touches, and `build_run`, which validates the data
and the config, plans the run on the cluster, reserves its devices and starts every actor in its
place. The step functions over a `Run` are in `rlactors.pipelines.common`.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import ray
import torch

from rlactors import algorithms
from rlactors.buffer.client import BufferClient
from rlactors.buffer.ledger_log import LEDGER_FOLDER
from rlactors.config import Config, TrainerConfig, dump_config
from rlactors.data import PromptDataset, to_request
from rlactors.data.synthetic import write_task
from rlactors.models import ensure_run_model, load_tokenizer
from rlactors.pipelines import preflight
from rlactors.pipelines.batch_builder import BatchBuilder
from rlactors.pipelines.teardown import run_parts, stop_all
from rlactors.pipelines.warm import WarmActors, engine_key, trainer_key
from rlactors.placement import trainer_roles
from rlactors.placement.cluster import Placement, check_visible_everywhere, plan_for_cluster
from rlactors.reward.pool import RewardPool
from rlactors.rollout.router import RolloutRouter
from rlactors.runtime import logs
from rlactors.runtime.device import default_dtype
from rlactors.trainer.group import TrainerGroup
from rlactors.types import PromptRequest
from rlactors.weight_sync.adapters import adapter_dir
from rlactors.weight_sync.choice import WeightSyncSettings, choose_for_plan


def init_ray(log_dir: Path | None = None, verbose: bool = False) -> None:
    """Connect to the cluster in RAY_ADDRESS (or the `ray job submit` job's), else start a local Ray.
    Every process of the run logs in full under `log_dir`, and the terminal gets warnings and
    errors only unless `verbose` (`rlactors.runtime.logs`). A Ray already started is left as it is."""
    if ray.is_initialized():
        return
    env = {"TOKENIZERS_PARALLELISM": "false", **logs.set_up_driver(log_dir, verbose)}
    options = {"runtime_env": {"env_vars": env, "worker_process_setup_hook": logs.SETUP_HOOK},
               "logging_level": logging.INFO if verbose else logging.WARNING}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**options)
    else:
        # A new local instance: a bare ray.init() would join whatever `ray start` left running here.
        ray.init(address="local", include_dashboard=False, **options)
    if log_dir is not None:
        logs.link_ray_logs(log_dir)


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
    buffer: BufferClient
    actor: TrainerGroup
    reference: TrainerGroup | None = None
    critic: TrainerGroup | None = None
    kl_controller: object = None
    placement: Placement | None = None  # the run's plan and placement groups
    builder: ray.actor.ActorHandle | None = None  # BatchBuilder: train batches and validation, off the driver
    weight_sync: WeightSyncSettings | None = None  # how the actor's weights reach the engines
    # Engines and trainer groups kept between runs (`rlactors.pipelines.warm`): where they go back at
    # the end, the engines' key, and whether this run took them (they hold the last run's weights
    # until `begin` sends these).
    warm: WarmActors | None = None
    engine_key: tuple | None = None
    engines_taken: bool = False
    finished: bool = False  # the last step done and logged (`finish`): only then are trainer groups kept
    resume_from: Path | None = None  # the checkpoint `begin` loads, checked before any actor started
    step: int = 0
    policy_version: int = 0
    exported_step: int | None = None  # the step of this process's last Hugging Face export

    @property
    def num_devices(self) -> int:
        """Devices (GPUs, or CPU bundles) the run occupies, for per-device throughput."""
        return self.placement.plan.num_devices if self.placement is not None else 1

    def shutdown(self) -> None:
        """Stop every actor (trainer ranks, engines, reward scorers, buffer, builder), each bounded
        and killed if it fails or hangs, then release the placement groups; the errors are
        reported once everything is down (`rlactors.pipelines.teardown`). With `warm`, the engines
        and their placement go back to it instead, unless a replica failed (`WarmActors.keep`), and
        with them the trainer groups of a finished run."""
        groups = [group for group in (self.actor, self.reference, self.critic) if group is not None]
        healthy = {trainer_key(group.role, group.trainer): group for group in groups
                   if self.finished and group.stopped is None}
        kept = self.warm is not None and self.warm.keep(self.engine_key, self.placement, self.router, healthy)
        stop_all(run_parts([group for group in groups if not (kept and group in healthy.values())],
                           None if kept else self.router, self.reward, self.buffer, self.builder),
                 None if kept else self.placement)
        if self.weight_sync is not None and self.weight_sync.adapter_dir:  # a LoRA run's adapter folders
            shutil.rmtree(self.weight_sync.adapter_dir, ignore_errors=True)


def data_files(config: Config, output_dir: Path) -> tuple[list[str], list[str]]:
    """The configured parquet files, or the synthetic task written under the output dir."""
    data = config.data
    if data.train_files:
        return list(data.train_files), list(data.val_files)
    train, test = write_task(data.task, output_dir / "data", data.num_train_rows, data.num_val_rows, seed=data.seed)
    return [str(train)], list(data.val_files) or [str(test)]


def requests_for(rows, tokenizer, config: Config) -> list[PromptRequest]:
    """Tokenize rows; a prompt too long or empty is an error naming its prompt_id (`rlactors.pipelines.preflight`
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


def start_trainers(config: Config, model_path: str, trainer_config, placement, take_kept, trainers: dict,
                   taken: dict) -> None:
    """A trainer group per role into `trainers`: a kept one whose processes match (`take_kept`, which
    moves them into `taken` until each is given its role) begun on this run, else a new one. What
    it started is in the two dicts when it raises, for the caller to stop."""
    algorithm = config.algorithm
    norm_tokens = algorithm.loss_norm_tokens or config.rollout.sampling.max_response_tokens
    keys = {role: trainer_key(role, trainer_config) for role in trainer_roles(config)}

    def lora_of(role: str):
        return config.model.lora if role == "actor" and config.model.lora.enabled else None

    if take_kept is not None:
        taken.update(take_kept(list(keys.values())))
    for role, role_key in keys.items():
        if role_key in taken:
            trainers[role] = taken.pop(role_key)
            trainers[role].start_run(model_path, trainer_config, algorithm, config.pipeline.seed, norm_tokens,
                                     lora=lora_of(role))
        else:
            trainers[role] = TrainerGroup(role, model_path, trainer_config, algorithm, seed=config.pipeline.seed,
                                          norm_tokens=norm_tokens, placement=placement, lora=lora_of(role))


def build_run(config: Config, model_path: str | None = None, warm: WarmActors | None = None) -> Run:
    """Validate data, build the model if asked, plan the run on the cluster and reserve its
    devices, then start every actor the config needs in its place. With `warm`, engines kept by an
    earlier run with the same settings and plan are taken instead of started, and its trainer groups
    whose processes match (`rlactors.pipelines.warm`)."""
    output_dir = Path(config.pipeline.output_dir).absolute()  # once: every actor on every node gets this path
    output_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, output_dir / "config.yaml")
    if not ray.is_initialized():  # as init_ray: a Ray started by the caller keeps the caller's logging
        logs.set_up_driver(output_dir / "logs", config.pipeline.verbose)  # before the first model load
    seed_everything(config.pipeline.seed)
    # An impossible run is refused here, before Ray or any actor starts (see rlactors.pipelines.preflight).
    preflight.check_config(config, output_dir)
    resume_from = preflight.check_resume_point(config.pipeline.resume, output_dir, config.pipeline.on_damaged_checkpoint)
    model_path = str(model_path or ensure_run_model(config.model, output_dir))
    preflight.check_model(config, model_path)
    preflight.warn_if_checkpoints_will_not_fit(config, model_path, output_dir)
    tokenizer = load_tokenizer(model_path)
    train_files, val_files = data_files(config, output_dir)
    dataset = PromptDataset.from_files(train_files, seed=config.data.seed, shuffle=config.data.shuffle,
                                       skip_bad_rows=config.data.skip_bad_rows)
    val_requests = preflight.check_prompts(config, tokenizer, dataset.rows, train_files, val_files)

    init_ray(output_dir / "logs", config.pipeline.verbose)
    plan = plan_for_cluster(config)  # a run that cannot fit fails here, naming what is missing
    check_visible_everywhere(output_dir, plan)
    # A transport the plan cannot serve is refused here, before any device is reserved.
    transport = choose_for_plan(config.rollout.weight_transport, plan, config.rollout.num_engines,
                                config.pipeline.mode == "colocated")
    key = engine_key(config, model_path, plan, transport.vllm_backend)
    kept = warm.take(key) if warm is not None else None
    placement = kept.placement if kept else Placement.reserve(plan, config.pipeline.placement_timeout_s)
    trainers: dict[str, TrainerGroup] = {}
    taken: dict[tuple, TrainerGroup] = {}  # kept groups not yet given to a role
    router = reward = buffer = builder = None
    try:
        algorithm, sampling = config.algorithm, config.rollout.sampling
        # Neither waits for its actor to start (the first call does): their processes start while
        # the trainers and the engines do.
        buffer = BufferClient.create(config.buffer, config.pipeline.batch_size_prompts,
                                     config.pipeline.trigger_parameter_sync_step, str(output_dir / LEDGER_FOLDER),
                                     options=placement.near("actor"))
        builder = BatchBuilder.options(**placement.near("actor")).remote(algorithm, model_path)
        start_trainers(config, model_path, trainer_settings(config, plan.cluster.device_kind), placement,
                       partial(warm.take_trainers, kept) if kept else None, trainers, taken)
        if config.trainer.offload and config.pipeline.mode == "colocated":
            # Before the engines start: vLLM claims its share of the device only if it is free, and
            # the first generation then has the device to itself.
            for group in trainers.values():
                group.offload()
        # Engines restart after a crash (Ray re-runs the constructor, in the same bundles) and the
        # trainer sends them the current weights before they get work again (set_weight_loader below).
        if kept:
            router = RolloutRouter.over(kept.engines, config.rollout)
            router.new_run(config.rollout)
        else:
            router = RolloutRouter.create(model_path, config.rollout, max_restarts=1, placement=placement,
                                          dtype=config.model.dtype, weight_backend=transport.vllm_backend)
        router.ready()
        reward = RewardPool(config.reward, max_response_tokens=sampling.max_response_tokens,
                            policy_tokenizer_path=model_path, placement=placement)
    except BaseException:
        # Everything started so far, in and outside the placement groups; the error stays the one raised.
        stop_all(run_parts([*trainers.values(), *taken.values()], router, reward, buffer, builder), placement)
        raise
    kl_controller = (algorithms.AdaptiveKLController(algorithm.kl_coef, algorithm.kl_target, algorithm.kl_horizon)
                     if algorithm.kl_controller == "adaptive" else algorithms.FixedKLController(algorithm.kl_coef))
    # The dtype weights travel in: the engines' (what `auto` means where they run), known here
    # without asking an engine (one may be restarting) and not asked by every trainer rank.
    engine_dtype = (config.model.dtype if config.model.dtype != "auto"
                    else default_dtype("cpu" if plan.cluster.device_kind == "cpu" else "cuda"))
    weight_sync = WeightSyncSettings(transport.transport, config.rollout.weight_bucket_bytes, engine_dtype,
                                     config.rollout.call_timeout_s, config.rollout.tensor_parallel_size,
                                     config.rollout.verify_weight_sync, adapter_dir(output_dir, {
                                         bundle.node for bundle in plan.bundles}) if config.rollout.lora_rank else None)
    actor = trainers["actor"]
    router.set_weight_loader(lambda targets, version: actor.send_weights_ref(targets, version, weight_sync))
    if weight_sync.adapter_dir:
        print(f"weight transport: the LoRA adapter alone, as a peft folder in {weight_sync.adapter_dir}")
    else:
        print(f"weight transport: {transport.transport} ({transport.reason})")
    return Run(config, output_dir, tokenizer, dataset, val_requests, router, reward, buffer, actor,
               trainers.get("reference"), trainers.get("critic"), kl_controller, placement, builder, weight_sync,
               warm, key, bool(kept), resume_from=resume_from)
