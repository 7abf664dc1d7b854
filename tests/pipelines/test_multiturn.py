"""Multi-turn episodes through the whole stack: the `tools` task mixes the three built-in
environments (calculator, python, guess_number; each row names its own), 2 steps each of colocated
and fully-async GRPO on the tiny model."""

import pytest

from rlactors.config import load_config
from rlactors.pipelines import run_pipeline

pytestmark = pytest.mark.vllm


def tools_config(tmp_path, tiny_model_dir, *overrides):
    return load_config(None, [
        f"model.path={tiny_model_dir}", "model.preset=tiny", "data.task=tools", "data.num_train_rows=48",
        "data.num_val_rows=6", "rollout.max_model_len=96", "rollout.sampling.num_samples_per_prompt=4",
        "rollout.sampling.max_response_tokens=30", "rollout.sampling.seed=1",
        "rollout.validation_sampling.max_response_tokens=30", "rollout.environment.max_turns=3",
        "rollout.environment.max_turn_tokens=8", "pipeline.num_steps=2", "pipeline.batch_size_prompts=6",
        "pipeline.val_every_steps=2", f"pipeline.output_dir={tmp_path / 'run'}", "pipeline.resume=never",
        *overrides,
    ])


# Async in the slow tier (episodes across weight syncs, the producer thread); colocated in make
# test-extended. In make test: episodes on the engine, turns, masks, versions and an episode across a
# weight sync (tests/rollout/test_episode.py), the environments (tests/environments).
@pytest.mark.parametrize("mode", [pytest.param("colocated", marks=pytest.mark.extended),
                                  pytest.param("async", marks=pytest.mark.slow)])
def test_two_steps_with_every_builtin_environment(ray_session, tmp_path, tiny_model_dir, mode):
    history = run_pipeline(tools_config(tmp_path, tiny_model_dir, f"pipeline.mode={mode}"))
    assert [h["step"] for h in history] == [0, 1, 2]
    for step in history[1:]:
        # Every episode ran turns against its environment: observation tokens between model turns.
        assert step["episode/num_turns_mean"] > 1
        assert step["response/observation_tokens_mean"] > 0
        assert step["response/model_tokens_mean"] + step["response/observation_tokens_mean"] == pytest.approx(
            step["response_length/mean"])
        assert step["reward/num_score_errors"] == 0  # no environment failed, every episode scored
    for source in ("calculator", "python", "guess_number"):
        assert f"val/synthetic/{source}/acc" in history[-1], source
