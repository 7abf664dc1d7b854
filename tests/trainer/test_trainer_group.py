"""Trainer groups on real Ray actors and gloo process groups: split invariance, roles, critic,
and a failing rank (raised, killed, stuck) surfacing by name with no rank left behind."""

import os
import signal
import threading
import time

import pytest
import torch
from trainer_helpers import (
    KeptGroup,
    assert_ranks_gone,
    max_difference,
    random_batch,
    random_fields,
    trainer_config,
    weights,
)

from rlactors.config import AlgorithmConfig, OptimConfig
from rlactors.models import load_model
from rlactors.trainer.batch import LOSS_MASK, TrainBatchRef, rows_in_batch_order
from rlactors.trainer.group import TrainerGroup
from rlactors.trainer.plan import plan_mini_batches
from rlactors.trainer.ranks import TrainerRankError

# Every loss term on: clip-higher, dual clip, KL loss, entropy bonus; and importance weights
# (decoupled rollout correction), set on the batch by `_importance_weights`.
ALGORITHM = AlgorithmConfig(clip_ratio_high=0.28, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
TEMPERATURE = 0.7


def _importance_weights(batch):
    generator = torch.Generator().manual_seed(9)
    batch.set_field("importance_weights", [(2 * torch.rand(len(r), generator=generator)).clamp(max=1.5)
                                           for r in batch.response_token_ids])


@pytest.fixture(scope="module")
def groups(ray_session, tiny_model_dir):
    """The last group started, given to the next test of the same role and ranks as new
    (`start_run`). Tests that break a group (a rank killed, a collective timed out) start their own."""
    kept = KeptGroup(tiny_model_dir)
    yield kept
    kept.shutdown()


def _run_update(groups, config, batch, old_logprobs):
    group = groups.get("actor", config, ALGORITHM)
    logprobs = group.compute_logprobs(batch, TEMPERATURE)["logprobs"]
    if old_logprobs is None:
        old_logprobs = logprobs
    torch.testing.assert_close(torch.cat(logprobs), torch.cat(old_logprobs), rtol=0, atol=1e-5)
    batch.set_field("old_logprobs", old_logprobs)
    batch.set_field("ref_logprobs", [lp + 0.1 * torch.randn(len(lp), generator=torch.Generator().manual_seed(1))
                                     for lp in old_logprobs])
    batch.set_field("rollout_logprobs", [lp - 0.05 for lp in old_logprobs])
    _importance_weights(batch)
    metrics = group.update_policy(batch, TEMPERATURE)
    return metrics, weights(group), old_logprobs


def test_update_is_independent_of_ranks_and_micro_batches(groups):
    batch = random_batch(12, seed=1)
    random_fields(batch, ["advantages"], seed=2)
    # Adam's first steps are nearly sign(gradient) steps: a gradient element at float32 noise level
    # (|g| ~ 1e-8 beside a largest |g| ~ 0.1) would move by up to lr whichever way its rounding
    # went. A larger eps keeps such elements still, so what is compared is the gradient itself.
    optim = OptimConfig(lr=2e-3, eps=1e-5, grad_clip=0.5)
    settings = dict(num_mini_batches=2, num_epochs=2, optim=optim)
    small = 16  # tokens: one or two sequences per micro-batch
    plans = plan_mini_batches(batch.sequence_lengths, batch.num_model_tokens, 2, 1, small)
    assert all(len(plan.micro_batches[0]) >= 4 for plan in plans)

    reference, reference_weights, old_logprobs = _run_update(groups, trainer_config(**settings), batch, None)
    assert reference["actor/num_optimizer_steps"] == 4 and reference["actor/num_skipped_steps"] == 0
    assert reference["actor/pg_clipfrac"] > 0  # the second epoch moves off-policy enough to clip
    for config in (trainer_config(num_workers=2, **settings), trainer_config(max_tokens_per_micro_batch=small, **settings)):
        metrics, other_weights, _ = _run_update(groups, config, batch, old_logprobs)
        assert metrics.keys() == reference.keys()
        for key, value in reference.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert max_difference(other_weights, reference_weights) < 2e-6


def test_garbage_at_observation_tokens_changes_no_weight(groups):
    """A multi-turn batch: advantages of 1e4 at observation tokens (loss_mask 0) train exactly
    like zeros there, through every loss term of the update."""
    batch = random_batch(8, seed=3)
    generator = torch.Generator().manual_seed(4)
    batch.set_field(LOSS_MASK, [(torch.rand(len(r), generator=generator) < 0.6).float() for r in batch.response_token_ids])
    random_fields(batch, ["advantages"], seed=5)
    observation = [m == 0 for m in batch.token_field(LOSS_MASK)]
    assert sum(int(o.sum()) for o in observation) > 0
    garbage = batch.select(list(range(len(batch))))
    garbage.set_field("advantages", [torch.where(o, 1e4, a) for o, a in zip(observation, batch.token_field("advantages"),
                                                                             strict=True)])
    clean_metrics, clean_weights, old_logprobs = _run_update(groups, trainer_config(), batch, None)
    metrics, garbage_weights, _ = _run_update(groups, trainer_config(), garbage, old_logprobs)
    assert metrics["actor/pg_loss"] == pytest.approx(clean_metrics["actor/pg_loss"], rel=1e-6)
    assert max_difference(garbage_weights, clean_weights) == 0


def test_an_update_without_old_logprobs_equals_one_after_the_old_logprob_pass(groups):
    """One mini-batch, one epoch: the update's own logprobs (detached) are the old ones, so the
    pass before it can be skipped (`algorithm.old_logprobs: auto`); metrics and weights are those
    of the update after the pass, and the update reports the rollout/trainer gap the pass gave."""
    results = {}
    for recompute in (True, False):
        batch = random_batch(12, seed=3)
        random_fields(batch, ["advantages"], seed=4)
        group = groups.get("actor", trainer_config(optim=OptimConfig(lr=2e-3, eps=1e-5)), ALGORITHM)
        logprobs = group.compute_logprobs(batch, TEMPERATURE)["logprobs"]
        noise = torch.Generator().manual_seed(5)
        batch.set_field("rollout_logprobs", [lp - 0.05 + 0.02 * torch.randn(len(lp), generator=noise)
                                             for lp in logprobs])
        batch.set_field("ref_logprobs", [lp + 0.1 for lp in logprobs])
        _importance_weights(batch)
        if recompute:
            batch.set_field("old_logprobs", logprobs)
        results[recompute] = (group.update_policy(batch, TEMPERATURE), weights(group), batch, logprobs)
    (after_pass, pass_weights, batch, logprobs), (from_update, update_weights, _, _) = results[True], results[False]
    assert set(from_update) - set(after_pass) == {"actor/rollout_trainer_kl", "actor/rollout_logprob_abs_diff_max",
                                                  "actor/rollout_logprob_abs_diff_mean"}
    for key, value in after_pass.items():
        assert from_update[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert after_pass["actor/pg_loss"] != 0 and after_pass["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert max_difference(update_weights, pass_weights) < 2e-6
    gap = torch.cat(batch.token_field("rollout_logprobs")) - torch.cat(logprobs)
    assert from_update["actor/rollout_trainer_kl"] == pytest.approx(float(gap.mean()), abs=1e-6)
    assert from_update["actor/rollout_logprob_abs_diff_max"] == pytest.approx(float(gap.abs().max()), abs=1e-6)
    assert from_update["actor/rollout_logprob_abs_diff_mean"] == pytest.approx(float(gap.abs().mean()), abs=1e-6)


def test_an_update_without_old_logprobs_refuses_several_mini_batches(groups):
    batch = random_batch(8, seed=6)
    random_fields(batch, ["advantages", "rollout_logprobs", "ref_logprobs"], seed=7)
    group = groups.get("actor", trainer_config(num_mini_batches=2), ALGORITHM)
    with pytest.raises(Exception, match="without old_logprobs needs one mini-batch and one epoch"):
        group.update_policy(batch, TEMPERATURE)


def test_reference_logprobs_match_a_transformers_forward(groups, tiny_model_dir):
    import ray

    batch = random_batch(6, seed=3)
    group = groups.get("reference", trainer_config(num_workers=2))
    out = group.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    # The same pass on a batch already in the object store, its rows left there too.
    stored = TrainBatchRef.of(ray.put(batch), batch)
    rows = rows_in_batch_order(ray.get(group.logprob_rows(stored, TEMPERATURE)), len(batch), "reference")
    assert all(torch.equal(row[1], logprobs) for row, logprobs in zip(rows, out["logprobs"], strict=True))
    # One sequence for two ranks: rank 1 runs a filler forward and returns nothing.
    single = group.compute_logprobs(batch.select([0]), temperature=TEMPERATURE)["logprobs"]
    torch.testing.assert_close(single[0], out["logprobs"][0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="update_policy needs a trainer of role actor; this one is 'reference'"):
        group.update_policy(batch)
    model = load_model(tiny_model_dir)
    for i, (prompt, response) in enumerate(zip(batch.prompt_token_ids, batch.response_token_ids, strict=True)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0] / TEMPERATURE
        logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]
        logp = torch.log_softmax(logits, -1)
        expected = logp.gather(-1, torch.tensor(response, dtype=torch.long).unsqueeze(-1)).squeeze(-1)
        expected_entropy = -(logp.exp() * logp).sum(-1)
        assert out["logprobs"][i].shape == (len(response),)
        torch.testing.assert_close(out["logprobs"][i], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["entropy"][i], expected_entropy, rtol=1e-5, atol=1e-5)


def test_critic_learns_returns(groups):
    batch = random_batch(8, seed=4)
    config = trainer_config(critic_optim=OptimConfig(lr=1e-2), num_mini_batches=2)
    group = groups.get("critic", config, AlgorithmConfig(value_clip=100.0))
    values = group.compute_values(batch)
    assert [v.shape[0] for v in values] == batch.response_lengths
    assert all(torch.equal(a, b) for a, b in zip(values, group.compute_values(batch), strict=True))  # no dropout
    batch.set_field("values", values)
    batch.set_field("returns", [torch.ones(n) for n in batch.response_lengths])
    losses = [group.update_critic(batch) for _ in range(6)]
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr"} <= losses[0].keys()
    assert losses[-1]["critic/vf_loss"] < 0.5 * losses[0]["critic/vf_loss"]
    error_before = torch.cat([v - 1 for v in values]).abs().mean()
    error_after = torch.cat([v - 1 for v in group.compute_values(batch)]).abs().mean()
    assert error_after < 0.5 * error_before
    with pytest.raises(ValueError, match="compute_logprobs needs a trainer of role actor or reference"):
        group.compute_logprobs(batch)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_forward_after_updates_uses_the_current_weights(groups, tiny_model_dir, num_workers):
    """After each optimizer step, the actor's next forward runs the weights it exports (a forward
    on parameters gathered before the step would be one update behind)."""
    batch = random_batch(6, seed=4)
    random_fields(batch, ["advantages"], seed=5)
    group = groups.get("actor", trainer_config(num_workers=num_workers), AlgorithmConfig(), norm_tokens=16)
    for _ in range(2):
        batch.set_field("old_logprobs", group.compute_logprobs(batch, TEMPERATURE)["logprobs"])
        group.update_policy(batch, TEMPERATURE)
    logprobs = group.compute_logprobs(batch, TEMPERATURE)["logprobs"]
    exported = weights(group)
    model = load_model(tiny_model_dir)
    model.load_state_dict(exported, strict=False)  # the tied lm_head follows the embedding
    for i, (prompt, response) in enumerate(zip(batch.prompt_token_ids, batch.response_token_ids, strict=True)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(response)]
        expected = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(response).unsqueeze(-1))[:, 0]
        torch.testing.assert_close(logprobs[i], expected, rtol=1e-5, atol=1e-5)


def test_reward_model_update_is_independent_of_ranks_and_micro_batches(groups, tiny_model_dir):
    """A Bradley-Terry step on preference pairs (sequences 2p chosen, 2p+1 rejected): its loss is
    that of a transformers classifier of the same start (pooled at each sequence's last token), and
    loss, accuracy and weights are the same on two ranks and with one pair per micro-batch, so
    every pair stays whole in one micro-batch and the loss is normalised by the step's pairs."""
    from rlactors.trainer.fsdp import load_role_model

    batch = random_batch(12, seed=6)
    model = load_role_model(str(tiny_model_dir), "reward_model", seed=0)  # the ranks' start, head included
    with torch.no_grad():
        scores = torch.stack([model(torch.tensor([p + r])).logits[0, 0] for p, r in
                              zip(batch.prompt_token_ids, batch.response_token_ids, strict=True)])
    margins = scores[0::2] - scores[1::2]
    optim = OptimConfig(lr=2e-3, eps=1e-5, grad_clip=0.5)
    results = []
    for config in (trainer_config(num_workers=2, optim=optim), trainer_config(optim=optim),
                   trainer_config(max_tokens_per_micro_batch=16, optim=optim)):  # one pair per micro-batch
        group = groups.get("reward_model", config)
        results.append((group.update_reward_model(batch), weights(group)))
    reference, reference_weights = results[0]
    assert reference["reward_model/bt_loss"] == pytest.approx(float(-torch.nn.functional.logsigmoid(margins).mean()),
                                                              rel=1e-5)
    assert reference["reward_model/preference_accuracy"] == pytest.approx(float((margins > 0).float().mean()))
    assert reference["reward_model/num_optimizer_steps"] == 1
    assert "score.weight" in reference_weights and max_difference(reference_weights, weights_of(model)) > 1e-4
    for metrics, other_weights in results[1:]:
        assert metrics.keys() == reference.keys()
        for key, value in reference.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert max_difference(other_weights, reference_weights) < 2e-6


def weights_of(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def test_start_run_makes_a_used_group_what_a_new_one_is(ray_session, tiny_model_dir):
    """A group kept for the next run (`rlactors.pipelines.warm`): after two updates, `start_run`
    brings back the model folder's weights, a fresh optimizer (Adam's first step differs from its
    second), the schedule's first step (warm-up: the lr grows per step) and the counters, on the
    same processes; the next update is the group's first update again, to the bit."""
    batch = random_batch(6, seed=4)
    random_fields(batch, ["advantages"], seed=5)
    config = trainer_config(num_workers=2, optim=OptimConfig(lr=2e-3, warmup_steps=4))
    group = TrainerGroup("actor", tiny_model_dir, config, AlgorithmConfig(), norm_tokens=16)

    def update() -> tuple[dict, dict]:
        batch.set_field("old_logprobs", group.compute_logprobs(batch, TEMPERATURE)["logprobs"])
        return group.update_policy(batch, TEMPERATURE), weights(group)

    try:
        initial = weights(group)
        first_metrics, first_weights = update()
        second_metrics, _ = update()
        assert second_metrics["actor/lr"] > first_metrics["actor/lr"]
        pids = [info["pid"] for info in group.info]
        group.start_run(tiny_model_dir, config, AlgorithmConfig(), norm_tokens=16)
        assert [info["pid"] for info in group.info] == pids
        assert max_difference(weights(group), initial) == 0
        metrics, updated = update()
        assert metrics == first_metrics
        assert max_difference(updated, first_weights) == 0
    finally:
        group.shutdown()


def test_cpu_cores_all_pins_a_rank_to_every_core_it_may_use(ray_session, tiny_model_dir):
    import os

    import ray

    def threads_and_cores(worker):
        return torch.get_num_threads(), sorted(os.sched_getaffinity(0))

    group = TrainerGroup("reference", tiny_model_dir, trainer_config(cpu_cores="all"))
    try:
        num_threads, cores = ray.get(group.workers[0].__ray_call__.remote(threads_and_cores))
    finally:
        group.shutdown()
    assert cores == sorted(os.sched_getaffinity(0)) and num_threads == len(cores)


# ---------------------------------------------------------------------------------------------
# A failing rank: the group stops at its error, names the rank, and leaves no rank behind.
# Rank 1 is held in an earlier call (`_hold`) where a fault must land while rank 0 is inside a
# collective: a tiny model's update is over too soon to be hit otherwise.


def _update_batch(seed: int):
    batch = random_batch(8, seed=seed)
    random_fields(batch, ["old_logprobs", "advantages"], seed=seed + 1)
    return batch


def _hold(worker, seconds: float = 600.0):
    """Keep `worker` busy: the calls submitted after it wait behind it (the kill ends it)."""
    return worker.__ray_call__.remote(lambda _: time.sleep(seconds))


def test_a_raise_in_rank_1_alone_surfaces_naming_it(ray_session, tiny_model_dir):
    """A token id outside the vocabulary in rank 1's shard only: rank 1 raises while rank 0 waits in
    the update's first collective for a peer that never comes. The error names rank 1 with rank 0
    still in the call (not after the collective timeout), and no rank is left."""
    batch = _update_batch(6)
    config = trainer_config(num_workers=2)
    plan = plan_mini_batches(batch.sequence_lengths, batch.num_model_tokens, 1, 2, config.max_tokens_per_micro_batch)[0]
    sequence = plan.for_rank(1).micro_batches[0][0][0]
    batch.prompt_token_ids[sequence][0] = 10**6
    group = TrainerGroup("actor", tiny_model_dir, config, AlgorithmConfig())
    workers = list(group.workers)
    try:
        with pytest.raises(TrainerRankError, match=rf"actor rank 1 failed in update_policy: ValueError: sequence "
                                                   rf"{sequence} .*outside the model's vocabulary") as failure:
            group.update_policy(batch)
        assert failure.value.rank == 1 and failure.value.not_done == [0]
        assert_ranks_gone(workers)
        with pytest.raises(RuntimeError, match="the actor group cannot be used, its ranks were killed after: actor rank 1"):
            group.compute_logprobs(batch)
    finally:
        group.shutdown()


def test_sigkill_of_rank_1_mid_update_surfaces_naming_it(ray_session, tiny_model_dir):
    """Rank 1 SIGKILLed while the update is in flight (rank 0 inside it): the error names rank 1
    as dead, whatever rank 0's broken collective raised meanwhile, and no rank is left."""
    batch = _update_batch(7)
    group = TrainerGroup("actor", tiny_model_dir, trainer_config(num_workers=2), AlgorithmConfig())
    workers = list(group.workers)
    pid = group.info[1]["pid"]
    _hold(workers[1])
    updating = threading.Event()

    def kill_rank_1():
        updating.wait(120)
        time.sleep(1.0)  # orders the kill after the update's submission (either order tests a dead rank 1)
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    try:
        updating.set()
        with pytest.raises(TrainerRankError, match=r"actor rank 1 failed in update_policy: its process died"):
            group.update_policy(batch)
        assert_ranks_gone(workers)
    finally:
        killer.join(timeout=120)
        group.shutdown()


def test_a_collective_past_the_timeout_raises_on_the_waiting_rank(ray_session, tiny_model_dir):
    """trainer.collective_timeout_s bounds a collective: rank 1 stuck elsewhere (alive, so nothing
    failed), rank 0's first all-gather raises after the timeout; the group names rank 0's error and
    rank 1 as not done, and kills both."""
    group = TrainerGroup("reference", tiny_model_dir, trainer_config(num_workers=2, collective_timeout_s=8))
    workers = list(group.workers)
    _hold(workers[1])
    try:
        with pytest.raises(TrainerRankError, match="reference rank 0 failed in compute_logprobs: .*[Tt]imed out") as failure:
            group.compute_logprobs(random_batch(4, seed=8))
        assert failure.value.not_done == [1]
        assert_ranks_gone(workers)
    finally:
        group.shutdown()
