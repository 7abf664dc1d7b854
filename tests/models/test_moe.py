"""The MoE preset, and the one mapping between the trainer's fused experts and the checkpoint's
one tensor per expert (what vLLM's loader and `from_pretrained` read)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlactors.models import build_tiny_model, count_parameters, load_model
from rlactors.models.moe import (
    active_parameters,
    checkpoint_layout,
    checkpoint_shapes,
    folder_checkpoint_layout,
    identity_split,
    num_experts,
    num_experts_per_token,
)


def test_the_moe_preset_is_byte_reproducible_and_routes_two_of_eight(tmp_path, tiny_moe_model_dir):
    again = build_tiny_model(tmp_path / "again", "tiny", seed=0, architecture="qwen3_moe")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (tiny_moe_model_dir / name).read_bytes(), name
    config = json.loads((tiny_moe_model_dir / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("qwen3_moe", 8, 2)
    model = load_model(tiny_moe_model_dir)
    assert (num_experts(model.config), num_experts_per_token(model.config)) == (8, 2)
    # Each layer's 8 experts of width 128 hold 4x the dense layer's MLP; a token passes through 2.
    total, active = count_parameters(model), active_parameters(model)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert active == total - experts + experts // 4
    assert 0.3e6 < active < total < 1.5e6


def test_the_split_of_every_tensor_is_the_saved_folder_and_loads_back_bit_for_bit(tiny_moe_model_dir, tmp_path):
    model = load_model(tiny_moe_model_dir)
    split = checkpoint_layout(model)
    saved = load_file(str(tiny_moe_model_dir / "model.safetensors"))
    pairs = [pair for name, tensor in model.state_dict().items() if name != "lm_head.weight"
             for pair in split(name, tensor)]
    assert sorted(name for name, _ in pairs) == sorted(saved)  # the names save_pretrained writes
    for name, tensor in pairs:
        assert torch.equal(tensor, saved[name]), name
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in saved
    # Metadata without the tensors: the same names and shapes, computed on the meta device.
    fused = model.model.layers[0].mlp.experts.gate_up_proj
    metas = checkpoint_shapes(split, "model.layers.0.mlp.experts.gate_up_proj", tuple(fused.shape), torch.bfloat16)
    assert [(n, tuple(t.shape)) for n, t in split("model.layers.0.mlp.experts.gate_up_proj", fused)] == \
        [(n, s) for n, _, s in metas]
    assert {dtype for _, dtype, _ in metas} == {torch.bfloat16}
    # From the folder alone (a DCP export has no live model): the same mapping.
    from_folder = folder_checkpoint_layout(tiny_moe_model_dir)
    for name, tensor in from_folder("model.layers.0.mlp.experts.down_proj", model.model.layers[0].mlp.experts.down_proj):
        assert torch.equal(tensor, saved[name])
    # Round trip: the split tensors, loaded by transformers, are the fused tensors again.
    from safetensors.torch import save_file

    folder = tmp_path / "resaved"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_moe_model_dir / name).read_bytes())
    save_file({name: tensor.contiguous() for name, tensor in pairs}, str(folder / "model.safetensors"))
    reloaded = load_model(folder).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded[name], tensor), name


def test_a_dense_model_maps_to_itself(tiny_model_dir):
    model = load_model(tiny_model_dir)
    assert checkpoint_layout(model) is identity_split
    assert folder_checkpoint_layout(tiny_model_dir) is identity_split
    assert active_parameters(model) == count_parameters(model)


@pytest.mark.parametrize("architecture", ["qwen4", "llama"])
def test_an_unknown_architecture_names_the_allowed_ones(tmp_path, architecture):
    with pytest.raises(ValueError, match="qwen3_moe"):
        build_tiny_model(tmp_path / "x", "tiny", architecture=architecture)
