"""Helpers shared by the rollout tests: transformers references and weight perturbation."""

from __future__ import annotations

import time

import torch
from conftest import reference_greedy, reference_logprobs, send_weights  # noqa: F401  (the rollout tests' import point)

from rlactors.types import PromptRequest


def prompts(tokenizer, texts, prefix="p"):
    return [PromptRequest(f"{prefix}{i}", tokenizer.encode(text)) for i, text in enumerate(texts)]


def collect(engine, requests, sampling=None):
    import ray

    return [ray.get(ref) for ref in engine.generate.remote(requests, sampling)]


def perturb_and_send(engine, model, policy_version, seed, transport="shm", verify=True):
    """Add noise to the transformers weights and send them to the engine (`send_weights`)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return send_weights(engine, model, policy_version, transport, verify)


def wait_until_generating(engine):
    import ray

    for _ in range(600):
        if ray.get(engine.health.remote())["num_in_flight_samples"] > 0:
            return
        time.sleep(0.05)
    raise AssertionError("engine never reported in-flight samples")
