"""`TrainerWorker`: one FSDP2 rank of a trainer group, as a Ray actor.

Every public method is called on all ranks of the group at once (`TrainerGroup` does the fan-out):
each one runs collectives (FSDP all-gathers and reduce-scatters, metric all-reduces), so all ranks
run the same number of forward/backward passes, which the shared plan guarantees.

Roles (plain branches, no subclasses): `actor` (policy: logprobs, PPO update, SFT), `reference`
(frozen: logprobs only), `critic` (value head: values, value update), `reward_model` (a sequence
classifier: Bradley-Terry update on preference pairs, `rlactors.pipelines.reward_model_training`).

Loss normalisation: every micro-batch loss is that micro-batch's share of the mini-batch loss
(global counts from the plan), so the shares of all micro-batches of all ranks sum to the loss of
the whole mini-batch. FSDP averages gradients over ranks, hence the `* world_size` before backward.

Checkpoint (`save_checkpoint`, `trainer.rank_checkpoint`): model and optimizer state (DCP shards),
LR scheduler, optimizer step and skipped-step counters, and RNG states, per rank. `load_checkpoint`
restores all of it.

Offload (colocated, `trainer.offload`): `offload()` moves parameters and optimizer state to host
memory while the engines generate, `onload()` brings them back; forward and update passes raise
while offloaded, exports and checkpoints hold the device for the call (`resident`). Each
pass, export, offload and onload is appended to `phase_log()` with this process's memory.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from collections import defaultdict
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from rlactors.algorithms import (
    aggregate_loss,
    bradley_terry_loss,
    chunked_entropy_from_logits,
    logprobs_from_logits,
    sft_loss,
    value_loss,
)
from rlactors.config import AlgorithmConfig, LoraConfig, TrainerConfig
from rlactors.models import lora
from rlactors.models.moe import checkpoint_layout, is_moe_config
from rlactors.runtime.phases import PhaseLog, memory_figures
from rlactors.trainer import checkpoint, fsdp, offload, policy_objective, rank_checkpoint, step_metrics
from rlactors.trainer.batch import MicroBatch, TrainBatch, build_micro_batch, unpad_rows
from rlactors.trainer.offload import resident
from rlactors.trainer.plan import MiniBatchPlan
from rlactors.trainer.routing_replay import RoutingReplay, micro_batch_terms


class TrainerWorker:
    """One rank; `TrainerGroup` runs it as `ray.remote(TrainerWorker)` (a plain class here, so Ray
    pickles it by reference to this module rather than by value)."""

    def __init__(self, rank: int, world_size: int, num_cpus: float = 1.0):
        torch.set_num_threads(max(1, int(num_cpus)))
        self.rank, self.world_size = rank, world_size
        self._reset_run()

    def _reset_run(self, role: str | None = None, model_path: str | None = None, trainer: TrainerConfig | None = None,
                   algorithm: AlgorithmConfig | None = None, norm_tokens: int | None = None,
                   lora_config: LoraConfig | None = None) -> None:
        """Every field a run owns, in one place: the run's arguments, and the rest empty until
        `start_run` loads the model. The process's own fields (rank and world size, `setup`'s mesh
        and device) outlive runs and are not among them."""
        self.role, self.model_path, self.trainer, self.algorithm = role, model_path, trainer, algorithm
        self.norm_tokens = norm_tokens
        self.lora = lora_config if lora_config is not None and lora_config.enabled else None  # the actor's adapters
        # The model and what trains it; None first, so the last run's memory goes before the next loads.
        self.model = self.optimizer = self.scheduler = self.optim_config = None
        self.routing: RoutingReplay | None = None  # an MoE actor's or reference's routers (`routing_replay`)
        self.architecture, self.pad_token_id, self.vocab_size = None, 0, 0  # of the model, read as it loads
        self.num_optimizer_steps = self.num_skipped_steps = 0  # saved in checkpoints
        self.offloaded = False  # parameters and optimizer state in host memory (colocated, between steps)
        self.weight_sender = None  # this rank's side of weight syncs, made at the first `send_weights`
        self.phases = PhaseLog()

    def master_address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port for the process group rendezvous."""
        return ray.util.get_node_ip_address(), fsdp.free_port()

    def setup(self, role: str, model_path: str, master_addr: str, master_port: int, trainer: TrainerConfig,
              algorithm: AlgorithmConfig, seed: int = 0, norm_tokens: int | None = None,
              lora_config: LoraConfig | None = None) -> dict:
        """Join the group's process group, pin this process's threads, then `start_run`. What is set
        here lasts as long as the process (`rlactors.pipelines.warm.trainer_key` names it)."""
        self.mesh = fsdp.init_distributed(self.rank, self.world_size, master_addr, master_port,
                                          trainer.collective_timeout_s)
        self.device = torch.device(self.mesh.device_type, torch.cuda.current_device()) \
            if self.mesh.device_type == "cuda" else torch.device("cpu")
        if self.device.type == "cpu" and trainer.cpu_cores:
            # e.g. one core for training and one for rollout; or "all" while a colocated engine idles
            cores = sorted(os.sched_getaffinity(0)) if trainer.cpu_cores == "all" else trainer.cpu_cores
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        return self.start_run(role, model_path, trainer, algorithm, seed, norm_tokens, lora_config)

    def start_run(self, role: str, model_path: str, trainer: TrainerConfig, algorithm: AlgorithmConfig,
                  seed: int = 0, norm_tokens: int | None = None, lora_config: LoraConfig | None = None) -> dict:
        """Everything a run's training state is, made anew: the model from `model_path`, a fresh
        optimizer and schedule, step counters, the weight sender, the phase log, the RNG seeded
        from `seed`. A rank kept from an earlier run (`rlactors.pipelines.warm`) is then what a
        new one would be; only its process, process group and thread pinning stay. `lora_config`
        (an actor's `model.lora`) puts adapters on the model first: then only they train."""
        if self.weight_sender is not None:  # tied to the engines' transfer of the run before
            self.weight_sender.shutdown()
        self._reset_run(role, model_path, trainer, algorithm, norm_tokens, lora_config)
        if self.lora is not None and role != "actor":
            raise ValueError(f"LoRA adapters are the actor's; this rank's role is {role!r}")
        model = fsdp.load_role_model(model_path, role, seed)
        self.architecture = type(model).__name__  # before FSDP2 renames the class
        self.pad_token_id = model.config.pad_token_id or 0
        self.vocab_size = model.get_input_embeddings().num_embeddings
        trainable = role != "reference"
        model.requires_grad_(trainable)
        if self.lora is not None:
            model = lora.add_adapters(model, self.lora)  # before sharding; freezes all but the adapters
        self.model = fsdp.shard_model(model, self.mesh, trainable and trainer.gradient_checkpointing)
        self.model.train(trainable)
        if role != "critic" and is_moe_config(model.config):
            self.routing = RoutingReplay(self.model)
        if trainable:
            self.optim_config = trainer.critic_optim if role == "critic" else trainer.optim
            self.optimizer, self.scheduler = fsdp.optimizer_and_schedule(self.model, self.optim_config)
        torch.manual_seed(seed + self.rank)  # per-rank streams for anything random in training (saved in checkpoints)
        random.seed(seed + self.rank)
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device),
                "num_parameters": sum(p.numel() for p in self.model.parameters()),
                "num_trainable_parameters": sum(p.numel() for p in self.model.parameters() if p.requires_grad)}

    @contextlib.contextmanager
    def _routed(self, micro: MicroBatch):
        """On an MoE model, the forward passes within route by the rollout's recorded experts
        (`trainer.routing_replay=rollout`) or only compare with them; the pass's routing is kept in
        `self.routing.last` for `routing_replay.micro_batch_terms`. An update holds it through its
        backward: gradient checkpointing runs the forward again there, and must route alike."""
        if self.routing is None:
            yield
            return
        with self.routing.using(micro.routes, record=True, replay=self.trainer.routing_replay == "rollout"):
            yield

    def _micro_batch(self, batch: TrainBatch, indices: list[int], fields: tuple[str, ...] = ()) -> MicroBatch:
        """One micro-batch on this rank's device. A token id outside the vocabulary is an error
        naming its sequence (the embedding lookup's own error names none)."""
        micro = build_micro_batch(batch, indices, fields, self.pad_token_id)
        if micro.input_ids.numel() and not 0 <= int(micro.input_ids.min()) <= int(micro.input_ids.max()) < self.vocab_size:
            i = next(i for i in indices if any(not 0 <= t < self.vocab_size
                                               for t in batch.prompt_token_ids[i] + batch.response_token_ids[i]))
            raise ValueError(f"{batch.describe(i)}: a token id outside the model's vocabulary of {self.vocab_size}")
        return micro.to(self.device)

    @ray.method(num_returns=2)
    def rows_in_store(self, method: str, batch: TrainBatch, plan: MiniBatchPlan, *args) -> tuple[int, list]:
        """Forward pass `method` as two results: the row count, which the group waits on, and the
        rows, left in the object store for whoever merges them (the caller never fetches them)."""
        rows = getattr(self, method)(batch, plan, *args)
        return len(rows), rows

    # ----------------------------------------------------------------------------------------
    # Forward-only passes

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, plan: MiniBatchPlan, temperature: float,
                         with_entropy: bool = False, base: bool = False
                         ) -> list[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """(sequence index, response-token logprobs, entropies or None) for this rank's sequences.
        `base`: a LoRA actor's logprobs with its adapters off, the reference policy's."""
        self._start("compute_logprobs", ("actor", "reference"))
        if base and self.lora is None:
            raise ValueError("compute_logprobs(base=True) needs an actor with LoRA adapters (model.lora.rank > 0)")
        out = []
        for indices in plan.micro_batches[0]:
            micro = self._micro_batch(batch, indices)
            policy = lora.base_only(self.model) if base else contextlib.nullcontext()
            with self._routed(micro), policy, lora.without_dropout(self.model):
                logits = fsdp.response_logits(self.model, micro, temperature)
            rows = unpad_rows(logprobs_from_logits(logits, micro.labels), micro)
            entropies = [e for _, e in unpad_rows(chunked_entropy_from_logits(logits), micro)] if with_entropy \
                else [None] * len(rows)
            out += [(i, logp, entropy) for (i, logp), entropy in zip(rows, entropies, strict=True)]
        return out

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch, plan: MiniBatchPlan) -> list[tuple[int, torch.Tensor]]:
        self._start("compute_values", ("critic",))
        out = []
        for indices in plan.micro_batches[0]:
            micro = self._micro_batch(batch, indices)
            out += unpad_rows(fsdp.response_values(self.model, micro), micro)
        return out

    # ----------------------------------------------------------------------------------------
    # Updates

    def update_policy(self, batch: TrainBatch, plans: list[MiniBatchPlan], temperature: float) -> dict[str, float]:
        """PPO epochs over the mini-batches; metrics are means over optimizer steps.

        A batch without `old_logprobs` (see `AlgorithmConfig.old_logprobs`) takes the update's own
        logprobs, detached: equal by construction with one mini-batch and one epoch, the only case
        allowed. The update then also measures the rollout/trainer gap the old-logprob pass would
        have (`rollout_trainer_kl`, `rollout_logprob_abs_diff_max`). In bypass mode
        (`algorithm.rollout_correction`) the rollout logprobs are the old ones, whatever the
        mini-batches and epochs. The loss is `policy_objective.actor_loss`."""
        self._start("update_policy", ("actor",))
        algorithm = self.algorithm
        bypass = algorithm.rollout_correction.bypass_mode  # the rollout logprobs are the old ones
        from_update = "old_logprobs" not in batch.token_fields and not bypass
        if from_update and (len(plans) != 1 or self.trainer.num_epochs != 1):
            raise ValueError(f"a batch without old_logprobs needs one mini-batch and one epoch (it has {len(plans)} "
                             f"mini-batches, trainer.num_epochs={self.trainer.num_epochs}): compute them first")
        fields = policy_objective.actor_fields(algorithm, batch.token_fields, from_update)

        def loss_fn(micro: MicroBatch, plan: MiniBatchPlan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            logits = fsdp.response_logits(self.model, micro, temperature)  # routed by `_train`'s `_routed`
            loss, sums = policy_objective.actor_loss(algorithm, logits, micro, self._counts(plan), from_update)
            aux, routing = (None, {}) if self.routing is None else micro_batch_terms(
                self.routing.last, micro, self.pad_token_id, self.trainer.router_aux_loss_coef,
                micro.num_tokens / max(plan.num_tokens, 1))
            return (loss if aux is None else loss + aux), sums | routing

        return self._train(batch, plans, fields, loss_fn, "actor", self.trainer.num_epochs)

    def update_critic(self, batch: TrainBatch, plans: list[MiniBatchPlan]) -> dict[str, float]:
        self._start("update_critic", ("critic",))
        algorithm = self.algorithm

        def loss_fn(micro: MicroBatch, plan: MiniBatchPlan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            values = fsdp.response_values(self.model, micro)
            per_token, stats = value_loss(values, micro.fields["values"], micro.fields["returns"], micro.mask,
                                          algorithm.value_clip)
            loss = aggregate_loss(per_token, micro.mask, algorithm.loss_agg_mode, **self._counts(plan))
            return loss, {"vf_loss": loss, "vf_clipfrac": stats["vf_clipfrac"] * micro.mask.sum()}

        return self._train(batch, plans, ["values", "returns"], loss_fn, "critic", self.trainer.num_epochs)

    def sft_step(self, batch: TrainBatch, plans: list[MiniBatchPlan]) -> dict[str, float]:
        """Supervised masked NLL of the model tokens of the responses (prompt and observation tokens are
        context only)."""
        self._start("sft_step", ("actor",))

        def loss_fn(micro: MicroBatch, plan: MiniBatchPlan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            logp = logprobs_from_logits(fsdp.response_logits(self.model, micro), micro.labels)
            loss = sft_loss(logp, micro.mask, global_num_tokens=plan.num_tokens)
            return loss, {"sft_loss": loss}

        return self._train(batch, plans, [], loss_fn, "actor", num_epochs=1)

    def update_reward_model(self, batch: TrainBatch, plans: list[MiniBatchPlan]) -> dict[str, float]:
        """Bradley-Terry steps on preference pairs: sequences 2p (chosen) and 2p+1 (rejected), whole
        texts, planned by `plan_preference_pairs` (a pair in one micro-batch, counts in pairs)."""
        self._start("update_reward_model", ("reward_model",))

        def loss_fn(micro: MicroBatch, plan: MiniBatchPlan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            scores = fsdp.sequence_scores(self.model, micro)
            if not micro.indices:  # a filler micro-batch: runs the collectives, adds nothing
                zero = scores.sum() * 0.0
                return zero, {"bt_loss": zero, "preference_accuracy": zero, "score_margin": zero}
            loss, sums = bradley_terry_loss(scores[0::2], scores[1::2], global_num_pairs=plan.num_tokens)
            return loss, {"bt_loss": loss} | sums

        return self._train(batch, plans, [], loss_fn, "reward_model", num_epochs=1)

    def _counts(self, plan: MiniBatchPlan) -> dict:
        return dict(global_num_tokens=plan.num_tokens, global_num_sequences=plan.num_sequences,
                    norm_tokens=self.norm_tokens)

    def _train(self, batch, plans, fields, loss_fn, prefix: str, num_epochs: int) -> dict[str, float]:
        """Run optimizer steps, one per mini-batch per epoch; the metrics (`step_metrics`) are
        all-reduced per step and averaged over the steps."""
        totals: dict[str, float] = defaultdict(float)
        num_steps = 0
        for _ in range(num_epochs):
            for plan in plans:
                sums = step_metrics.new_sums(self.device)
                micro_batches = plan.micro_batches[0]
                for k, indices in enumerate(micro_batches):
                    # One rank: accumulate unsharded gradients and reduce once per step (sharding
                    # saves nothing there). Several ranks: reduce-scatter every micro-batch, so no
                    # rank ever holds a full gradient.
                    self.model.set_requires_gradient_sync(self.world_size > 1 or k == len(micro_batches) - 1)
                    micro = self._micro_batch(batch, indices, tuple(fields))
                    with self._routed(micro):
                        loss, micro_sums = loss_fn(micro, plan)
                        (loss * self.world_size).backward()
                    step_metrics.accumulate(sums, micro_sums)
                step = step_metrics.reduce_over_ranks(sums, plan.num_tokens)
                step.update(self._optimizer_step(finite=math.isfinite(step_metrics.total_loss(step))))
                for key, value in step.items():
                    totals[key] += value
                num_steps += 1
        metrics = {f"{prefix}/{k}": v / num_steps for k, v in totals.items()}
        metrics[f"{prefix}/num_skipped_steps"] = float(self.num_skipped_steps)
        metrics[f"{prefix}/num_optimizer_steps"] = float(self.num_optimizer_steps)
        return metrics

    def _optimizer_step(self, finite: bool) -> dict[str, float]:
        """Clip and step, or skip when the loss or gradient norm is not finite: then weights and
        optimizer state stay untouched and the skip is counted. The decision uses all-reduced
        values, so every rank takes the same branch."""
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = float(fsdp.full_tensor(torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.optim_config.grad_clip)))
        if finite and math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
            self.num_optimizer_steps += 1
        else:
            self.num_skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": lr}

    def _start(self, method: str, roles: tuple[str, ...]) -> None:
        """Checks before a forward or update pass, and its entry in the phase log."""
        if self.role not in roles:
            raise ValueError(f"{method} needs a trainer of role {' or '.join(roles)}; this one is {self.role!r}")
        if self.offloaded:
            raise RuntimeError(f"{method}: this {self.role} rank is offloaded to host memory; call onload() first")
        self.phases.record(method, memory_figures())

    # ----------------------------------------------------------------------------------------
    # Time-sharing the device (colocated): parameters and optimizer state to the host and back

    def offload(self) -> dict:
        """Move this rank's parameters and optimizer state to host memory and release the cached
        device memory; returns {"phase", "moved_bytes", "memory"} (memory after the move). Already
        offloaded: nothing moves or is logged, and moved_bytes is 0."""
        return self._move("offload", offload.HOST)

    def onload(self) -> dict:
        """Bring parameters and optimizer state back to the device (the inverse of `offload`)."""
        return self._move("onload", self.device)

    def _move(self, phase: str, device) -> dict:
        if self.offloaded == (phase == "offload"):
            return {"phase": phase, "moved_bytes": 0, "memory": memory_figures()}
        if phase == "offload":
            offload.drop_gradients(self.model)
        moved_bytes = offload.move_state(self.model, self.optimizer, device)
        offload.release_cached_memory(self.device)
        self.offloaded = phase == "offload"
        return self.phases.record(phase, memory_figures(), moved_bytes=moved_bytes)

    def phase_log(self) -> list[dict]:
        """This rank's last phases (see `rlactors.runtime.phases`), oldest first."""
        return self.phases.entries()

    # ----------------------------------------------------------------------------------------
    # Weights out: to rollout engines and to a Hugging Face folder

    @resident
    def export_weights(self, bucket_bytes: int, dtype: torch.dtype | None = None) -> tuple[list, int]:
        """Stream full weights out in buckets of ~`bucket_bytes`: (list of ObjectRefs, total bytes).

        Each bucket is a list of (Hugging Face name, CPU tensor), gathered tensor by tensor and put
        into the object store as soon as it fills, so no rank ever holds more than one bucket of
        gathered weights. Rank 0 puts and therefore OWNS the refs: they stay readable while this
        actor lives (they die with it) and are freed once every holder drops them. Other ranks
        only join the gathers and return no refs. A tied lm_head is sent once, as the embedding.
        """
        refs, total_bytes = [], 0
        for bucket in fsdp.iter_weight_buckets(self.model, bucket_bytes, keep=self.rank == 0, dtype=dtype):
            total_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            refs.append(ray.put(bucket))
        self.phases.record("export_weights", memory_figures(), num_bytes=total_bytes)
        return refs, total_bytes

    @resident
    def send_weights(self, engines: dict, policy_version: int, settings) -> dict | None:
        """Every rank's part of a weight sync (`rlactors.weight_sync.sender`): all gather, rank 0
        sends and returns the figures. A tied lm_head is sent once, as the embedding. A LoRA actor
        sends its adapter alone, or with `model.lora.merge` the weights it adapts merged
        (`fsdp.weight_items`) through the same transports as a full model."""
        if self.lora is not None and not self.lora.merge:  # the adapter alone (rlactors.weight_sync.adapters)
            from rlactors.weight_sync.adapters import send_adapter

            tensors = self._adapter_tensors(getattr(torch, settings.dtype or "float32"))
            stats = send_adapter(tensors, engines, policy_version, settings, self.lora, self.model_path) \
                if self.rank == 0 else None
            self.phases.record("export_weights", memory_figures(), num_bytes=(stats or {}).get("weight_bytes", 0))
            return stats
        if self.weight_sender is None:
            from rlactors.weight_sync.sender import WeightSender

            self.weight_sender = WeightSender(self.rank)
        stats = self.weight_sender.send(lambda: fsdp.weight_items(self.model), engines, policy_version, settings,
                                        split=checkpoint_layout(self.model))
        self.phases.record("export_weights", memory_figures(), num_bytes=(stats or {}).get("weight_bytes", 0))
        return stats

    @resident
    def save_hf(self, path: str) -> None:
        """Write a Hugging Face folder at `path` (`rlactors.trainer.hf_export`): every rank joins
        the gathers, tensor by tensor; rank 0 writes a shard per bucket, on CPU. A LoRA actor's
        folder holds the merged model, and its adapter as a peft folder in `path/adapter`."""
        from rlactors.trainer.hf_export import SHARD_BYTES, source_dtype, write_hf_folder

        if self.role == "critic":
            raise ValueError("a critic is not a causal LM: only the actor and reference export to Hugging Face")
        dtype = source_dtype(self.model_path)
        buckets = fsdp.iter_weight_buckets(self.model, SHARD_BYTES, keep=self.rank == 0, dtype=dtype)
        # A reward model's folder is a classifier the scorer loads, whatever folder it started from.
        classifier = {"num_labels": 1, "pad_token_id": self.pad_token_id} if self.role == "reward_model" else None
        if self.rank == 0:
            write_hf_folder(buckets, path, self.model_path, self.architecture, dtype, classifier)
        else:
            for _ in buckets:  # the gathers are collectives: every rank walks them
                pass
        if self.lora is not None:  # and the adapter alone, as peft saves it
            adapter = self._adapter_tensors(dtype)
            if self.rank == 0:
                lora.save_adapter(Path(path) / lora.ADAPTER_FOLDER, adapter, self.lora, self.model_path)
        dist.barrier()

    def _adapter_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The LoRA adapter's whole tensors by peft name on rank 0 ({} elsewhere); all ranks gather."""
        return fsdp.gather_whole(lora.adapter_state_items(self.model, fsdp.unique_state_items(self.model)),
                                 keep=self.rank == 0, dtype=dtype)

    # ----------------------------------------------------------------------------------------
    # Checkpoint

    @resident
    def save_checkpoint(self, root: str, step: int) -> str:
        """Write checkpoint `step` under `root` atomically (see `checkpoint` and `rank_checkpoint`);
        returns its path: `step_N`, or `step_N.<revision>` for a re-saved step."""
        state = rank_checkpoint.rank_state(step, self.role, self.num_optimizer_steps, self.num_skipped_steps,
                                           self.scheduler)
        return str(rank_checkpoint.save(root, step, self.rank, self.model, self.optimizer, state))

    @resident
    def load_checkpoint(self, path: str) -> int:
        """Restore a checkpoint (a directory, or a root whose `latest` names one); returns its step."""
        saved = rank_checkpoint.load(checkpoint.resolve_checkpoint(path), self.rank, self.model, self.optimizer,
                                     self.scheduler)
        self.num_optimizer_steps, self.num_skipped_steps = saved["num_optimizer_steps"], saved["num_skipped_steps"]
        return saved["step"]

    def shutdown(self) -> None:
        if self.weight_sender is not None:
            self.weight_sender.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()

