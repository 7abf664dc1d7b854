"""FSDP2 trainer actors: a `TrainerGroup` of `TrainerWorker` ranks and the `TrainBatch` they train on.

Import `rlactors.trainer.group` / `rlactors.trainer.worker` for the actors (they import Ray and
torch.distributed); this package module stays light.
"""
