"""Drivers that compose the actors into GRPO, DAPO and PPO (the algorithm is configuration:
`algorithm.advantage`, clip ranges, KL, dynamic sampling), in colocated or fully-async mode.
`warm` (a `rlactors.pipelines.warm.WarmActors`) keeps the rollout engines and trainer groups
started from one run to the next in the same process."""

from __future__ import annotations


def run_pipeline(config, model_path: str | None = None, warm=None) -> list[dict]:
    if config.pipeline.mode == "colocated":
        from rlactors.pipelines.colocated import run_colocated

        return run_colocated(config, model_path, warm)
    from rlactors.pipelines.fully_async import run_fully_async

    return run_fully_async(config, model_path, warm)
