"""The pieces every driver is made of: plain functions over the actors.

A driver (colocated.py, fully_async.py, or your own notebook cell) reads as: build the `Run`
(`rlactors.pipelines.build`), then loop `produce` -> `sample` -> `prepare_batch` -> `update` ->
`sync_weights`, validating and checkpointing every few steps. Nothing here holds state of its own
beyond the `Run` record.

Rollout data never passes through the driver: Groups go engine -> scorer -> buffer -> batch builder
-> trainer ranks as object refs, and the driver reads summaries (ids, lengths, scores, staleness),
metrics and counts (`benchmarks/driver_bytes.py` measures it).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np

from rlactors.buffer.client import BUFFER_TIMEOUT_S
from rlactors.buffer.records import PUT_OUTCOMES, SampledBatchRef
from rlactors.config import Config
from rlactors.metrics import MetricsLogger, plot_metrics
from rlactors.pipelines.build import Run, requests_for
from rlactors.placement.plan import needs_reference_policy
from rlactors.runtime.calls import get_within
from rlactors.trainer.batch import TrainBatchRef
from rlactors.types import PromptRequest

# Assembling a batch and its advantages is bookkeeping on data already in the object store: seconds
# even at scale; past this the builder is stuck.
BUILDER_TIMEOUT_S = 600.0


# --------------------------------------------------------------------------------------------
# Rollout side


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
            run.buffer.add_prompts(requests_for(rows, run.tokenizer, run.config), epoch)
            num_prompts -= take


def produce(run: Run, max_groups: int, producer_id: str = "driver", timeout_s: float | None = None) -> int:
    """Reserve prompts, generate, score each group as it arrives, and put it in the buffer (the
    Groups travel as refs: engine -> scorer -> buffer). Returns the number of groups produced (0:
    nothing could be reserved, within `timeout_s` when given)."""
    requests = run.buffer.reserve(max_groups, producer_id, timeout_s)
    if not requests:  # None under backpressure: the producers are as far ahead as the staleness bound allows
        return 0
    return sum(generate_and_put(run, requests).values())


def generate_and_put(run: Run, requests: list[PromptRequest]) -> dict[str, int]:
    """Generate the reserved `requests`, score each group as it arrives and put it in the buffer;
    returns once every put landed. Returns how many groups the buffer kept, dropped (by why) and
    ignored as superseded (`BufferCore.put`'s outcomes, summed over the groups)."""
    puts = run.buffer.put_refs([run.reward.score(group_ref) for _, group_ref in run.router.generate_refs(requests)])
    num_samples = run.config.rollout.sampling.num_samples_per_prompt
    answers = get_within(puts, scoring_bound_s(run.config, len(puts), num_samples), "replay_buffer.put of scored groups")
    return {outcome: sum(answer[outcome] for answer in answers) for outcome in PUT_OUTCOMES}


# --------------------------------------------------------------------------------------------
# Trainer side


def prepare_batch(run: Run, sampled: SampledBatchRef) -> tuple[TrainBatchRef, dict[str, float]]:
    """Old/reference logprobs, values, token rewards and advantages for one sampled batch. The
    batch builder assembles the batch and computes the advantages from the trainers' rows; the
    driver passes refs along and receives lengths and metrics (see `rlactors.pipelines.batch_builder`)."""
    algorithm, temperature = run.config.algorithm, run.config.rollout.sampling.temperature
    timings: dict[str, float] = {}
    # A LoRA actor is its own reference policy: its base, adapters off (no reference group runs).
    base_as_reference = run.reference is None and run.config.model.lora.enabled and needs_reference_policy(run.config)
    old_pass, ref_pass = old_logprob_pass(run.config), run.reference is not None or base_as_reference
    values_pass = algorithm.advantage == "gae"
    if not (old_pass or ref_pass or values_pass):
        with timed(timings, "adv"):  # no trainer pass first: assembly (its time counted here) and advantages in one call
            batch, metrics, _ = get_within(run.builder.assemble_and_finish.remote(sampled.groups_ref),
                                           BUILDER_TIMEOUT_S, "batch_builder.assemble_and_finish")
        return batch, metrics | timings
    with timed(timings, "assemble"):
        batch = get_within(run.builder.assemble.remote(sampled.groups_ref), BUILDER_TIMEOUT_S,
                           "batch_builder.assemble")
    # One trainer after the other, as they would run with the rows fetched here: colocated roles
    # share devices, and three forward passes at once would need three times the activations.
    # Each returns once all its ranks finished, or raises naming the rank that failed.
    old_rows = ref_rows = value_rows = None
    if old_pass:
        with timed(timings, "old_log_prob"):
            old_rows = run.actor.logprob_rows(batch, temperature)
    if ref_pass:
        with timed(timings, "ref"):
            ref_rows = run.actor.logprob_rows(batch, temperature, base=True) if base_as_reference \
                else run.reference.logprob_rows(batch, temperature)
    if values_pass:
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
    for name in ("trainer_kl", "logprob_abs_diff_max", "logprob_abs_diff_mean"):
        if f"actor/rollout_{name}" in actor:
            actor[f"rollout/{name}"] = actor.pop(f"actor/rollout_{name}")
    for key in [k for k in actor if k.startswith("actor/rollout_corr/")]:  # bypass mode's, measured by the update
        actor[key.removeprefix("actor/")] = actor.pop(key)
    return metrics | actor | timings


def old_logprobs_from_update(config: Config) -> bool:
    """Whether the update takes its own logprobs as old ones instead of a pass before it: asked
    (`algorithm.old_logprobs: auto`) and equal by construction. Colocated, the batch was generated
    with the actor's current weights; with one mini-batch and one epoch they stay so until the
    update's only optimizer step; and no KL penalty in the reward needs them before the update."""
    trainer, algorithm = config.trainer, config.algorithm
    correction = algorithm.rollout_correction
    return (algorithm.old_logprobs == "auto" and config.pipeline.mode == "colocated"
            and trainer.num_mini_batches == 1 and trainer.num_epochs == 1 and not algorithm.use_kl_in_reward
            and not (correction.enabled and not correction.bypass_mode))


def old_logprob_pass(config: Config) -> bool:
    """Whether the actor computes the batch's old logprobs before the update: not when the update
    takes its own (`old_logprobs_from_update`), nor in bypass mode, where the rollout's are the old ones."""
    return not (old_logprobs_from_update(config) or config.algorithm.rollout_correction.bypass_mode)


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
    run.buffer.set_policy_version(run.policy_version)
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
    """Reward, length and staleness metrics of a sampled batch, from the numbers the buffer sent;
    the prompts the buffer dropped since the previous batch, by kind (rollout_error,
    zero_variance, stale), and the groups it evicted as too stale (generation thrown away).
    `response_length/*` count every response token; `response/*` split them into the model's and
    observations (multi-turn tool or environment output), and `episode/*` count turns and tool
    calls per sample."""
    lengths = np.array(sampled.response_lengths, dtype=float)
    # A SampledBatchRef built without the per-sample counts (older callers) reads as single-turn.
    model_tokens = np.array(sampled.num_model_tokens or sampled.response_lengths, dtype=float)
    scores = np.array(sampled.scores, dtype=float)
    accuracy = [value for value in sampled.accuracies if value is not None]
    staleness = sampled.staleness
    metrics = {
        "reward/mean": float(scores.mean()),
        "reward/num_score_errors": float(sampled.num_score_errors),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        # The tail a colocated step waits for (a fully-async one streams past it).
        **{f"response_length/p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 99)},
        "response_length/clip_ratio": float((lengths >= max_response_tokens).mean()),
        "response/model_tokens_mean": float(model_tokens.mean()),
        "response/observation_tokens_mean": float((lengths - model_tokens).mean()),
        "episode/num_turns_mean": float(np.mean(sampled.num_turns)) if sampled.num_turns else 1.0,
        "episode/tool_calls_mean": float(np.mean(sampled.num_tool_calls)) if sampled.num_tool_calls else 0.0,
        "staleness/mean": float(np.mean(staleness)) if staleness else 0.0,
        "staleness/max": float(max(staleness)) if staleness else 0.0,
        **{f"buffer/num_dropped_{kind}": float(count) for kind, count in sampled.num_dropped.items()},
        "buffer/num_evicted_stale": float(sampled.num_evicted_stale),
    }
    if accuracy:
        metrics["reward/acc"] = float(np.mean(accuracy))
    metrics |= {f"reward/{name}/mean": float(np.mean(values)) for name, values in sampled.score_parts.items()}
    return metrics


def rollout_occupancy(before: dict, after: dict) -> dict[str, float]:
    """The engines' occupancy between two `RolloutRouter.clocks()` readings: their mean running
    requests over the time they generated (`rollout/running_requests_mean`), and that as a share of
    their `max_num_seqs` (`rollout/occupancy`; 1: full the whole time). A long tail shows as a
    falling occupancy: the last responses run with few others beside them. {} when either reading
    is empty, nothing was generated, or a replica restarted in between (its clocks started again)."""
    if not before or not after or not after["max_num_seqs"]:
        return {}
    generating_s = after["time_s"]["generating"] - before["time_s"]["generating"]
    running_request_s = after["running_request_s"] - before["running_request_s"]
    if generating_s <= 0 or running_request_s < 0:
        return {}
    running = running_request_s / generating_s
    return {"rollout/running_requests_mean": running, "rollout/occupancy": running / after["max_num_seqs"]}


def validate(run: Run) -> dict[str, float]:
    """Accuracy, and pass@k with several responses per prompt, per data source on the validation
    prompts (`rlactors.metrics.evaluation`); every response lands in output_dir/validation/step_N.parquet."""
    if not run.val_requests:
        return {}
    metrics = score_requests(run.router, run.reward, run.builder, run.val_requests, run.config,
                             run.output_dir / "validation" / f"step_{run.step}.parquet")
    return {f"val/{name}": value for name, value in metrics.items()}


def score_requests(router, reward, builder, requests: list[PromptRequest], config: Config,
                   samples_path: Path | None) -> dict[str, float]:
    """Generate `requests` with the validation sampling, score them and report per data source
    (the groups go engine -> scorer -> builder; the driver gets the numbers). Training's
    validation and `python -m rlactors eval` both run this."""
    sampling = config.rollout.validation_sampling
    scored = [reward.score(ref) for _, ref in router.generate_refs(requests, sampling)]
    bound_s = scoring_bound_s(config, len(scored), sampling.num_samples_per_prompt)
    report = builder.validation_report.remote(*scored, samples_path=str(samples_path) if samples_path else None)
    return get_within(report, bound_s, "batch_builder.validation_report")  # the groups are read there


def throughput(sampled: SampledBatchRef, step_s: float, num_devices: int) -> float:
    num_tokens = sum(sampled.prompt_lengths) + sum(sampled.response_lengths)
    return num_tokens / max(step_s, 1e-9) / max(num_devices, 1)




# --------------------------------------------------------------------------------------------
# The parts of a step loop every driver shares


def begin(run: Run, history: list[dict]) -> MetricsLogger:
    """Resume if asked, send the run's weights to engines that do not hold them (restored ones;
    engines taken from `run.warm` hold the last run's and sleep), open the metrics log, and
    validate once before the first step of a fresh run (appended to `history` as step 0)."""
    from rlactors.pipelines.checkpointing import checkpoint_root, load_run
    from rlactors.trainer.checkpoint import remove_unfinished

    removed = remove_unfinished(checkpoint_root(run.output_dir))
    if removed:
        print(f"removed {len(removed)} unfinished checkpoint folder(s) an interrupted run left: "
              f"{', '.join(path.name for path in removed)}")
    resume_from = run.resume_from
    if resume_from is not None:
        load_run(run, resume_from)
    if resume_from is not None or run.engines_taken:
        publish_weights(run)  # the engines started from the model folder, or hold another run's weights
        run.router.wake_up()  # taken engines slept while kept; awake ones have nothing to wake
    if resume_from is not None:
        print(f"resumed from {resume_from} at step {run.step}, policy_version {run.policy_version}")
    pipeline = run.config.pipeline
    logger = MetricsLogger(run.output_dir, pipeline.num_steps, append=resume_from is not None, loggers=pipeline.loggers,
                           config=run.config.model_dump(mode="json"), project=pipeline.project,
                           run_name=pipeline.run_name)
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
    run.reward.check_step(len(sampled.scores), sampled.num_score_errors, sampled.first_score_error)  # stops a run scoring nothing
    metrics |= {f"timing_s/{name}": seconds for name, seconds in timings.items()}
    metrics["throughput/tokens_per_s_per_device"] = throughput(sampled, timings["step"], run.num_devices)
    metrics["policy_version"] = run.policy_version
    if (pipeline.val_every_steps and run.step % pipeline.val_every_steps == 0) or run.step == pipeline.num_steps:
        metrics |= validate(run)
    checkpoint_due = pipeline.checkpoint_every_steps and run.step % pipeline.checkpoint_every_steps == 0
    export_due = pipeline.export_hf_every_steps and run.step % pipeline.export_hf_every_steps == 0
    if checkpoint_due or export_due:
        with trainer_turn(run):
            if export_due:  # first: a run resumed from this step's checkpoint has its export
                export_hf(run)
            if checkpoint_due:
                save_run(run)
    logger.log(run.step, metrics)
    return {"step": run.step, **metrics}


@contextlib.contextmanager
def trainer_turn(run: Run, wake_up: bool = True):
    """The device to the trainers for a checkpoint or an export between steps. Colocated with
    `trainer.offload`, the engines are awake there and the trainers' state comes back onto the
    device for the gathers, so the engines sleep meanwhile; afterwards they wake (at sleep level 2,
    which drops the weights, after the same weights are sent again). Elsewhere: nothing to do."""
    if run.config.pipeline.mode != "colocated" or not run.config.trainer.offload:
        yield
        return
    run.router.sleep()
    run.reward.offload()
    yield
    if wake_up:
        if run.config.rollout.sleep_level == 2:
            publish_weights(run)
        run.reward.onload()
        run.router.wake_up()


def hf_folder(run: Run) -> Path:
    return run.output_dir / "hf" / f"step_{run.step}"


def export_hf(run: Run) -> Path:
    """The actor as a Hugging Face folder, output_dir/hf/step_N (`rlactors.trainer.hf_export`)."""
    run.actor.save_hf(str(hf_folder(run)))
    run.exported_step = run.step
    return hf_folder(run)


def finish(run: Run, logger: MetricsLogger) -> None:
    """Write the final model unless this step's is written, then close the metrics and draw them."""
    model = hf_folder(run)
    if run.exported_step != run.step:  # never a folder an earlier run left at this step
        with trainer_turn(run, wake_up=False):  # the run is over: the engines stop next
            export_hf(run)
    logger.close()
    png = plot_metrics(logger.path, run.output_dir / "metrics.png")
    print(f"metrics: {logger.path}\nplot: {png}\nmodel: {model} (Hugging Face folder)")
    run.finished = True