"""Helpers shared by the rollout tests: transformers references and weight perturbation."""

from __future__ import annotations

import time

import torch
from conftest import reference_greedy  # noqa: F401  (the rollout tests' import point)

from rlactors.types import PromptRequest


def prompts(tokenizer, texts, prefix="p"):
    return [PromptRequest(f"{prefix}{i}", tokenizer.encode(text)) for i, text in enumerate(texts)]


def collect(engine, requests, sampling=None):
    import ray

    return [ray.get(ref) for ref in engine.generate.remote(requests, sampling)]


def reference_logprobs(model, prompt_ids, response_ids, temperature):
    """log_softmax(logits / temperature) of each response token under the transformers forward."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].double()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def perturb_and_send(engine, model, policy_version, seed, transport="shm", verify=True):
    """Add noise to the transformers weights and send them to the engine (a RolloutEngine, or a
    router) over `transport`, in buckets of half the model, through vLLM's weight-transfer API."""
    from rlactors.weight_sync.choice import WeightSyncSettings
    from rlactors.weight_sync.sender import WeightSender

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    # What a trainer sends: a tied lm_head is the embedding and is not sent on its own.
    tied = model.config.tie_word_embeddings
    state = [(n, t) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]
    total_bytes = sum(t.numel() * t.element_size() for _, t in state)
    bucket_bytes = total_bytes // 2 + 1
    if hasattr(engine, "engines"):
        return engine.update_weights(state, policy_version, transport, bucket_bytes, verify=verify), total_bytes
    settings = WeightSyncSettings(transport, bucket_bytes, None, call_timeout_s=300.0, verify=verify)
    stats = WeightSender(rank=0).send(lambda: iter(state), {0: (engine, 0)}, policy_version, settings)
    assert stats["num_buckets"] >= 2 and not stats["failed"]
    return stats, total_bytes


def wait_until_generating(engine):
    import ray

    for _ in range(600):
        if ray.get(engine.health.remote())["num_in_flight_samples"] > 0:
            return
        time.sleep(0.05)
    raise AssertionError("engine never reported in-flight samples")
