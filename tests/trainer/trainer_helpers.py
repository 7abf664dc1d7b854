"""Helpers of the trainer tests: seeded random batches, weight snapshots, small configs."""

from __future__ import annotations

import ray
import torch

from rlactors.config import TrainerConfig
from rlactors.trainer.batch import TrainBatch


def random_batch(num_sequences: int, seed: int, group_size: int = 4) -> TrainBatch:
    """Prompts of 2-7 and responses of 0-11 random token ids (an empty response included)."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(low, high):
        length = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(4, 250, (length,), generator=generator).tolist()

    responses = [tokens(1, 12) for _ in range(num_sequences)]
    responses[1] = []  # a sequence with no response token contributes nothing, and must not break anything
    return TrainBatch([tokens(2, 8) for _ in range(num_sequences)], responses,
                      [i // group_size for i in range(num_sequences)])


def random_fields(batch: TrainBatch, names: list[str], seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        batch.set_field(name, [torch.randn(len(r), generator=generator) * scale for r in batch.response_token_ids])


def trainer_config(**overrides) -> TrainerConfig:
    settings = dict(num_workers=1, num_cpus_per_worker=1.0, max_tokens_per_micro_batch=4096)
    return TrainerConfig(**{**settings, **overrides})


def weights(group) -> dict[str, torch.Tensor]:
    """The group's full weights by Hugging Face name, through `export_weights`."""
    refs, _ = group.export_weights(bucket_bytes=1 << 16)
    return {name: tensor for bucket in ray.get(refs) for name, tensor in bucket}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)



def assert_ranks_gone(workers: list, timeout_s: float = 60.0) -> None:
    """Within `timeout_s` (ray.kill is asynchronous), every one of these rank actors is dead: a
    call on it fails with RayActorError (the ranks never restart)."""
    import time

    deadline = time.monotonic() + timeout_s
    alive = list(workers)
    while alive:
        for worker in list(alive):
            try:
                ray.get(worker.__ray_ready__.remote(), timeout=5)
            except ray.exceptions.RayActorError:
                alive.remove(worker)
            except ray.exceptions.GetTimeoutError:
                pass  # busy, so alive
        assert not alive or time.monotonic() < deadline, f"{len(alive)} trainer ranks still alive after {timeout_s:g} s"
        time.sleep(0.5 if alive else 0)


class KeptGroup:
    """The last trainer group a test module asked for, handed to the next test that asks for the
    same role and process settings anew through `TrainerGroup.start_run` (the path a run on kept
    trainers takes, `rlactors.pipelines.warm.trainer_key`): a test gets a group that is exactly a
    new one. One group at a time, as the warm actors keep one set: kept groups hold their CPUs,
    and a group that cannot get its own waits for them."""

    def __init__(self, model_dir):
        self.model_dir, self.key, self.group = model_dir, None, None

    def get(self, role: str, config, algorithm=None, norm_tokens: int | None = None):
        from rlactors.pipelines.warm import trainer_key
        from rlactors.trainer.group import TrainerGroup

        key = trainer_key(role, config)
        if self.group is not None and self.key == key and self.group.stopped is None:
            self.group.start_run(self.model_dir, config, algorithm, norm_tokens=norm_tokens)
            return self.group
        self.shutdown()
        self.key, self.group = key, TrainerGroup(role, self.model_dir, config, algorithm, norm_tokens=norm_tokens)
        return self.group

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        self.key = self.group = None
