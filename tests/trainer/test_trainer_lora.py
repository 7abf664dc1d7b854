"""A LoRA actor on real Ray actors and a 2-rank gloo group: only the adapters train and reach the
optimizer and the checkpoint, its base is the reference policy, and resume is exact."""

import math

import pytest
import ray
import torch
from trainer_helpers import random_batch, random_fields, trainer_config, weights

from rlactors.config import AlgorithmConfig, LoraConfig, OptimConfig
from rlactors.models import load_model
from rlactors.trainer.group import TrainerGroup

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])
CONFIG = trainer_config(num_workers=2, optim=OptimConfig(lr=1e-2, warmup_steps=4), num_mini_batches=2)


def policy_batch(group, seed: int):
    batch = random_batch(8, seed=seed)
    random_fields(batch, ["advantages"], seed=seed + 100)
    batch.set_field("old_logprobs", group.compute_logprobs(batch)["logprobs"])
    return batch


def optimized_names(group) -> list[str]:
    """The names of the parameters rank 0's optimizer holds."""
    def names(worker):
        ids = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
        return [name for name, p in worker.model.named_parameters() if id(p) in ids]

    return ray.get(group.workers[0].__ray_call__.remote(names))


@pytest.fixture(scope="module")
def lora_actor(ray_session, tiny_model_dir):
    group = TrainerGroup("actor", tiny_model_dir, CONFIG, AlgorithmConfig(), lora=LORA)
    yield group
    group.shutdown()


def test_only_the_adapters_reach_the_optimizer_and_change(lora_actor, tiny_model_dir):
    names = optimized_names(lora_actor)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    info = lora_actor.info[0]
    num_adapter_parameters = ray.get(lora_actor.workers[0].__ray_call__.remote(
        lambda worker: sum(p.numel() for n, p in worker.model.named_parameters() if ".lora_" in n)))
    assert info["num_trainable_parameters"] == num_adapter_parameters < info["num_parameters"] / 4
    before = weights(lora_actor)
    base = load_model(tiny_model_dir).state_dict()
    assert before.keys() == base.keys() - {"lm_head.weight"}  # merged, in the base's names (tied head once)
    metrics = lora_actor.update_policy(policy_batch(lora_actor, seed=1))
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/num_optimizer_steps"] == 2
    after = weights(lora_actor)
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    assert changed and {name.split(".")[-2] for name in changed} <= {"q_proj", "v_proj", "up_proj"}


def test_the_base_with_adapters_off_is_a_separate_reference_model(lora_actor, ray_session, tiny_model_dir):
    batch = random_batch(8, seed=3)
    lora_actor.update_policy(policy_batch(lora_actor, seed=2))  # the adapters move away from the base
    reference = TrainerGroup("reference", tiny_model_dir, trainer_config(), AlgorithmConfig())
    try:
        expected = torch.cat(reference.compute_logprobs(batch, 0.7)["logprobs"])
    finally:
        reference.shutdown()
    base = torch.cat(lora_actor.compute_logprobs(batch, 0.7, base=True)["logprobs"])
    torch.testing.assert_close(base, expected, rtol=0, atol=1e-5)
    adapted = torch.cat(lora_actor.compute_logprobs(batch, 0.7)["logprobs"])
    assert (adapted - expected).abs().max() > 1e-3


def test_a_checkpoint_holds_the_adapters_and_resume_is_exact(lora_actor, ray_session, tiny_model_dir, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    lora_actor.update_policy(policy_batch(lora_actor, seed=4))
    path = lora_actor.save_checkpoint(tmp_path, step=1)
    saved = [key for key in FileSystemReader(path).read_metadata().state_dict_metadata if key.startswith("model.")]
    assert saved and [key for key in saved if ".lora_" not in key] == []  # the frozen base is the model folder's
    batch = policy_batch(lora_actor, seed=5)
    expected = lora_actor.update_policy(batch)
    expected_weights = weights(lora_actor)
    resumed = TrainerGroup("actor", tiny_model_dir, CONFIG, AlgorithmConfig(), lora=LORA)
    try:
        assert resumed.load_checkpoint(tmp_path) == 1
        assert resumed.update_policy(batch) == expected
        assert all(torch.equal(tensor, expected_weights[name]) for name, tensor in weights(resumed).items())
    finally:
        resumed.shutdown()
