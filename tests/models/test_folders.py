import hashlib
import json

import pytest
import torch

from rlactors.config import ModelConfig
from rlactors.models import (
    EOS_TOKEN,
    ModelPathError,
    build_char_tokenizer,
    build_tiny_model,
    count_parameters,
    ensure_model,
    ensure_run_model,
    is_model_folder,
    load_model,
    load_tokenizer,
)


def _digests(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_seed_builds_byte_identical_folders(tmp_path):
    first = build_tiny_model(tmp_path / "a", "tiny", seed=5)
    second = build_tiny_model(tmp_path / "b", "tiny", seed=5)
    other = build_tiny_model(tmp_path / "c", "tiny", seed=6)
    assert _digests(first) == _digests(second)
    assert _digests(first)["model.safetensors"] != _digests(other)["model.safetensors"]
    assert {"tokenizer.json", "config.json", "model.safetensors"} <= set(_digests(first))


@pytest.mark.parametrize("preset,low,high", [("tiny", 0.2e6, 0.45e6), ("small", 2e6, 4.5e6)])
def test_presets_have_their_sizes(tmp_path, preset, low, high):
    model = load_model(build_tiny_model(tmp_path / preset, preset))
    assert low < count_parameters(model) < high


def test_qwen3_architecture_loads(tmp_path):
    path = build_tiny_model(tmp_path / "q3", "tiny", architecture="qwen3")
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"
    logits = load_model(path)(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, len(load_tokenizer(path)))


def test_tokenizer_is_character_level_and_lossless(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    text = "37+45=82\n\\boxed{\\frac{3}{4}} #### 1,000 é"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode())  # one token per byte: one per ASCII character
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids(EOS_TOKEN) == tokenizer.eos_token_id
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    # What loads from disk is the tokenizer that was built.
    assert tokenizer(text)["input_ids"] == build_char_tokenizer()(text)["input_ids"]


def test_ensure_model_builds_only_when_asked_and_says_where(tmp_path, capsys):
    with pytest.raises(ModelPathError, match=r"does not exist.*model\.build_if_missing=true"):
        ensure_model(tmp_path / "m", preset="tiny")
    assert not (tmp_path / "m").exists()
    path = ensure_model(tmp_path / "m", preset="tiny", build_if_missing=True)
    assert f"building a random-init 'tiny' qwen2 model (seed 0) at {path.absolute()}" in capsys.readouterr().out
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(path, preset="tiny", build_if_missing=True) == path
    assert ensure_model(path, preset=None) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert capsys.readouterr().out == ""
    with pytest.raises(ModelPathError, match="model.preset is null"):
        ensure_model(tmp_path / "empty", preset=None, build_if_missing=True)


def test_ensure_model_never_builds_over_other_files_or_a_different_model(tmp_path):
    partial = tmp_path / "Qwen3-8B"
    partial.mkdir()
    (partial / "config.json").write_text("{}")  # a checkpoint still being copied: no weights yet
    with pytest.raises(ModelPathError, match="holds files but no model"):
        ensure_model(partial, preset="tiny", build_if_missing=True)
    assert [p.name for p in partial.iterdir()] == ["config.json"]
    built = ensure_model(tmp_path / "tiny", preset="tiny", build_if_missing=True)
    with pytest.raises(ModelPathError, match="'preset': 'tiny'.*not the configured.*'preset': 'small'"):
        ensure_model(built, preset="small", build_if_missing=True)


def test_a_run_builds_its_model_only_inside_its_output_dir_or_when_asked(tmp_path):
    output_dir = tmp_path / "run"
    typo = ModelConfig(path=str(tmp_path / "models" / "Qwen3-8b"), preset="tiny")
    with pytest.raises(ModelPathError, match="Qwen3-8b"):
        ensure_run_model(typo, output_dir)
    assert not (tmp_path / "models").exists()
    assert is_model_folder(ensure_run_model(typo.model_copy(update={"build_if_missing": True}), output_dir))
    inside = ModelConfig(path=str(output_dir / "model"), preset="tiny")
    assert is_model_folder(ensure_run_model(inside, output_dir))


# vLLM serving a model folder built here (greedy tokens and logprobs equal to transformers'):
# tests/rollout/test_engine.py::test_greedy_and_logprobs_match_transformers_forward.
