"""LoRA adapters on a model (`rlactors.models.lora`), against peft's own merge and loader."""

import copy

import pytest
import torch

from rlactors.config import LoraConfig
from rlactors.models import load_model
from rlactors.models.lora import (
    adapter_state_items,
    add_adapters,
    base_only,
    lora_layers,
    merged_state_items,
    save_adapter,
    without_dropout,
)

IDS = torch.tensor([[5, 17, 42, 9, 100, 3, 77]])


def adapted(model_dir, **settings) -> torch.nn.Module:
    """The tiny model with adapters whose B is random (peft starts it at zero: no effect to see)."""
    model = add_adapters(load_model(model_dir), LoraConfig(rank=4, alpha=8.0, **settings))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_only_the_adapters_train_and_they_start_as_the_identity(tiny_model_dir):
    base = load_model(tiny_model_dir)
    model = add_adapters(load_model(tiny_model_dir), LoraConfig(rank=4, target_modules=["q_proj", "down_proj"]))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "down_proj"}
    assert torch.equal(logits(model), logits(base))  # B = 0


def test_base_only_is_the_base_model_and_the_adapters_come_back(tiny_model_dir):
    base, model = load_model(tiny_model_dir), adapted(tiny_model_dir)
    with_adapters = logits(model)
    assert not torch.allclose(with_adapters, logits(base), atol=1e-3)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    with base_only(model):
        torch.testing.assert_close(logits(model), logits(base), rtol=0, atol=0)
    assert torch.equal(logits(model), with_adapters)
    assert [name for name, p in model.named_parameters() if p.requires_grad] == trainable  # still training


def test_merged_weights_are_peft_s_merge_and_load_into_the_plain_model(tiny_model_dir):
    model = adapted(tiny_model_dir)
    merged = dict(merged_state_items(model, model.state_dict().items()))
    plain = load_model(tiny_model_dir)
    assert merged.keys() == plain.state_dict().keys()  # the base's own names, no adapter tensor
    peft_merged = copy.deepcopy(model)
    for layer in lora_layers(peft_merged).values():
        layer.merge()
    for name, tensor in peft_merged.state_dict().items():
        if ".base_layer." in name:
            torch.testing.assert_close(merged[name.replace(".base_layer.", ".")], tensor, rtol=0, atol=1e-6)
    plain.load_state_dict(merged)
    torch.testing.assert_close(logits(plain), logits(model), rtol=0, atol=1e-5)


def test_a_saved_adapter_loads_in_peft_and_computes_the_same(tiny_model_dir, tmp_path):
    from peft import PeftModel

    model = adapted(tiny_model_dir)
    tensors = dict(adapter_state_items(model, model.state_dict().items()))
    folder = save_adapter(tmp_path / "adapter", tensors, LoraConfig(rank=4, alpha=8.0), str(tiny_model_dir))
    loaded = PeftModel.from_pretrained(load_model(tiny_model_dir), str(folder))
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=1e-6)


def test_without_dropout_makes_a_training_model_s_pass_deterministic(tiny_model_dir):
    model = adapted(tiny_model_dir, dropout=0.5)
    model.train()
    assert not torch.equal(logits(model), logits(model))  # dropout on the adapters' input
    with without_dropout(model):
        assert torch.equal(logits(model), logits(model))
    assert all(m.training for layer in lora_layers(model).values() for m in layer.lora_dropout.values())


def test_a_target_that_matches_no_layer_names_the_field(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model.lora.target_modules=\['qproj'\]"):
        add_adapters(load_model(tiny_model_dir), LoraConfig(rank=4, target_modules=["qproj"]))
