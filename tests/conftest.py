"""Shared fixtures. Add yours here; keep each one cheap or session-scoped (the suite runs on 2 cores)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A `tiny` Qwen2 model folder built once per test session (seed 0)."""
    from rlactors.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The transformers model holding the same weights as the module's engine, and its tokenizer
    (tests that send weights to the engine mutate both together, so each module gets its own)."""
    from rlactors.models import load_model, load_tokenizer

    return load_model(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)


def start_local_ray():
    """The suite's local Ray: 4 CPUs declared (what the pipelines' plans need), no dashboard."""
    import ray

    if not ray.is_initialized():
        # address="local": a new instance even while another Ray runs on this machine (a `ray start`
        # head, e.g. the job-submission test's), which a bare ray.init() would join.
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    return ray


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by the whole session (tests that need another cluster, e.g. a
    simulated multi-node one, shut it down and call `start_local_ray()` again when done)."""
    yield start_local_ray()


class RunsCode:
    """Unpickling this calls `open(marker, "w")`: what a crafted checkpoint file could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def reference_greedy(model, prompt_ids, num_tokens):
    """Argmax decoding with transformers, EOS included like vLLM's ignore_eos (no EOS masking)."""
    import torch

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]
