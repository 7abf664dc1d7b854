"""Trainer offload/onload (colocated time-sharing) on real Ray actors and gloo process groups.

On CPU device and host are one, so the moves are no-ops: a group that offloads between steps must
compute exactly (bit for bit) what a group that never offloads computes, while its calls, their
order, the bytes it reports and the guard against passes while offloaded are all checked."""

import subprocess
import sys

import pytest
import torch
from trainer_helpers import random_batch, random_fields, trainer_config, weights

from rlactors.config import AlgorithmConfig, OptimConfig
from rlactors.trainer.group import TrainerGroup

ALGORITHM = AlgorithmConfig(clip_ratio_high=0.28, entropy_coef=0.01)
TEMPERATURE = 0.7
FLOAT32_BYTES = 4


def phases(group: TrainerGroup, rank: int) -> list[str]:
    return [entry["phase"] for entry in group.phase_logs()[rank]]


def moved_bytes(results: list[dict]) -> int:
    """Bytes moved, summed over ranks: each rank reports the shards it holds."""
    return sum(result["moved_bytes"] for result in results)


def train(group: TrainerGroup, offload: bool) -> dict[str, list]:
    """Two PPO updates (logprobs, update, export), with the colocated schedule around each when
    `offload`; then the logprobs under the final weights. Returns everything computed."""
    batch = random_batch(10, seed=11)
    random_fields(batch, ["advantages"], seed=12)
    out = {"logprobs": [], "metrics": [], "weights": [], "moved_bytes": []}
    for _ in range(2):
        if offload:
            group.onload()
        logprobs = group.compute_logprobs(batch, TEMPERATURE)["logprobs"]
        batch.set_field("old_logprobs", logprobs)
        out["logprobs"].append(logprobs)
        out["metrics"].append(group.update_policy(batch, TEMPERATURE))
        out["weights"].append(weights(group))
        if offload:
            out["moved_bytes"].append(moved_bytes(group.offload()))
    if offload:
        group.onload()
    out["logprobs"].append(group.compute_logprobs(batch, TEMPERATURE)["logprobs"])
    return out


def same_tensors(a: dict | list, b: dict | list) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_offloaded_actor_trains_exactly_like_a_resident_one(ray_session, tiny_model_dir):
    # Two epochs over two mini-batches: the second step of each update reads Adam's moments, so an
    # optimizer state lost or reset by the offload would change the metrics and the weights.
    config = trainer_config(num_workers=2, num_mini_batches=2, num_epochs=2, optim=OptimConfig(lr=2e-3))
    resident = TrainerGroup("actor", tiny_model_dir, config, ALGORITHM)
    try:
        expected = train(resident, offload=False)
        assert phases(resident, 0) == ["compute_logprobs", "update_policy", "export_weights"] * 2 + ["compute_logprobs"]
    finally:
        resident.shutdown()

    group = TrainerGroup("actor", tiny_model_dir, config, ALGORITHM)
    try:
        num_parameters = group.info[0]["num_parameters"]
        first = group.offload()  # as the colocated run does before its engines start
        assert moved_bytes(first) == FLOAT32_BYTES * num_parameters  # parameters only: no optimizer state yet
        assert all(r["phase"] == "offload" and r["memory"]["host_rss_bytes"] > 0 for r in first)
        assert moved_bytes(group.offload()) == 0  # idempotent: nothing moves, nothing is logged
        with pytest.raises(Exception, match="offloaded to host memory; call onload"):
            group.compute_logprobs(random_batch(4, seed=1))
        result = train(group, offload=True)
        # After an update: the parameters and AdamW's exp_avg and exp_avg_sq of each.
        assert result["moved_bytes"] == [3 * FLOAT32_BYTES * num_parameters] * 2
        assert moved_bytes(group.onload()) == 0
        for rank in (0, 1):
            assert phases(group, rank) == ["offload"] + ["onload", "compute_logprobs", "update_policy",
                                                         "export_weights", "offload"] * 2 + ["onload", "compute_logprobs"]
        # An export while offloaded (as at a resume) holds the device for the call, then gives it back.
        group.offload()
        assert same_tensors(weights(group), result["weights"][-1])
        assert phases(group, 0)[-4:] == ["offload", "onload", "export_weights", "offload"]
        with pytest.raises(Exception, match="offloaded"):
            group.compute_logprobs(random_batch(4, seed=1))
    finally:
        group.shutdown()

    assert all(same_tensors(a, b) for a, b in zip(result["logprobs"], expected["logprobs"], strict=True))
    assert result["metrics"] == expected["metrics"]
    assert all(same_tensors(a, b) for a, b in zip(result["weights"], expected["weights"], strict=True))


def test_reference_and_critic_come_back_unchanged(ray_session, tiny_model_dir):
    batch = random_batch(8, seed=4)
    config = trainer_config(critic_optim=OptimConfig(lr=1e-2))
    reference = TrainerGroup("reference", tiny_model_dir, config)
    try:
        before = reference.compute_logprobs(batch)["logprobs"]
        # No optimizer: the parameters are all that moves.
        assert moved_bytes(reference.offload()) == FLOAT32_BYTES * reference.info[0]["num_parameters"]
        reference.onload()
        assert same_tensors(reference.compute_logprobs(batch)["logprobs"], before)
        assert phases(reference, 0) == ["compute_logprobs", "offload", "onload", "compute_logprobs"]
    finally:
        reference.shutdown()

    batch.set_field("returns", [torch.ones(n) for n in batch.response_lengths])
    runs = []
    for offload in (False, True):
        critic = TrainerGroup("critic", tiny_model_dir, config, AlgorithmConfig(value_clip=100.0))
        try:
            batch.set_field("values", critic.compute_values(batch))
            first = critic.update_critic(batch)
            if offload:
                num_parameters = critic.info[0]["num_parameters"]
                assert moved_bytes(critic.offload()) == 3 * FLOAT32_BYTES * num_parameters  # + AdamW moments
                critic.onload()
            runs.append((first, critic.update_critic(batch), critic.compute_values(batch)))
        finally:
            critic.shutdown()
    (first, second, values), (first_offloaded, second_offloaded, values_offloaded) = runs
    assert first_offloaded == first and second_offloaded == second
    assert same_tensors(values_offloaded, values)


# On a GPU `move_state` runs `model.to(device)`, which copies every shard; on CPU nothing is copied.
# A copying `_apply` on this torch shows what the GPU path relies on: FSDP2 keeps the parameter
# objects the optimizer holds (it swaps their contents), and training goes on exactly.
COPYING_APPLY = """
import sys, torch
from rlactors.trainer import fsdp
mesh = fsdp.init_distributed(0, 1, "127.0.0.1", fsdp.free_port())
ids = torch.randint(4, 250, (2, 12), generator=torch.Generator().manual_seed(0))
final = []
for copy in (False, True):
    model = fsdp.shard_model(fsdp.load_role_model(sys.argv[1], "actor", 0), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(input_ids=ids).logits.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            model(input_ids=ids)  # one rank: the gathered parameters stay registered after a forward
        if copy:
            held = optimizer.param_groups[0]["params"]
            pointers = [p.to_local().data_ptr() for p in held]
            model._apply(lambda t: t.clone())
            assert all(p is q for p, q in zip(model.parameters(), held, strict=True)), "parameters replaced"
            assert all(p.to_local().data_ptr() != x for p, x in zip(held, pointers)), "nothing was copied"
            for state in optimizer.state.values():
                for key, value in state.items():
                    state[key] = value.clone() if value.dim() else value
    final.append([p.full_tensor() for p in optimizer.param_groups[0]["params"]])
assert all(torch.equal(a, b) for a, b in zip(*final, strict=True)), "training diverged"
"""


def test_fsdp2_keeps_parameters_through_a_copying_move(tiny_model_dir):
    subprocess.run([sys.executable, "-c", COPYING_APPLY, str(tiny_model_dir)], check=True, timeout=300)
