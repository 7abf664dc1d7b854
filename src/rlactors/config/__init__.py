"""Configuration: one pydantic model per component, loaded from YAML with dotted overrides.

    config = load_config("examples/quickstart_cpu.yaml", ["trainer.optim.lr=2e-5"])
    dump_config(config, "run/config.yaml")

    section.py     `Section`, the base of every model (unknown keys are errors), and `ConfigError`
    sections.py    the sections of a run (model, data, rollout, reward, buffer, trainer, pipeline)
                   and `Config`, their root
    algorithm.py   the algorithm's section: advantage estimator, policy loss, KL, rollout correction
    lora.py        the actor's LoRA adapters (`model.lora`)
    reward_model.py  a reward model among the scorers (`reward.models`)
    reward_training.py  a reward model's training job on preference pairs (`rlactors train-reward-model`)
    loading.py     YAML and overrides onto `Config`; a bad key or value names its dotted path
"""

from rlactors.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from rlactors.config.loading import (
    build_config,
    config_to_dict,
    describe_fields,
    dump_config,
    load_config,
    parse_override,
)
from rlactors.config.lora import LoraConfig
from rlactors.config.reward_model import RewardModelConfig
from rlactors.config.reward_training import RewardTrainingConfig
from rlactors.config.section import ConfigError, Section
from rlactors.config.sections import (
    DEFAULT_LOGGERS,
    BufferConfig,
    Config,
    DataConfig,
    EnvironmentConfig,
    ModelConfig,
    OptimConfig,
    OverlongConfig,
    PipelineConfig,
    RewardConfig,
    RolloutConfig,
    SamplingConfig,
    TrainerConfig,
    ValidationSamplingConfig,
)

__all__ = [
    "DEFAULT_LOGGERS", "AlgorithmConfig", "BufferConfig", "Config", "ConfigError", "DataConfig", "EnvironmentConfig",
    "LoraConfig", "ModelConfig", "OptimConfig", "OverlongConfig", "PipelineConfig", "RewardConfig", "RewardModelConfig", "RewardTrainingConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig", "SamplingConfig", "Section", "TrainerConfig", "ValidationSamplingConfig", "build_config",
    "config_to_dict", "describe_fields", "dump_config", "load_config", "parse_override",
]
