"""Trainer state on real Ray actors: checkpoint/resume, skipped non-finite steps, SFT, weight export
and the Hugging Face folder."""

import math

import pytest
import ray
import torch
from trainer_helpers import max_difference, random_batch, random_fields, trainer_config, weights
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlactors.config import AlgorithmConfig, OptimConfig
from rlactors.trainer import checkpoint
from rlactors.trainer.group import TrainerGroup

OPTIM = OptimConfig(lr=1e-2, warmup_steps=2, lr_schedule="cosine", total_steps=6)


def _policy_batch(group, seed):
    batch = random_batch(8, seed=seed)
    random_fields(batch, ["advantages"], seed=seed + 100)
    batch.set_field("old_logprobs", group.compute_logprobs(batch)["logprobs"])
    return batch


def test_resume_reproduces_the_uninterrupted_next_step(ray_session, tiny_model_dir, tmp_path):
    config = trainer_config(num_workers=2, optim=OPTIM, num_mini_batches=2)
    group = TrainerGroup("actor", tiny_model_dir, config, AlgorithmConfig())
    try:
        first = group.update_policy(_policy_batch(group, seed=1))
        path = group.save_checkpoint(tmp_path, step=1)
        assert path.endswith("step_00000001") and checkpoint.latest_checkpoint(tmp_path).name == "step_00000001"
        second_batch = _policy_batch(group, seed=2)
        expected = group.update_policy(second_batch)
        expected_weights = weights(group)
        # Saving a step again writes a new revision; the path returned is the one `latest` names.
        again = tmp_path / "again"
        group.save_checkpoint(again, step=1)
        resaved = group.save_checkpoint(again, step=1)
        assert resaved == str(checkpoint.latest_checkpoint(again)) and not resaved.endswith("step_00000001")
    finally:
        group.shutdown()
    # A kill in the middle of writing the next checkpoint leaves a half-written temp directory.
    partial = checkpoint.prepare_temp_dir(tmp_path, 2)
    (partial / "__0_0.distcp").write_bytes(b"partial")

    resumed = TrainerGroup("actor", tiny_model_dir, config, AlgorithmConfig())
    try:
        assert resumed.load_checkpoint(tmp_path) == 1
        got = resumed.update_policy(second_batch)
        assert max_difference(weights(resumed), expected_weights) == 0.0
        # Mini-batches of 2 and 1 sequences: rank 1 runs an empty filler micro-batch in the second,
        # so both ranks still make the same collective calls.
        assert math.isfinite(resumed.sft_step(random_batch(3, seed=9))["actor/sft_loss"])
    finally:
        resumed.shutdown()
    assert got == expected  # loss, grad norm, lr (mid-warm-up schedule), step counters: all restored
    assert got["actor/lr"] != first["actor/lr"] and got["actor/num_optimizer_steps"] == 4


@pytest.fixture(scope="module")
def actor(ray_session, tiny_model_dir):
    # Warm-up makes the lr depend on the step count, so a wrongly advanced scheduler shows.
    config = trainer_config(optim=OptimConfig(lr=5e-3, warmup_steps=10), num_mini_batches=2)
    group = TrainerGroup("actor", tiny_model_dir, config, AlgorithmConfig())
    yield group
    group.shutdown()


def test_non_finite_step_is_skipped_and_leaves_state_untouched(actor, tmp_path):
    good = _policy_batch(actor, seed=3)
    bad = _policy_batch(actor, seed=3)
    for i in (0, 4):  # one sequence in each of the two mini-batches
        bad.token_fields["advantages"][i][0] = float("nan")
    actor.save_checkpoint(tmp_path, step=0)
    before = weights(actor)

    skipped = actor.update_policy(bad)
    assert math.isnan(skipped["actor/pg_loss"])
    assert max_difference(weights(actor), before) == 0.0
    stepped = actor.update_policy(good)
    after = weights(actor)
    assert max_difference(after, before) > 0

    # The same good update straight from the checkpoint: identical, so the skipped steps changed
    # neither the optimizer moments and step count nor the LR schedule.
    actor.load_checkpoint(tmp_path)
    again = actor.update_policy(good)
    assert max_difference(weights(actor), after) == 0.0
    assert again == {**stepped, "actor/num_skipped_steps": stepped["actor/num_skipped_steps"] - 2}
    assert skipped["actor/num_skipped_steps"] == again["actor/num_skipped_steps"] + 2
    assert skipped["actor/num_optimizer_steps"] == again["actor/num_optimizer_steps"] - 2


def test_sft_lowers_the_loss(actor):
    batch = random_batch(6, seed=5)
    losses = [actor.sft_step(batch)["actor/sft_loss"] for _ in range(8)]
    assert losses[-1] < 0.7 * losses[0]


def test_exported_weights_and_hf_folder_match_transformers(actor, tiny_model_dir, tmp_path):
    refs, total_bytes = actor.export_weights(bucket_bytes=1 << 16)
    buckets = ray.get(refs)
    exported = {name: tensor for bucket in buckets for name, tensor in bucket}
    assert sum(t.numel() * t.element_size() for t in exported.values()) == total_bytes
    # Buckets close as soon as they reach the size: every bucket but the last is over it, and
    # would not be without its last tensor.
    for bucket in buckets[:-1]:
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        assert sum(sizes) >= 1 << 16 > sum(sizes[:-1])
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert set(exported) == set(original.state_dict()) - {"lm_head.weight"}  # tied to the embedding

    actor.save_hf(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token_id == 1
    state = loaded.state_dict()
    assert max_difference({k: state[k] for k in exported}, exported) == 0.0
    assert torch.equal(state["lm_head.weight"], exported["model.embed_tokens.weight"])
    batch = random_batch(4, seed=6)
    trainer_logprobs = actor.compute_logprobs(batch)["logprobs"]
    prompt, response = batch.prompt_token_ids[0], batch.response_token_ids[0]
    with torch.no_grad():
        logits = loaded(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(trainer_logprobs[0], expected, rtol=1e-5, atol=1e-5)
