"""Multi-turn episodes in a real RolloutEngine (vLLM on CPU), against a transformers forward, on the
rollout tests' shared engine (`engine` in tests/conftest.py: at most 3 turns of 8 tokens, 2 s per
environment step); each request names its environment."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from rollout_helpers import (
    collect,
    perturb_and_send,
    reference_logprobs,
    wait_until_generating,
)

from rlactors.config import SamplingConfig
from rlactors.types import PromptRequest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ENVIRONMENTS = Path(__file__).with_name("scripted_environments.py")
TURN_TOKENS = 8


def spec(name: str) -> str:
    return f"{ENVIRONMENTS}:{name}"


def requests_for(tokenizer, texts, **extra_info):
    """Episodes of the scripted environment (`extra_info` goes to it)."""
    return [PromptRequest(f"p{i}", tokenizer.encode(text), extra_info={"environment": spec("Scripted"), **extra_info})
            for i, text in enumerate(texts)]


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of the loss mask."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def _version(engine) -> int:
    import ray

    return ray.get(engine.health.remote())["policy_version"]


def test_turns_tokens_mask_logprobs_and_versions(engine, reference):
    model, tokenizer = reference
    version = _version(engine)
    sampling = SamplingConfig(num_samples_per_prompt=2, temperature=1.0, max_response_tokens=100, ignore_eos=True,
                              seed=4)
    groups = collect(engine, requests_for(tokenizer, ["12*34=", "hello"], intro="go:"), sampling)
    for group in groups:
        for sample in group.samples:
            assert sample.error is None and sample.environment_error is None
            tokens, mask = sample.response_token_ids, sample.loss_mask
            assert len(mask) == len(tokens) == len(sample.response_logprobs) == len(sample.token_policy_versions)
            runs = segments(mask)
            # intro, then turn, observation, turn, observation, turn: done after the third step.
            assert [value for value, _, _ in runs] == [0, 1, 0, 1, 0, 1]
            observations = [tokenizer.decode(tokens[start:end]) for value, start, end in runs if value == 0]
            assert observations == ["go:", "#0|", "#1|"]
            for value, start, end in runs:
                if value == 1:  # a model turn: at most the per-turn budget, ended there or at "]"
                    assert end - start <= TURN_TOKENS
                    assert end - start == TURN_TOKENS or tokenizer.decode(tokens[end - 1:end]) == "]"
            assert sample.num_turns == 3 and sample.episode_reward == pytest.approx(1.5)
            assert sample.token_policy_versions == [version] * len(tokens)
            assert all(sample.response_logprobs[i] == 0.0 for i, m in enumerate(mask) if not m)
            # Model tokens' logprobs are the transformers forward's over the whole sequence so far.
            expected = reference_logprobs(model, sample.prompt_token_ids, tokens, 1.0)
            model_positions = torch.tensor(mask).bool()
            difference = (torch.tensor(sample.response_logprobs).double() - expected)[model_positions].abs()
            assert difference.max() < 1e-4
            assert sample.text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_an_episode_interrupted_by_a_weight_sync_goes_on_under_the_new_weights(engine, reference):
    import ray

    model, tokenizer = reference
    old_version = _version(engine)
    old_state = {k: v.clone() for k, v in model.state_dict().items()}
    interrupted_before = ray.get(engine.health.remote())["num_interrupted"]
    sampling = SamplingConfig(num_samples_per_prompt=8, max_response_tokens=100, ignore_eos=True, seed=5)
    requests = requests_for(tokenizer, [f"q{i}:" for i in range(16)], delay_s=0.05)
    stream = engine.generate.remote(requests, sampling)
    wait_until_generating(engine)
    time.sleep(0.3)
    new_version = old_version + 1
    perturb_and_send(engine, model, new_version, seed=7)
    groups = [ray.get(ref) for ref in stream]

    old_model = type(model)(model.config).eval()
    old_model.load_state_dict(old_state)
    num_spanning = 0
    for group in groups:
        for sample in group.samples:
            assert sample.error is None and sample.environment_error is None and sample.num_turns == 3
            versions, mask = sample.token_policy_versions, sample.loss_mask
            assert versions == sorted(versions) and set(versions) <= {old_version, new_version}
            for i, m in enumerate(mask):  # an observation carries the version of the turn before it
                if not m and i > 0:
                    assert versions[i] == versions[i - 1]
            if len(set(versions)) < 2:
                continue
            num_spanning += 1
            logprobs = torch.tensor(sample.response_logprobs).double()
            for reference_model, version in ((old_model, old_version), (model, new_version)):
                expected = reference_logprobs(reference_model, sample.prompt_token_ids, sample.response_token_ids, 1.0)
                chosen = torch.tensor([bool(m) and v == version for m, v in zip(mask, versions, strict=True)])
                assert (logprobs - expected)[chosen].abs().max() < 1e-4
    interrupted = ray.get(engine.health.remote())["num_interrupted"] - interrupted_before
    print(f"{num_spanning} of 128 episodes span two versions; {interrupted} turns were cut by the sync and resumed")
    assert num_spanning > 0 and interrupted > 0


def test_a_failing_environment_ends_only_its_own_episode(engine, reference):
    _, tokenizer = reference
    sampling = SamplingConfig(num_samples_per_prompt=2, max_response_tokens=60, ignore_eos=True, seed=6)
    names = ["Scripted", "Raises", "Hangs", "Crashes", "FailsToReset"]
    requests = [PromptRequest(f"p{i}", tokenizer.encode("1+1="), extra_info={"environment": spec(name)})
                for i, name in enumerate(names)]
    start = time.monotonic()
    groups = {g.prompt_id: g for g in collect(engine, requests, sampling)}
    assert time.monotonic() - start < 60  # the hung step was killed at its 2 s limit
    expected = {"p1": "KeyError: 'scripted failure'", "p2": "step_timeout_s=2.0", "p3": "its process died"}
    for sample in groups.pop("p4").samples:  # no model token to train: a rollout error, its group dropped
        assert sample.finish_reason == "error" and "RuntimeError: no episode today" in sample.error
        assert sample.num_response_tokens == 0 and sample.environment_error == sample.error
    for prompt_id, group in groups.items():
        for sample in group.samples:
            assert sample.error is None and len(sample.loss_mask) == sample.num_response_tokens
            if prompt_id == "p0":
                assert sample.environment_error is None and sample.num_turns == 3
                continue
            # The failing step came after turn 1: that turn's tokens and the first observation stay.
            assert expected[prompt_id] in sample.environment_error
            assert f"prompt_id={prompt_id!r} sample {sample.sample_index} turn 2" in sample.environment_error
            assert sample.num_turns == 2 and segments(sample.loss_mask)[-1][0] == 1
