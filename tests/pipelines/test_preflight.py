"""An impossible run is refused by `build_run` before Ray or any actor starts, naming its cause.

Each test runs the real `build_run` on the tiny model with `init_ray` replaced by a tripwire:
reaching it means every check passed (and, before these checks existed, what the test feeds
went on to start Ray and the actors)."""

import json

import pytest

import rlactors.pipelines.build as build
from rlactors.config import ConfigError, load_config
from rlactors.data import DataError, write_rows
from rlactors.pipelines.build import build_run
from rlactors.pipelines.preflight import check_model, model_context_tokens


class RayStarted(Exception):
    """build_run got past every check to `init_ray()`."""


@pytest.fixture(autouse=True)
def tripwire(monkeypatch):
    def refuse_to_start(*args, **kwargs):
        raise RayStarted("build_run reached init_ray(): nothing refused the run")

    monkeypatch.setattr(build, "init_ray", refuse_to_start)
    monkeypatch.setattr(build.logs, "set_up_driver", lambda *args: {})  # no logging set-up left in this process


def config_for(tmp_path, model_dir, *overrides):
    return load_config(None, [
        f"model.path={model_dir}", "data.num_train_rows=16", "data.num_val_rows=4", "rollout.max_model_len=64",
        "rollout.sampling.num_samples_per_prompt=2", "rollout.sampling.max_response_tokens=4",
        "rollout.validation_sampling.max_response_tokens=4", "pipeline.batch_size_prompts=2",
        f"pipeline.output_dir={tmp_path / 'run'}", "pipeline.resume=never", *overrides,
    ])


def refusal(config) -> str:
    with pytest.raises(ConfigError) as error:
        build_run(config)
    return str(error.value)


def prompt_file(path, contents: list[str], split: str = "train"):
    """A veRL-schema file whose row i has the prompt contents[i] (one token per character)."""
    return write_rows([{"data_source": "synthetic/arithmetic", "prompt": [{"role": "user", "content": text}],
                        "ability": "math", "reward_model": {"style": "rule", "ground_truth": "3"},
                        "extra_info": {"split": split, "index": index}} for index, text in enumerate(contents)], path)


def test_a_possible_run_passes_every_check(tmp_path, tiny_model_dir):
    # Greedy validation (the default) is fine; only training sampling needs a temperature.
    with pytest.raises(RayStarted):
        build_run(config_for(tmp_path, tiny_model_dir, "rollout.validation_sampling.temperature=0"))


def test_training_temperature_zero_is_refused(tmp_path, tiny_model_dir):
    message = refusal(config_for(tmp_path, tiny_model_dir, "rollout.sampling.temperature=0"))
    assert "rollout.sampling.temperature=0.0" in message and "validation_sampling" in message


def test_a_training_prompt_longer_than_the_context_allows_is_refused_naming_it(tmp_path, tiny_model_dir):
    # 61 tokens: within the engine's own limit (< max_model_len=64), but 61 + 4 response tokens do not fit.
    train = prompt_file(tmp_path / "train.parquet", ["1+2=", "x" * 61, "y" * 62, "3+4="])
    message = refusal(config_for(tmp_path, tiny_model_dir, f"data.train_files=[{train}]"))
    assert "'synthetic/arithmetic/train/1'" in message and str(train) in message
    assert "61 prompt tokens + rollout.sampling.max_response_tokens=4 = 65 > rollout.max_model_len=64" in message
    assert "1 more training prompts" in message and "the longest 62" in message


def test_a_validation_prompt_is_checked_against_the_validation_response_budget(tmp_path, tiny_model_dir):
    train = prompt_file(tmp_path / "train.parquet", ["1+2="])
    val = prompt_file(tmp_path / "test.parquet", ["1+2=", "z" * 58], split="test")
    config = config_for(tmp_path, tiny_model_dir, f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                        "rollout.validation_sampling.max_response_tokens=8")
    message = refusal(config)
    assert "validation prompt_id 'synthetic/arithmetic/test/1'" in message and str(val) in message
    assert "rollout.validation_sampling.max_response_tokens=8 = 66 > rollout.max_model_len=64" in message
    # The refusal is also a data error: the cause is a row of a file.
    with pytest.raises(DataError):
        build_run(config)


def test_a_prompt_token_limit_that_cannot_fit_the_context_is_refused(tmp_path, tiny_model_dir):
    message = refusal(config_for(tmp_path, tiny_model_dir, "data.max_prompt_tokens=62"))
    assert "data.max_prompt_tokens=62 + rollout.sampling.max_response_tokens=4 = 66 > rollout.max_model_len=64" in message
    with pytest.raises(RayStarted):  # one that fits is the prompt limit again
        build_run(config_for(tmp_path, tiny_model_dir, "data.max_prompt_tokens=60"))
    train = prompt_file(tmp_path / "train.parquet", ["1+2=", "x" * 61])
    message = refusal(config_for(tmp_path, tiny_model_dir, "data.max_prompt_tokens=60", f"data.train_files=[{train}]"))
    assert "'synthetic/arithmetic/train/1'" in message and "61 tokens > data.max_prompt_tokens=60" in message


def test_a_response_budget_that_fills_the_context_is_refused(tmp_path, tiny_model_dir):
    message = refusal(config_for(tmp_path, tiny_model_dir, "rollout.validation_sampling.max_response_tokens=64"))
    assert "rollout.validation_sampling.max_response_tokens=64 leaves no room for a prompt" in message


def test_a_context_longer_than_the_model_knows_is_refused(tmp_path, tiny_model_dir):
    message = refusal(config_for(tmp_path, tiny_model_dir, "rollout.max_model_len=2048"))
    assert "rollout.max_model_len=2048 > max_position_embeddings=1024" in message and "config.json" in message


def test_routing_replay_on_a_dense_model_is_refused_naming_the_field(tmp_path, tiny_model_dir, tiny_moe_model_dir):
    message = refusal(config_for(tmp_path, tiny_model_dir, "trainer.routing_replay=rollout"))
    assert "trainer.routing_replay=rollout" in message and "(qwen2) has no experts" in message
    check_model(config_for(tmp_path, tiny_moe_model_dir, "trainer.routing_replay=rollout"), tiny_moe_model_dir)


def test_routing_replay_through_a_router_without_a_known_rule_is_refused_naming_its_class(tmp_path, tiny_model_dir):
    """A GraniteMoE router weighs (and returns) its experts its own way: replaying through it would
    fail at the first forward pass after the whole start-up, so the run stops before Ray."""
    import shutil

    from transformers import GraniteMoeConfig

    model_dir = tmp_path / "granitemoe"
    shutil.copytree(tiny_model_dir, model_dir, ignore=shutil.ignore_patterns("config.json", "*.safetensors"))
    GraniteMoeConfig(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                     max_position_embeddings=1024).save_pretrained(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"")  # never read: the model is built on the meta device
    message = refusal(config_for(tmp_path, model_dir, "trainer.routing_replay=rollout"))
    assert message.startswith(f"trainer.routing_replay=rollout: the model in {model_dir / 'config.json'}: ")
    assert "router class GraniteMoeTopKRouter" in message and "Qwen3MoeTopKRouter" in message
    assert "\n" not in message


def test_model_context_is_not_judged_when_rope_scaling_extends_it(tmp_path, tiny_model_dir):
    assert model_context_tokens(tiny_model_dir) == 1024
    scaled = json.loads((tiny_model_dir / "config.json").read_text())
    scaled["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(scaled))
    assert model_context_tokens(tmp_path) is None
    check_model(config_for(tmp_path, tiny_model_dir, "rollout.max_model_len=2048"), tmp_path)  # no error


def test_lora_targets_that_match_no_layer_are_refused_in_one_line_naming_the_field(tmp_path, tiny_model_dir):
    message = refusal(config_for(tmp_path, tiny_model_dir, "model.lora.rank=4", "model.lora.target_modules=[qproj]"))
    assert message.startswith("model.lora.target_modules=['qproj']") and "qproj" in message and "\n" not in message
    with pytest.raises(RayStarted):
        build_run(config_for(tmp_path, tiny_model_dir, "model.lora.rank=4", "model.lora.target_modules=[q_proj]"))


@pytest.mark.parametrize("spec,expected", [
    ("{dir}/missing.py:compute_score", "no file"),
    ("{dir}/rewards.py:compute_scores", "has no callable 'compute_scores'"),
    ("{dir}/rewards.py:two_arguments", "cannot be called as compute_score(data_source, solution_str"),
    ("{dir}/broken.py:compute_score", "ZeroDivisionError"),
    ("no_such_module_anywhere:compute_score", "ModuleNotFoundError"),
])
def test_a_custom_reward_function_that_does_not_load_is_refused(tmp_path, tiny_model_dir, spec, expected):
    (tmp_path / "rewards.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n\n"
        "def two_arguments(solution_str, ground_truth):\n    return 0.0\n")
    (tmp_path / "broken.py").write_text("1 / 0\n")
    spec = spec.format(dir=tmp_path)
    message = refusal(config_for(tmp_path, tiny_model_dir, f"reward.custom_function={spec}"))
    assert f"reward.custom_function={spec!r}" in message and expected in message
    with pytest.raises(RayStarted):
        build_run(config_for(tmp_path, tiny_model_dir, f"reward.custom_function={tmp_path}/rewards.py:compute_score"))


def test_a_resume_path_that_is_no_checkpoint_is_refused(tmp_path, tiny_model_dir):
    missing = tmp_path / "checkpoints" / "step_00000007"
    message = refusal(config_for(tmp_path, tiny_model_dir, f"pipeline.resume={missing}"))
    assert f"pipeline.resume='{missing}'" in message and "no checkpoint" in message
    (tmp_path / "not_a_checkpoint").mkdir()
    message = refusal(config_for(tmp_path, tiny_model_dir, f"pipeline.resume={tmp_path / 'not_a_checkpoint'}"))
    assert "is not a run checkpoint (no driver.json)" in message


def test_dynamic_sampling_over_groups_of_one_is_refused(tmp_path, tiny_model_dir):
    message = refusal(config_for(tmp_path, tiny_model_dir, "buffer.dynamic_sampling=true",
                                 "rollout.sampling.num_samples_per_prompt=1"))
    assert "buffer.dynamic_sampling" in message and "num_samples_per_prompt=1" in message


def test_more_mini_batches_than_sequences_is_refused(tmp_path, tiny_model_dir):
    message = refusal(config_for(tmp_path, tiny_model_dir, "trainer.num_mini_batches=5"))
    assert "= 4 sequences per batch cannot make trainer.num_mini_batches=5 mini-batches" in message


def test_a_mistyped_model_path_is_refused_instead_of_building_a_model(tmp_path, tiny_model_dir):
    typo = tmp_path / "models" / "Qwen3-8b"
    message = refusal(config_for(tmp_path, typo, "model.preset=tiny"))
    assert str(typo) in message and "does not exist" in message and "model.build_if_missing=true" in message
    assert not typo.exists()


def test_an_environment_that_does_not_load_is_refused_naming_where_it_was_named(tmp_path, tiny_model_dir):
    (tmp_path / "broken_env.py").write_text("1 / 0\n")
    message = refusal(config_for(tmp_path, tiny_model_dir, f"rollout.environment.name={tmp_path}/broken_env.py:Env"))
    assert "rollout.environment.name" in message and "broken_env.py" in message and "ZeroDivisionError" in message
    message = refusal(config_for(tmp_path, tiny_model_dir, "rollout.environment.name=no_such_environment"))
    assert "'no_such_environment'" in message
    # The tools task's rows name the built-ins, which load: preflight passes on to start Ray.
    with pytest.raises(RayStarted):
        build_run(config_for(tmp_path, tiny_model_dir, "data.task=tools"))


def committed_checkpoint(root, step: int):
    from rlactors.trainer import checkpoint

    temp = checkpoint.prepare_temp_dir(root, step)
    (temp / "actor").mkdir()
    (temp / "actor" / "__0_0.distcp").write_bytes(b"shard" * 100)
    (temp / "driver.json").write_text(json.dumps({"step": step}))
    return checkpoint.commit(root, step)


def test_a_damaged_checkpoint_stops_the_resume_before_ray_naming_the_file_and_the_intact_one(tmp_path, tiny_model_dir,
                                                                                             capsys):
    root = tmp_path / "run" / "checkpoints"
    intact, damaged = committed_checkpoint(root, 2), committed_checkpoint(root, 4)
    (damaged / "actor" / "__0_0.distcp").write_bytes(b"shard" * 10)  # truncated, as by a full disk or a bad copy
    message = refusal(config_for(tmp_path, tiny_model_dir, "pipeline.resume=auto"))
    assert message == (f"checkpoint {damaged} is damaged: actor/__0_0.distcp is 50 bytes, its manifest says 500; the "
                       f"newest intact checkpoint before it is {intact}: resume from it with pipeline.resume={intact} "
                       "(or pipeline.on_damaged_checkpoint=previous)")
    # Asked for, the run resumes from the intact one: every check passes and it goes on to start Ray.
    with pytest.raises(RayStarted):
        build_run(config_for(tmp_path, tiny_model_dir, "pipeline.resume=auto", "pipeline.on_damaged_checkpoint=previous"))
    assert f"resuming from {intact}, the newest intact one before it" in capsys.readouterr().out


def test_a_run_warns_when_its_first_checkpoint_will_not_fit(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from rlactors.pipelines import checkpointing, preflight

    config = config_for(tmp_path, tiny_model_dir, "pipeline.checkpoint_every_steps=5")
    needed = preflight.warn_if_checkpoints_will_not_fit(config, tiny_model_dir, tmp_path / "run")
    assert needed > 3 * 1e5 and "warning" not in capsys.readouterr().out  # 3x a ~0.3M-parameter float32 model
    monkeypatch.setattr(preflight, "free_bytes", lambda path: needed // 2)
    with pytest.raises(RayStarted):  # a warning, not a refusal: space may be freed before step 5
        build_run(config)
    assert f"a checkpoint of this run takes {needed / (1 << 20):.0f} MiB" in capsys.readouterr().out
    assert checkpointing.free_bytes(tmp_path / "run" / "not yet made") > 0  # measured on the folder that exists
