"""RolloutRouter over two real engines: requeued partial rollouts, and a replica killed mid-batch."""

from __future__ import annotations

import pytest
from rollout_helpers import collect, perturb_and_send, prompts, reference_greedy, wait_until_generating

from rlactors.config import RolloutConfig, SamplingConfig

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

NUM_TOKENS = 150


@pytest.fixture(scope="module")
def router(ray_session, tiny_model_dir):
    import ray

    from rlactors.rollout.router import RolloutRouter

    config = RolloutConfig(num_engines=2, partial_rollout=True, on_abort="requeue", max_model_len=256)
    router = RolloutRouter.create(str(tiny_model_dir), config, max_restarts=1)
    assert [h["state"] for h in router.ready()] == ["healthy", "healthy"]
    yield router
    for engine in router.engines:
        ray.kill(engine)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from rlactors.models import load_model, load_tokenizer

    return load_model(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)


def long_sampling(seed=None):
    return SamplingConfig(num_samples_per_prompt=2, max_response_tokens=NUM_TOKENS, ignore_eos=True, seed=seed)


def test_requeue_restarts_interrupted_responses_under_new_weights(router, reference):
    import ray

    model, tokenizer = reference
    requests = prompts(tokenizer, [f"q{i}?" for i in range(12)])
    stream = router.generate(requests, long_sampling(seed=5))
    first = next(stream)  # both replicas are busy with the rest
    perturb_and_send(router, model, policy_version=1, seed=11)
    groups = [first, *stream]

    assert sorted(g.prompt_id for g in groups) == sorted(r.prompt_id for r in requests)
    for group in groups:
        for sample in group.samples:
            assert sample.finish_reason == "length" and sample.num_response_tokens == NUM_TOKENS
            assert len(set(sample.token_policy_versions)) == 1  # requeued: restarted, never mixed
    interrupted = sum(ray.get(engine.health.remote())["num_interrupted"] for engine in router.engines)
    assert interrupted > 0
    assert any(s.token_policy_versions[0] == 1 for g in groups for s in g.samples)


def test_killed_replica_requests_are_resent_and_it_restarts_with_current_weights(router, reference):
    import ray

    model, tokenizer = reference
    perturb_and_send(router, model, policy_version=2, seed=12)
    requests = prompts(tokenizer, [f"item {i}:" for i in range(16)], prefix="k")
    stream = router.generate(requests, long_sampling())
    victim = router.engines[1]
    wait_until_generating(victim)
    ray.kill(victim, no_restart=False)  # Ray restarts it (max_restarts=1)
    groups = list(stream)
    print(f"batch done after the kill; replica states {router.health()}")

    returned = [g.prompt_id for g in groups]
    assert sorted(returned) == sorted(r.prompt_id for r in requests)  # each prompt exactly once
    assert all(s.error is None and s.num_response_tokens == NUM_TOKENS for g in groups for s in g.samples)
    assert all(s.token_policy_versions == [2] * NUM_TOKENS for g in groups for s in g.samples)
    assert router.num_resent > 0
    assert router.health()[1]["num_failures"] == 1

    assert [h["state"] for h in router.wait_until_healthy(timeout_s=600)] == ["healthy", "healthy"]
    assert ray.get(victim.health.remote())["policy_version"] == 2
    # The restarted replica generates with the current weights, not the checkpoint it started from.
    greedy = SamplingConfig(num_samples_per_prompt=1, temperature=0.0, max_response_tokens=16, ignore_eos=True)
    texts = ["12+34=", "hello"]
    for engine in router.engines:
        groups = {g.prompt_id: g for g in collect(engine, prompts(tokenizer, texts), greedy)}
        for i, text in enumerate(texts):
            assert groups[f"p{i}"].samples[0].response_token_ids == reference_greedy(model, tokenizer.encode(text), 16)
