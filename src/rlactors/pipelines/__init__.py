"""Drivers that compose the actors into GRPO, DAPO and PPO (the algorithm is configuration:
`algorithm.advantage`, clip ranges, KL, dynamic sampling), in colocated or fully-async mode.
`warm` (a `rlactors.pipelines.warm.WarmActors`) keeps the rollout engines and trainer groups
started from one run to the next in the same process.

One GRPO step, file by file (colocated; `Run` is built once by `build.build_run`, after
`preflight` refused what cannot run):

    colocated.run_colocated          the loop: one step per pass
      colocated.fill_batch           until the buffer holds a batch:
        common.feed_prompts            data cursor -> buffer/client.BufferClient.add_prompts -> buffer/replay
        common.produce                 BufferClient.reserve (prompts, each a new group_id), then for each
          rollout/router.RolloutRouter.generate_refs   over the live replicas: rollout/engine.RolloutEngine
                                         .generate (vLLM: tokens, logprobs, each token's policy_version)
          reward/pool.RewardPool.score   a ref in, a ref out: reward/scorer.RewardScorer in its worker
          BufferClient.put_refs          the scored Group reaches the buffer by ref, never the driver
        BufferClient.sample            a batch within the staleness bound (stale groups evicted)
      router.sleep                   the engines give the devices to the trainers (RewardPool.offload:
                                     the reward models on them too)
      common.prepare_batch           pipelines/batch_builder.BatchBuilder.assemble (rows from the Groups),
                                     trainer/group.TrainerGroup.logprob_rows (old, reference logprobs;
                                     values for PPO), BatchBuilder.finish (algorithms/advantages)
      common.update                  TrainerGroup.update_policy: trainer/worker.TrainerWorker on every
                                     rank (FSDP2, trainer/policy_objective, algorithms/losses)
      BufferClient.ack               the ledger records each prompt "trained", exactly once
      common.sync_weights            router.weight_sync_targets -> TrainerGroup.send_weights
                                     (weight_sync/sender, trainer_engines, client -> the engines'
                                     rollout/weights) -> the buffer's policy_version
      router.wake_up                 the KV cache back; generation may resume
      common.end_step                metrics, validation and checkpoints (checkpointing) every few steps

Fully-async (`fully_async.run_fully_async`) runs the same pieces on two threads of the driver: the
`Producer` thread streams, keeping `pipeline.num_groups_in_flight` groups generating on one open
rollout/stream.GenerationStream (router.stream) and topping it up group by group (feed_prompts ->
BufferClient.reserve -> stream.add; each finished group -> RewardPool.score -> BufferClient.put_refs)
within `capacity_groups` kept per published version, while the trainer thread loops BufferClient.sample ->
prepare_batch -> update -> sync_weights -> ack on devices of its own, telling the producer each
published version (the ack comes last: the room it frees is generated under the new weights).
Every call to an actor is bounded (`rlactors.runtime.calls`); `teardown` stops whatever a run started.

`reward_model_training.train_reward_model` is a job of its own: preference pairs (data/preferences)
-> a TrainerGroup of role reward_model (TrainerWorker.update_reward_model, algorithms/losses
.bradley_terry_loss) -> a classifier folder that `reward.models` loads.
"""

from __future__ import annotations


def run_pipeline(config, model_path: str | None = None, warm=None) -> list[dict]:
    if config.pipeline.mode == "colocated":
        from rlactors.pipelines.colocated import run_colocated

        return run_colocated(config, model_path, warm)
    from rlactors.pipelines.fully_async import run_fully_async

    return run_fully_async(config, model_path, warm)
