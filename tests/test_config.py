import pytest

from rlactors.config import Config, ConfigError, build_config, describe_fields, dump_config, load_config


def test_defaults_validate_and_every_field_is_described():
    config = Config()
    assert config.pipeline.mode == "colocated"
    missing = [path for path, description in describe_fields() if not description.strip()]
    assert missing == []


def test_dotted_overrides_reach_nested_fields():
    config = load_config(None, ["trainer.optim.lr=2e-5", 'rollout.sampling.stop=["\\n", "."]', "buffer.max_staleness=2"])
    assert config.trainer.optim.lr == pytest.approx(2e-5)
    assert config.rollout.sampling.stop == ["\n", "."]
    assert config.buffer.max_staleness == 2


def test_unknown_key_names_dotted_path_and_allowed_keys():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["trainer.optim.learning_rate=1e-3"])
    message = str(error.value)
    assert "trainer.optim.learning_rate" in message and "unknown key" in message
    assert "lr" in message and "warmup_steps" in message


def test_bad_choice_names_path_and_allowed_values():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["algorithm.loss_agg_mode=mean"])
    message = str(error.value)
    assert "algorithm.loss_agg_mode" in message
    assert "'token-mean'" in message and "'seq-mean-token-sum-norm'" in message


def test_bad_number_names_path():
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.top_p"):
        load_config(None, ["rollout.sampling.top_p=1.5"])
    with pytest.raises(ConfigError, match=r"pipeline\.num_steps"):
        build_config({"pipeline": {"num_steps": "many"}})


def test_override_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match="pipeline.mode"):
        load_config(None, ["pipeline.mode.x=1"])
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(None, ["pipeline.mode"])


def test_yaml_round_trip(tmp_path):
    config = load_config(None, ["trainer.optim.lr=3e-4", "pipeline.mode=async", "reward.custom_function=m:f"])
    path = tmp_path / "config.yaml"
    dump_config(config, path)
    assert load_config(path) == config
    assert load_config(path, ["pipeline.num_steps=7"]).pipeline.num_steps == 7


def test_yaml_file_errors_name_the_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  sampling:\n    temprature: 0.5\n")
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.temprature: unknown key"):
        load_config(path)
    path.write_text("- not a mapping\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


def test_setting_one_validation_field_keeps_validation_greedy():
    config = load_config(None, ["rollout.validation_sampling.max_response_tokens=4"])
    validation = config.rollout.validation_sampling
    assert (validation.max_response_tokens, validation.temperature, validation.num_samples_per_prompt) == (4, 0.0, 1)
    assert config.rollout.sampling.temperature == 1.0 and config.rollout.sampling.num_samples_per_prompt == 8
    assert load_config(None, ["rollout.validation_sampling.temperature=0.6"]).rollout.validation_sampling.temperature == 0.6


def test_building_a_model_needs_a_preset():
    with pytest.raises(ConfigError, match=r"model.*build_if_missing needs model\.preset"):
        load_config(None, ["model.build_if_missing=true"])
    config = load_config(None, ["model.build_if_missing=true", "model.preset=tiny"])
    assert (config.model.build_if_missing, config.model.preset) == (True, "tiny")
    assert Config().model.build_if_missing is False and Config().model.preset is None  # nothing is built unasked


def test_loggers_default_keep_jsonl_and_refuse_unknown_names():
    assert load_config(None).pipeline.loggers == ["jsonl", "tensorboard"]
    assert load_config(None, ["pipeline.loggers=[jsonl, wandb, mlflow]"]).pipeline.loggers == ["jsonl", "wandb", "mlflow"]
    with pytest.raises(ConfigError) as error:
        load_config(None, ["pipeline.loggers=[jsonl, neptune]"])
    message = str(error.value)
    assert "pipeline.loggers" in message and "'neptune'" in message and "'wandb'" in message and "'mlflow'" in message
    with pytest.raises(ConfigError, match=r"pipeline\.loggers: .*must include 'jsonl'"):
        load_config(None, ["pipeline.loggers=[wandb]"])


def test_remax_turns_the_greedy_baseline_on_and_nothing_else_may():
    assert load_config(None, ["algorithm.advantage=remax"]).rollout.sampling.greedy_baseline is True
    assert load_config(None, []).rollout.sampling.greedy_baseline is False
    with pytest.raises(ConfigError, match="greedy_baseline is ReMax's baseline.*not grpo"):
        load_config(None, ["rollout.sampling.greedy_baseline=true"])


def test_tis_cap_names_its_replacement_and_a_dumped_null_still_loads():
    with pytest.raises(ConfigError, match="importance_level=token and rollout_correction.importance_threshold=2.0"):
        load_config(None, ["algorithm.tis_cap=2.0"])
    assert load_config(None, ["algorithm.tis_cap=null"]).algorithm.rollout_correction.importance_level is None


def test_rollout_correction_settings_are_checked_where_they_are_set():
    with pytest.raises(ConfigError, match="bypass_mode computes its own loss.*got gspo"):
        load_config(None, ["algorithm.rollout_correction.bypass_mode=true", "algorithm.policy_loss=gspo"])
    with pytest.raises(ConfigError, match="set both or neither"):
        load_config(None, ["algorithm.rollout_correction.rejection=token_k1"])
    with pytest.raises(ConfigError, match="must not exceed importance_threshold"):
        load_config(None, ["algorithm.rollout_correction.importance_threshold_lower=3.0"])
    with pytest.raises(ConfigError, match="algorithm.policy_loss"):
        load_config(None, ["algorithm.policy_loss=ppo2"])
    with pytest.raises(ConfigError, match=r"algorithm.rollout_correction: .*unknown rejection options \['token_k9'\]"):
        load_config(None, ["algorithm.rollout_correction.rejection=token_k9",
                           "algorithm.rollout_correction.rejection_threshold=2.0"])
