"""Model folders: `folders` builds the tiny random-init models and their character-level tokenizer,
and is the one loading path for every model folder, tiny or real (everything it exports is here).
Mixture-of-experts models: `moe` maps the trainer's fused experts to the checkpoint's one tensor per
expert (every weight leaving the trainer goes through it) and counts active parameters; `routes`
is the routing a sample carries from the rollout engine to the trainer (routing replay). LoRA:
`lora` puts peft adapters on a model, switches them off for the reference policy, merges them into
the weights the engines get, and writes the adapter in peft's format."""

from rlactors.models.folders import (
    ARCHITECTURES,
    BUILD_STAMP,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    HOW_TO_GET_A_MODEL,
    IM_END,
    IM_START,
    MOE_SIZES,
    PAD_TOKEN,
    PRESETS,
    SPECIAL_TOKENS,
    ModelPathError,
    build_char_tokenizer,
    build_tiny_model,
    built_with,
    byte_level_alphabet,
    count_parameters,
    ensure_model,
    ensure_run_model,
    is_model_folder,
    load_model,
    load_tokenizer,
    padding_token_id,
    tiny_model_config,
)

__all__ = [
    "ARCHITECTURES",
    "BUILD_STAMP",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "HOW_TO_GET_A_MODEL",
    "IM_END",
    "IM_START",
    "MOE_SIZES",
    "ModelPathError",
    "PAD_TOKEN",
    "PRESETS",
    "SPECIAL_TOKENS",
    "build_char_tokenizer",
    "build_tiny_model",
    "built_with",
    "byte_level_alphabet",
    "count_parameters",
    "ensure_model",
    "ensure_run_model",
    "is_model_folder",
    "load_model",
    "load_tokenizer",
    "padding_token_id",
    "tiny_model_config",
]
