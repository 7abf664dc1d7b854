"""`TrainerGroup`: N `TrainerWorker` rank actors sharing one torch.distributed process group.

    actor = TrainerGroup("actor", model_dir, config.trainer, config.algorithm)
    batch = train_batch_from_groups(groups)
    batch.set_field("old_logprobs", actor.compute_logprobs(batch, temperature=1.0)["logprobs"])
    ... advantages from the algorithm functions, `batch.set_padded_field("advantages", ...)` ...
    metrics = actor.update_policy(batch, temperature=1.0)
    stats = actor.send_weights(router.weight_sync_targets(version), version, settings)  # to the engines
    actor.offload(); ...; actor.onload()   # colocated: host memory while the engines generate

A plain driver-side object: it plans every call from the sequence lengths (mini-batches, one
shard of sequences per rank, equal micro-batch counts; see `batch`), puts the batch into the
object store once, fans the call out to all ranks and gathers the results back into batch order.
Metrics are all-reduced by the ranks, so rank 0's are the group's.

Every call also takes a `TrainBatchRef` (a batch already in the object store, with its lengths):
then the batch never enters this process. `logprob_rows` and `value_rows` leave the ranks' results
in the object store too (the ranks keep every result there, `rlactors.runtime.transport`), for the batch
builder to merge; a training step on the driver moves refs and metrics only.

Failures: every call returns once all ranks have answered, or raises at the first rank that raises
or dies (`rlactors.trainer.ranks.TrainerRankError`, naming the rank, the call and its error), or
past `trainer.call_timeout_s` (naming the ranks not done). Either way every rank of the group is
killed first (the others are stuck in a collective), and any later call raises at once. Only an
error that every rank raised alike (a check before any collective) keeps the group, and is raised
as the ranks raised it.
`shutdown()` is bounded too: a rank that does not leave its process group in time is killed.
"""

from __future__ import annotations

import threading

import ray
import torch

from rlactors.config import AlgorithmConfig, LoraConfig, TrainerConfig
from rlactors.placement.cluster import unplaced_options
from rlactors.runtime.calls import error_text, gather, get_within
from rlactors.runtime.phases import PHASE_LOG_TIMEOUT_S
from rlactors.runtime.transport import results_in_object_store
from rlactors.trainer.batch import TrainBatch, TrainBatchRef, rows_in_batch_order
from rlactors.trainer.plan import MiniBatchPlan, plan_mini_batches, plan_preference_pairs
from rlactors.trainer.ranks import TrainerRankError, kill_ranks, wait_for_ranks
from rlactors.trainer.worker import TrainerWorker

BatchArg = TrainBatch | TrainBatchRef | ray.ObjectRef  # by value, in the object store with its lengths, or a bare ref

# Leaving the process group takes milliseconds on gloo, seconds on NCCL; a rank that takes longer is
# stuck (in a collective with a dead peer) and is killed instead.
SHUTDOWN_TIMEOUT_S = 15.0


def check_norm_tokens(algorithm: AlgorithmConfig, norm_tokens: int | None) -> AlgorithmConfig:
    """`algorithm`, if its loss mode has the constant it needs."""
    if algorithm.loss_agg_mode == "seq-mean-token-sum-norm" and (algorithm.loss_norm_tokens or norm_tokens) is None:
        raise ValueError("algorithm.loss_agg_mode 'seq-mean-token-sum-norm' needs algorithm.loss_norm_tokens "
                         "or the group's norm_tokens (e.g. the maximum response length)")
    return algorithm


class TrainerGroup:
    def __init__(self, role: str, model_path: str, trainer: TrainerConfig, algorithm: AlgorithmConfig | None = None,
                 seed: int = 0, norm_tokens: int | None = None, placement=None, lora: LoraConfig | None = None):
        """Start `trainer.num_workers` ranks of `role` ("actor", "reference", "critic" or "reward_model") on the model
        folder `model_path`. `norm_tokens` is the constant of the `seq-mean-token-sum-norm` loss mode
        (e.g. the maximum response length). `placement` (a `rlactors.placement.cluster.Placement`)
        gives each rank its bundle and resources; without it each rank asks for a whole GPU when the
        cluster has GPUs. `lora` (the actor's `model.lora`) trains adapters on the frozen model."""
        algorithm = check_norm_tokens(algorithm or AlgorithmConfig(), norm_tokens)
        self.role, self.trainer = role, trainer
        self.num_workers = trainer.num_workers
        self.stopped: str | None = None  # why the ranks are gone (a failure, or shutdown)
        self._submit_lock = threading.Lock()
        self.workers = [ray.remote(TrainerWorker).options(**results_in_object_store(
            placement.trainer_options(role, rank) if placement is not None
            else unplaced_options(trainer.num_cpus_per_worker, 1))).remote(rank, self.num_workers, trainer.num_cpus_per_worker)
            for rank in range(self.num_workers)]
        try:
            # Every rank's process up first (rank 0's address is the rendezvous), so that all enter
            # setup together: init_process_group waits at most collective_timeout_s for the others.
            master_addr, master_port = self._wait([w.master_address.remote() for w in self.workers], "start")[0]
            self.info = self._wait([w.setup.remote(role, str(model_path), master_addr, master_port, trainer, algorithm,
                                                   seed, algorithm.loss_norm_tokens or norm_tokens, lora)
                                    for w in self.workers], "setup")
        except BaseException:
            kill_ranks(self.workers)  # also on an interrupt: ranks half-way into the rendezvous
            self.workers = []
            raise

    def start_run(self, model_path: str, trainer: TrainerConfig, algorithm: AlgorithmConfig | None = None,
                  seed: int = 0, norm_tokens: int | None = None, lora: LoraConfig | None = None) -> None:
        """Begin another run on these ranks, as a new group would with these arguments (a fresh
        model, optimizer, schedule, RNG; `TrainerWorker.start_run`), without starting processes or a
        process group: for groups kept between runs (`rlactors.pipelines.warm`), which match this
        group's ranks, cores and collective timeout (`rlactors.pipelines.warm.trainer_key`)."""
        algorithm = check_norm_tokens(algorithm or AlgorithmConfig(), norm_tokens)
        self.trainer = trainer
        self.info = self._on_all("start_run", self.role, str(model_path), trainer, algorithm, seed,
                                 algorithm.loss_norm_tokens or norm_tokens, lora)

    def _wait(self, refs: list[ray.ObjectRef], call: str) -> list:
        """The ranks' results of `call` (refs[i] from rank i); at the first failure, or past
        `trainer.call_timeout_s`, every rank is killed and the error names the rank."""
        try:
            return wait_for_ranks(self.role, self.workers, refs, call, self.trainer.call_timeout_s)
        except (TrainerRankError, TimeoutError) as error:
            self.stopped, self.workers = f"its ranks were killed after: {error}", []
            raise

    def _on_all(self, call: str, *args) -> list:
        """`call(*args)` on every rank at once; results in rank order."""
        return self._wait(self._submit(call, lambda rank, worker: getattr(worker, call).remote(*args)), call)

    def _submit(self, call: str, submit) -> list:
        """`submit(rank, worker)` for every rank, as one step: calls from two driver threads (async
        mode: the trainer's, and a revived engine's weight load) reach every rank in the same order,
        so the ranks run their collectives in the same order."""
        with self._submit_lock:
            return [submit(rank, worker) for rank, worker in enumerate(self._live_workers(call))]

    def _live_workers(self, call: str) -> list:
        if self.stopped is not None:
            raise RuntimeError(f"{self.role}.{call}: the {self.role} group cannot be used, {self.stopped}")
        return self.workers

    def _plans(self, batch: TrainBatchRef, num_mini_batches: int) -> list[MiniBatchPlan]:
        if self.role == "reward_model":  # preference pairs, each kept in one micro-batch
            return plan_preference_pairs(batch.sequence_lengths, num_mini_batches, self.num_workers,
                                         self.trainer.max_tokens_per_micro_batch)
        return plan_mini_batches(batch.sequence_lengths, batch.num_model_tokens, num_mini_batches, self.num_workers,
                                 self.trainer.max_tokens_per_micro_batch)

    @staticmethod
    def _stored(batch: BatchArg) -> TrainBatchRef:
        """The batch in the object store with its lengths: put here if given by value (a bare
        ObjectRef is fetched first, since planning needs the lengths)."""
        if isinstance(batch, TrainBatchRef):
            return batch
        if isinstance(batch, ray.ObjectRef):
            batch = ray.get(batch)
        return TrainBatchRef.of(ray.put(batch), batch)

    def _fan_out(self, method: str, batch: BatchArg, num_mini_batches: int, *args) -> list:
        """Call `method(batch_ref, this rank's plans, *args)` on every rank; results in rank order."""
        batch = self._stored(batch)
        if len(batch) == 0:
            raise ValueError(f"{self.role}.{method}: empty batch")
        plans = self._plans(batch, num_mini_batches)
        return self._wait(self._submit(method, lambda rank, w: getattr(w, method).remote(
            batch.ref, [plan.for_rank(rank) for plan in plans], *args)), method)

    def _forward_refs(self, method: str, batch: TrainBatchRef, *args) -> list[ray.ObjectRef]:
        """A forward-only pass over one mini-batch, once every rank has finished it: one ref per
        rank of its (sequence index, ...) rows, which stay in the object store."""
        plan = self._plans(batch, 1)[0]
        calls = self._submit(method, lambda rank, w: w.rows_in_store.remote(method, batch.ref, plan.for_rank(rank), *args))
        self._wait([num_rows for num_rows, _ in calls], method)  # the small results: failures show there
        return [rows for _, rows in calls]

    def _forward(self, method: str, batch: BatchArg, *args) -> list:
        """A forward-only pass: results as (sequence index, ...) rows from all ranks, in batch order."""
        batch = self._stored(batch)
        return rows_in_batch_order(ray.get(self._forward_refs(method, batch, *args)), len(batch),
                                   f"{self.role}.{method}")

    # ----------------------------------------------------------------------------------------

    def compute_logprobs(self, batch: BatchArg, temperature: float = 1.0, with_entropy: bool = False,
                         base: bool = False) -> dict[str, list[torch.Tensor]]:
        """Response-token logprobs (and entropies) of every sequence, in batch order:
        `{"logprobs": [...], "entropy": [...]}`. `temperature` is the sampling temperature; `base`:
        a LoRA actor's logprobs with its adapters off (the reference policy's)."""
        rows = self._forward("compute_logprobs", batch, temperature, with_entropy, base)
        out = {"logprobs": [row[1] for row in rows]}
        if with_entropy:
            out["entropy"] = [row[2] for row in rows]
        return out

    def compute_values(self, batch: BatchArg) -> list[torch.Tensor]:
        """Critic values of every response token, in batch order."""
        return [row[1] for row in self._forward("compute_values", batch)]

    def logprob_rows(self, batch: TrainBatchRef, temperature: float = 1.0, with_entropy: bool = False,
                     base: bool = False) -> list[ray.ObjectRef]:
        """`compute_logprobs` left in the object store, returned once every rank has finished: one
        ref per rank of its (sequence index, logprobs, entropies or None) rows; `rows_in_batch_order`
        merges them where they are read. `base`: a LoRA actor's adapters off (the reference policy)."""
        return self._forward_refs("compute_logprobs", batch, temperature, with_entropy, base)

    def value_rows(self, batch: TrainBatchRef) -> list[ray.ObjectRef]:
        """`compute_values` left in the object store: one ref per rank of its (sequence index, values) rows."""
        return self._forward_refs("compute_values", batch)

    def update_policy(self, batch: BatchArg, temperature: float = 1.0) -> dict[str, float]:
        """PPO update: `num_epochs` x `num_mini_batches` optimizer steps. Needs token fields
        `old_logprobs`, `advantages` (+ `ref_logprobs` with the KL loss, `rollout_logprobs` with TIS)."""
        return self._fan_out("update_policy", batch, self.trainer.num_mini_batches, temperature)[0]

    def update_critic(self, batch: BatchArg) -> dict[str, float]:
        """Value update; needs token fields `values` (at rollout time) and `returns`."""
        return self._fan_out("update_critic", batch, self.trainer.num_mini_batches)[0]

    def sft_step(self, batch: BatchArg) -> dict[str, float]:
        """Supervised NLL on the model tokens of the responses: one optimizer step per mini-batch."""
        return self._fan_out("sft_step", batch, self.trainer.num_mini_batches)[0]

    def update_reward_model(self, batch: BatchArg, num_mini_batches: int = 1) -> dict[str, float]:
        """Bradley-Terry update of a reward model: sequences 2p and 2p+1 are pair p's chosen and
        rejected texts (whole, as the classifier scorer reads them); one optimizer step per
        mini-batch of pairs."""
        return self._fan_out("update_reward_model", batch, num_mini_batches)[0]

    def export_weights(self, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None) -> tuple[list, int]:
        """(ObjectRefs of weight buckets, total bytes); each bucket a list of (HF name, tensor).
        The refs are owned by rank 0's actor: read them while the group is alive, then drop them.
        (Engines get weights through `send_weights`; this is for reading them elsewhere.)"""
        return self._on_all("export_weights", bucket_bytes, dtype)[0]

    def send_weights(self, engines: dict, policy_version: int, settings) -> dict:
        """Sync `engines` (replica index -> (RolloutEngine, incarnation)) to this group's weights,
        labelled `policy_version` (`rlactors.weight_sync.sender`); rank 0's figures of the sync."""
        return self._on_all("send_weights", engines, policy_version, settings)[0]

    def send_weights_ref(self, engines: dict, policy_version: int, settings) -> ray.ObjectRef:
        """`send_weights` without waiting: rank 0's ref (the others run alongside; a rank that fails
        leaves rank 0 waiting in a gather, which its collective timeout ends)."""
        return self._submit("send_weights", lambda rank, w: w.send_weights.remote(engines, policy_version, settings))[0]

    def save_hf(self, path: str) -> None:
        """The model as a Hugging Face folder at `path` (`rlactors.trainer.hf_export`)."""
        if self.role == "critic":  # refused here: an error raised in the ranks tears the group down
            raise ValueError("a critic is not a causal LM: only the actor and reference export to Hugging Face")
        self._on_all("save_hf", str(path))

    def save_checkpoint(self, root: str, step: int) -> str:
        return self._on_all("save_checkpoint", str(root), step)[0]

    def load_checkpoint(self, path: str) -> int:
        return self._on_all("load_checkpoint", str(path))[0]

    def offload(self) -> list[dict]:
        """Every rank's parameters and optimizer state to host memory (colocated: while the engines
        generate); per rank {"phase", "moved_bytes", "memory"}. Calling it again moves nothing."""
        return self._on_all("offload")

    def onload(self) -> list[dict]:
        """Back onto the devices, before the next forward pass; the inverse of `offload`."""
        return self._on_all("onload")

    def phase_logs(self) -> list[list[dict]]:
        """Each rank's phase log (see `rlactors.runtime.phases`), in rank order."""
        return get_within([w.phase_log.remote() for w in self.workers], PHASE_LOG_TIMEOUT_S, f"{self.role} ranks' phase_log")

    def shutdown(self) -> None:
        """Leave the process group on every rank and stop the ranks; at most SHUTDOWN_TIMEOUT_S.
        Every rank is killed in the end; a rank that failed to leave, or did not in time (stuck
        in a collective), is named in a RuntimeError raised after that. Calling it again, or
        after a failure already killed the ranks, does nothing."""
        workers, self.workers = self.workers, []
        if self.stopped is None:
            self.stopped = "it was shut down"
        if not workers:
            return
        try:
            _, errors, not_done = gather({rank: w.shutdown.remote() for rank, w in enumerate(workers)},
                                         SHUTDOWN_TIMEOUT_S)
            problems = [f"rank {rank} did not leave its process group within {SHUTDOWN_TIMEOUT_S:g} s"
                        for rank in not_done]
            problems += [f"rank {rank}: {error_text(error, first_line=True)}" for rank, error in errors.items()]
        finally:
            kill_ranks(workers)
        if problems:
            raise RuntimeError(f"{self.role} group shutdown (every rank was killed): " + "; ".join(problems))
