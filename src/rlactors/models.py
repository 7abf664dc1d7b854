"""Tiny model kit and the one loading path for every model folder.

`build_tiny_model(path, preset, seed)` writes a random-init Qwen2/Qwen3 causal LM and a
character-level tokenizer (a real Hugging Face fast tokenizer: `tokenizer.json`, special tokens,
a chat template) into a local folder that transformers and vLLM both load. A real checkpoint
(e.g. a local Qwen3-8B folder) goes through the same `load_model` / `load_tokenizer`.

Invariant: the same (preset, architecture, seed) gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

PRESETS: dict[str, dict[str, int]] = {
    # ~0.3M parameters: fast enough for every unit test.
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256),
    # ~3M parameters: the CPU demo's model.
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=768),
}

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, IM_START, IM_END]


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
    from transformers import Qwen2Config, Qwen3Config

    if preset not in PRESETS:
        raise ValueError(f"model preset {preset!r}: allowed values are {sorted(PRESETS)}")
    config_class = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[architecture]
    sizes = PRESETS[preset]
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


def build_tiny_model(path: str | Path, preset: str = "tiny", seed: int = 0, architecture: str = "qwen2") -> Path:
    """Write a random-init model + tokenizer folder at `path` (overwriting model files)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    config = tiny_model_config(preset, architecture, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "rlactors_model.json").write_text(
        json.dumps({"preset": preset, "architecture": architecture, "seed": seed}, indent=2) + "\n"
    )
    return path


def is_model_folder(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin")))


def ensure_model(path: str | Path, preset: str | None, seed: int = 0, architecture: str = "qwen2") -> Path:
    """Return `path`, building a tiny model there first if it holds none and a preset is given."""
    path = Path(path)
    if is_model_folder(path):
        return path
    if preset is None:
        raise FileNotFoundError(
            f"model.path {str(path)!r} holds no model (config.json + *.safetensors) and model.preset is null"
        )
    return build_tiny_model(path, preset=preset, seed=seed, architecture=architecture)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(path: str | Path, dtype=None, device: str | None = None):
    """Load a causal LM from a local folder (no hub access)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32, local_files_only=True)
    return model.to(device) if device else model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
