"""Tiny model kit and the one loading path for every model folder.

`build_tiny_model(path, preset, seed)` writes a random-init Qwen2/Qwen3/Qwen3-MoE causal LM and a
character-level tokenizer (a real Hugging Face fast tokenizer: `tokenizer.json`, special tokens,
a chat template) into a local folder that transformers and vLLM both load. A real checkpoint
(e.g. a local Qwen3-8B folder) goes through the same `load_model` / `load_tokenizer`.

A run's model folder comes from `ensure_run_model`: a folder without a model is an error naming the
path, unless the user asked for a random-init one there (`model.build_if_missing`, or a path inside
the run's output dir), which is then built and announced on stdout.

Invariant: the same (preset, architecture, seed) gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlactors.config import ConfigError

PRESETS: dict[str, dict[str, int]] = {
    # ~0.3M parameters: fast enough for every unit test.
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256),
    # ~3M parameters: the CPU demo's model.
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=768),
    # ~110M parameters: the weight-sync benchmark's model (~450 MB in float32, ~225 MB in bfloat16).
    "medium": dict(hidden_size=1024, num_hidden_layers=10, num_attention_heads=16, num_key_value_heads=4,
                   intermediate_size=2816),
}

# A `qwen3_moe` model of a preset: every layer's MLP becomes 8 experts, 2 routed per token, each
# half the dense MLP's width (so ~ the dense model's active parameters, ~4x its expert parameters).
MOE_SIZES: dict[str, int | bool] = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
ARCHITECTURES = ("qwen2", "qwen3", "qwen3_moe")

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, IM_START, IM_END]
# Written last by `build_tiny_model`: what the folder was built with.
BUILD_STAMP = "rlactors_model.json"


def byte_level_alphabet() -> list[str]:
    """GPT-2/Qwen byte-to-unicode table: one printable symbol per byte value, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer():
    """A character-level tokenizer in Qwen's own format: a byte-level BPE with no merges.

    Every byte is one token, so each ASCII character is one token and any UTF-8 text round-trips
    (non-ASCII characters take several byte tokens). Using Qwen's tokenizer class and format means
    `AutoTokenizer` in transformers and vLLM rebuild exactly this tokenizer from the folder.
    """
    from transformers import Qwen2Tokenizer

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + byte_level_alphabet())}
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def tiny_model_config(preset: str, architecture: str, vocab_size: int, eos_token_id: int, pad_token_id: int):
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if preset not in PRESETS:
        raise ValueError(f"model preset {preset!r}: allowed values are {sorted(PRESETS)}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"model architecture {architecture!r}: allowed values are {list(ARCHITECTURES)}")
    config_class = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[architecture]
    sizes = dict(PRESETS[preset])
    if architecture == "qwen3_moe":
        sizes |= MOE_SIZES | {"moe_intermediate_size": sizes["intermediate_size"] // 2}
    return config_class(
        vocab_size=vocab_size,
        max_position_embeddings=1024,
        head_dim=sizes["hidden_size"] // sizes["num_attention_heads"],
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        rope_theta=10000.0,
        # Wider than the usual 0.02 so an untrained model's greedy output is not one repeated token.
        initializer_range=0.08,
        torch_dtype="float32",
        **sizes,
    )


def build_tiny_model(path: str | Path, preset: str = "tiny", seed: int = 0, architecture: str = "qwen2",
                     head: str = "causal_lm") -> Path:
    """Write a random-init model + tokenizer folder at `path` (overwriting model files). `head`:
    "causal_lm" (a policy), or "classifier" (a reward model: one logit per sequence)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    config = tiny_model_config(preset, architecture, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    if head == "classifier":
        config.num_labels = 1
    model_class = {"causal_lm": AutoModelForCausalLM, "classifier": AutoModelForSequenceClassification}[head]
    model = model_class.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / BUILD_STAMP).write_text(
        json.dumps({"preset": preset, "architecture": architecture, "seed": seed}
                   | ({"head": head} if head != "causal_lm" else {}), indent=2) + "\n"
    )
    return path


def is_model_folder(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin")))


def built_with(path: str | Path) -> dict | None:
    """(preset, architecture, seed) of a model `build_tiny_model` wrote at `path`, or None."""
    try:
        return json.loads((Path(path) / BUILD_STAMP).read_text())
    except (OSError, ValueError):
        return None


class ModelPathError(ConfigError, FileNotFoundError):
    """`model.path` holds no usable model and none may be built there; the message says what to do.
    A `ConfigError`, so the command line prints it without a traceback."""


HOW_TO_GET_A_MODEL = ("point model.path at a Hugging Face model folder (config.json + *.safetensors), or set "
                      "model.build_if_missing=true and model.preset=tiny|small to build a random-init model there")


def ensure_model(path: str | Path, preset: str | None, seed: int = 0, architecture: str = "qwen2",
                 build_if_missing: bool = False) -> Path:
    """`path` if it holds a model. Otherwise build a random-init `preset` model there, saying so on
    stdout, but only when `build_if_missing` and the folder is absent or empty: a mistyped path, or
    a real checkpoint still being copied, is an error naming the path, never a new random model.

    With `build_if_missing`, a folder this function built earlier must match (preset, architecture,
    seed): a changed preset rebuilds nothing silently, it is an error."""
    path = Path(path)
    stamp = built_with(path)
    wanted = {"preset": preset, "architecture": architecture, "seed": seed}
    if is_model_folder(path):
        if build_if_missing and preset is not None and stamp is not None and stamp != wanted:
            raise ModelPathError(
                f"model.path {str(path)!r} holds a random-init model built with {stamp}, not the configured "
                f"{wanted}: delete the folder to rebuild it, or point model.path elsewhere"
            )
        return path
    where = f"model.path {str(path)!r} ({path.absolute()})"
    if not build_if_missing:
        state = "does not exist" if not path.exists() else "holds no model (config.json + *.safetensors)"
        raise ModelPathError(f"{where} {state}: {HOW_TO_GET_A_MODEL}")
    if preset is None:
        raise ModelPathError(f"{where} holds no model and model.preset is null, so there is nothing to build: "
                             f"{HOW_TO_GET_A_MODEL}")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ModelPathError(f"{where} holds files but no model (config.json + *.safetensors): not building a "
                             "random-init model over them; empty the folder or point model.path elsewhere")
    print(f"building a random-init {preset!r} {architecture} model (seed {seed}) at {path.absolute()}", flush=True)
    return build_tiny_model(path, preset=preset, seed=seed, architecture=architecture)


def ensure_run_model(model, output_dir: str | Path) -> Path:
    """The model folder of a run's `model` config (a `rlactors.config.ModelConfig`). A missing one is
    built only where the user asked for it: `model.build_if_missing`, or a `model.path` inside the
    run's own `output_dir` (a folder only this run writes)."""
    inside_output = Path(model.path).absolute().resolve().is_relative_to(Path(output_dir).absolute().resolve())
    return ensure_model(model.path, model.preset, model.seed, model.architecture,
                        build_if_missing=model.build_if_missing or inside_output)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def padding_token_id(tokenizer) -> int | None:
    """The id a padded batch fills with: the tokenizer's pad token, else its end-of-sequence token.
    A sequence classifier reads each row's score at its last token that is not this one."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def load_model(path: str | Path, dtype=None, device: str | None = None):
    """Load a causal LM from a local folder (no hub access)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32, local_files_only=True)
    return model.to(device) if device else model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
