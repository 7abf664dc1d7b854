"""Weight syncs over shm and object_store into real vLLM engines (CPU) on the tiny model: repeated
syncs through both segments, agreement of the two transports, verification, an engine that
refuses an update, an engine that dies mid-sync (and its revival through the router), and the
router's own sync.

Two engines for the module, both able to restart once: engine 0 is synced over shm, engine 1 over
object_store, with the same weights; the transformers model holds the weights last sent. The
tests run in file order and each sends fresh weights of its own."""

from __future__ import annotations

import hashlib
import time

import psutil
import pytest
import torch
from conftest import reference_greedy

from rlactors.config import RolloutConfig, SamplingConfig
from rlactors.types import PromptRequest
from rlactors.weight_sync.choice import WeightSyncSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BUCKET_BYTES = 1 << 18  # the tiny model is ~1.3 MB without its tied head: 6 buckets, 3 per segment
TEXTS = ["12+34=", "hello world", "abc", "99-1="]
NUM_TOKENS = 16
# vLLM's checksum of a parameter that holds no bytes: on CPU, vLLM repacks each linear layer's
# weight for its GEMM kernel and leaves the parameter empty, so only embeddings, norms and biases
# are compared there (the greedy and logprob checks cover the rest).
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
GREEDY = SamplingConfig(num_samples_per_prompt=1, temperature=0.0, max_response_tokens=NUM_TOKENS, ignore_eos=True)


class Policy:
    """The transformers model and version the engines should hold; `step` moves both on."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.version = 0

    def step(self, seed: int, engines=()) -> list[tuple[str, torch.Tensor]]:
        import ray

        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        held = [ray.get(engine.health.remote(), timeout=60)["policy_version"] for engine in engines]
        self.version = max([self.version, *held]) + 1
        return self.pairs()

    def pairs(self) -> list[tuple[str, torch.Tensor]]:
        """What a trainer sends: a tied lm_head is the embedding and is not sent on its own."""
        tied = self.model.config.tie_word_embeddings
        return [(name, tensor.detach().clone()) for name, tensor in self.model.state_dict().items()
                if not (tied and name == "lm_head.weight")]

    def requests(self, prefix="p"):
        return [PromptRequest(f"{prefix}{i}", self.tokenizer.encode(text)) for i, text in enumerate(TEXTS)]


def settings(transport: str, verify: bool = True) -> WeightSyncSettings:
    return WeightSyncSettings(transport, BUCKET_BYTES, "float32", call_timeout_s=120.0, verify=verify)


def collect(engine, requests, sampling):
    import ray

    return {group.prompt_id: group for group in (ray.get(ref, timeout=120)
                                                  for ref in engine.generate.remote(requests, sampling))}


def reference_logprobs(model, prompt_ids, response_ids):
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].double()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def check_greedy(engine, policy: Policy):
    """Greedy responses equal the transformers model's, every token labelled the current version."""
    groups = collect(engine, policy.requests(), GREEDY)
    for i, text in enumerate(TEXTS):
        sample = groups[f"p{i}"].samples[0]
        assert sample.response_token_ids == reference_greedy(policy.model, policy.tokenizer.encode(text),
                                                             NUM_TOKENS), text
        assert sample.token_policy_versions == [policy.version] * NUM_TOKENS


def check_sampled_logprobs(engine, policy: Policy):
    sampling = SamplingConfig(num_samples_per_prompt=2, temperature=1.0, max_response_tokens=NUM_TOKENS, seed=3)
    differences = []
    for group in collect(engine, policy.requests("s"), sampling).values():
        for sample in group.samples:
            assert sample.error is None and sample.num_response_tokens > 0
            expected = reference_logprobs(policy.model, sample.prompt_token_ids, sample.response_token_ids)
            differences.append((torch.tensor(sample.response_logprobs).double() - expected).abs())
    assert torch.cat(differences).max() < 1e-4


def checksums(engine) -> dict[str, str]:
    import ray

    return ray.get(engine.weight_checksums.remote(), timeout=120)


def embedding(sums: dict[str, str]) -> str:
    (value,) = [value for name, value in sums.items() if name.endswith("embed_tokens.weight")]
    return value


def health(engine) -> dict:
    import ray

    return ray.get(engine.health.remote(), timeout=60)


def kill_engine_core(engine) -> None:
    """SIGKILL vLLM's engine-core process of `engine` (the actor lives on) and wait until it knows."""
    cores = [process for process in psutil.Process(health(engine)["pid"]).children(recursive=True)
             if any("EngineCore" in part for part in process.cmdline())]
    assert cores, "no engine-core process found"
    for core in cores:
        core.kill()
    for _ in range(600):
        if not health(engine)["healthy"]:
            return
        time.sleep(0.1)
    raise AssertionError("the engine never noticed its engine core died")


@pytest.fixture(scope="module")
def engines(ray_session, tiny_model_dir):
    import ray

    from rlactors.rollout.engine import create_engine

    config = RolloutConfig(max_model_len=128, num_cpus_per_engine=0.5)
    handles = [create_engine(str(tiny_model_dir), config, max_restarts=1) for _ in range(2)]
    try:
        ray.get([handle.ready.remote() for handle in handles], timeout=600)
        yield handles
    finally:
        for handle in handles:
            ray.kill(handle)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from rlactors.models import load_model, load_tokenizer

    return Policy(load_model(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir))


@pytest.fixture(scope="module")
def router(engines, policy):
    from rlactors.rollout.router import RolloutRouter

    return RolloutRouter(engines, policy.version, start_timeout_s=300.0, call_timeout_s=120.0)


def test_repeated_syncs_over_shm_match_transformers_and_object_store(engines, policy):
    from rlactors.weight_sync.sender import WeightSender

    shm_engine, store_engine = engines
    shm_sender, store_sender = WeightSender(rank=0), WeightSender(rank=0)
    previous = [checksums(engine) for engine in engines]
    assert previous[0] == previous[1]  # both start from the checkpoint
    for seed in (1, 2, 3):
        pairs = policy.step(seed, engines)
        total_bytes = sum(tensor.numel() * tensor.element_size() for _, tensor in pairs)
        for sender, engine, transport in ((shm_sender, shm_engine, "shm"), (store_sender, store_engine, "object_store")):
            # As a trainer does: the callable reads the model as it is at each sync.
            stats = sender.send(lambda: iter(policy.pairs()), {0: (engine, 0)}, policy.version, settings(transport))
            assert stats["failed"] == {} and stats["synced"] == [0], stats
            assert stats["transport"] == transport and stats["policy_version"] == policy.version
            assert stats["num_buckets"] >= 4  # each of the two segments filled at least twice per sync
            assert stats["weight_bytes"] == total_bytes and stats["num_tensors"] == len(pairs)
            state = health(engine)
            assert state["policy_version"] == policy.version and state["weights_mixed"] is False
            check_greedy(engine, policy)
        current = [checksums(engine) for engine in engines]
        assert current[0] == current[1], "shm and object_store left different weights"
        held = [name for name, value in current[0].items() if value != EMPTY_SHA256]
        assert embedding(current[0]) in [current[0][name] for name in held]
        unchanged = [name for name in held if current[0][name] == previous[0][name]]
        assert not unchanged, f"weights that did not change: {unchanged}"
        previous = current
    assert shm_sender.num_inits == store_sender.num_inits == 1  # the segments were set up once
    check_sampled_logprobs(shm_engine, policy)
    check_sampled_logprobs(store_engine, policy)


def test_whole_layer_buckets_load_straight_from_the_segments(engines, policy):
    """Buckets big enough for a decoder layer (of the tiny model's ~0.6 MB) hold whole layers: the
    engine loads every layer from views of the segment (the 256 KiB syncs above split layers across
    buckets, and the engine kept those layers' first tensors past their segment's refill)."""
    from rlactors.weight_sync.layout import layer_of
    from rlactors.weight_sync.sender import WeightSender

    shm_engine, store_engine = engines
    pairs = policy.step(4, engines)
    sender = WeightSender(rank=0)
    bucket_bytes = 1 << 20
    stats = sender.send(lambda: iter(policy.pairs()), {0: (shm_engine, 0)}, policy.version,
                        WeightSyncSettings("shm", bucket_bytes, "float32", call_timeout_s=120.0, verify=True))
    assert stats["failed"] == {} and stats["synced"] == [0], stats
    num_layers = len({layer_of(name) for name, _ in pairs if ".layers." in name})
    assert 2 <= stats["num_buckets"] <= num_layers + 2  # more than one: both segments in use
    check_greedy(shm_engine, policy)
    check_sampled_logprobs(shm_engine, policy)
    stats = WeightSender(rank=0).send(lambda: iter(policy.pairs()), {0: (store_engine, 0)}, policy.version,
                                      settings("object_store"))
    assert stats["synced"] == [0], stats
    assert checksums(shm_engine) == checksums(store_engine)


@pytest.mark.parametrize("transport", ["shm", "object_store"])
def test_verify_names_a_tensor_that_differs_from_what_was_sent(engines, policy, transport, monkeypatch):
    """The sender's digest of the third tensor is wrong: each engine is failed, naming that tensor."""
    import rlactors.weight_sync.trainer_engines as trainer_engines
    from rlactors.weight_sync.sender import WeightSender

    digest, calls = trainer_engines.digest, []

    def tampered(tensor):
        calls.append(tensor.shape)
        return "0" * 64 if len(calls) == 3 else digest(tensor)

    monkeypatch.setattr(trainer_engines, "digest", tampered)
    pairs = policy.step(10 + len(transport), engines)
    targets = {index: (engine, 0) for index, engine in enumerate(engines)}
    stats = WeightSender(rank=0).send(lambda: iter(pairs), targets, policy.version, settings(transport))
    assert len(calls) == len(pairs)
    assert stats["synced"] == [] and sorted(stats["failed"]) == [0, 1], stats
    name = pairs[2][0]
    for error in stats["failed"].values():
        assert error.startswith("verify: ") and repr(name) in error and "1 tensor(s) differ" in error, error
    # Without verification the same sync passes: the bytes themselves arrived whole.
    monkeypatch.setattr(trainer_engines, "digest", digest)
    stats = WeightSender(rank=0).send(lambda: iter(pairs), targets, policy.version, settings(transport))
    assert stats["failed"] == {} and stats["synced"] == [0, 1], stats


def test_an_engine_that_refuses_the_update_is_reported_and_the_other_syncs(engines, policy):
    import ray

    from rlactors.weight_sync.sender import WeightSender

    ahead, behind = engines[1], engines[0]
    pairs = policy.step(20, engines)
    ray.get(ahead.load_state_dict.remote({"policy_version": policy.version + 5}), timeout=60)
    before = checksums(ahead)
    targets = {0: (behind, 0), 1: (ahead, 0)}
    stats = WeightSender(rank=0).send(lambda: iter(pairs), targets, policy.version, settings("shm"))
    assert stats["synced"] == [0] and sorted(stats["failed"]) == [1], stats
    assert "start_weight_update" in stats["failed"][1] and "older than the loaded" in stats["failed"][1]
    assert health(behind)["policy_version"] == policy.version
    refused = health(ahead)
    assert refused["policy_version"] == policy.version + 5 and refused["weights_mixed"] is False
    assert refused["healthy"] is True
    assert checksums(ahead) == before  # nothing loaded
    assert embedding(checksums(behind)) != embedding(before)
    check_greedy(behind, policy)

    # Every engine refusing: the sync reaches none, names each, and still raises nothing.
    stats = WeightSender(rank=0).send(lambda: iter(pairs), {1: (ahead, 0)}, policy.version, settings("object_store"))
    assert stats["synced"] == [] and list(stats["failed"]) == [1] and "older" in stats["failed"][1], stats


def test_an_engine_crash_mid_sync_fails_it_alone_and_the_router_revives_it(engines, policy, router, monkeypatch):
    """Engine 1's vLLM core is killed as the second bucket goes out: the sender returns with it in
    `failed` and engine 0 synced; the router then restarts it and loads the current weights into
    it through the weight loader before it is healthy again."""
    import ray

    from rlactors.weight_sync.client import EngineSyncClient
    from rlactors.weight_sync.sender import WeightSender

    survivor, victim = engines
    victim_pid = health(victim)["pid"]
    update_weights, num_buckets = EngineSyncClient.update_weights, []

    def killing_on_the_second_bucket(client, update_info):
        num_buckets.append(len(client.live))
        if len(num_buckets) == 2:
            kill_engine_core(victim)
        return update_weights(client, update_info)

    monkeypatch.setattr(EngineSyncClient, "update_weights", killing_on_the_second_bucket)
    pairs = policy.step(30, engines)
    targets = router.weight_sync_targets(policy.version)
    assert sorted(targets) == [0, 1]
    stats = WeightSender(rank=0).send(lambda: iter(pairs), targets, policy.version, settings("shm"))
    monkeypatch.setattr(EngineSyncClient, "update_weights", update_weights)
    assert stats["synced"] == [0] and sorted(stats["failed"]) == [1], stats
    assert "update_weights" in stats["failed"][1] and "EngineDead" in stats["failed"][1], stats["failed"][1]
    assert num_buckets[:2] == [2, 2] and set(num_buckets[2:]) == {1}  # engine 0 got every bucket after
    assert len(num_buckets) == stats["num_buckets"]
    assert health(survivor)["policy_version"] == policy.version
    check_greedy(survivor, policy)

    loads = []

    def load_current_weights(revived, version):
        loads.append((sorted(revived), version))
        figures = WeightSender(rank=0).send(lambda: iter(pairs), revived, version, settings("shm"))
        return ray.put(figures)

    router.set_weight_loader(load_current_weights)
    router.weight_sync_done(targets, stats)
    assert router.health()[1]["state"] in ("restarting", "loading")
    states = router.wait_until_healthy(timeout_s=300)
    assert [state["state"] for state in states] == ["healthy", "healthy"], states
    assert states[1]["num_failures"] == 1 and states[1]["last_error"].startswith("weight sync: update_weights")
    assert states[0]["num_failures"] == 0
    assert loads == [([1], policy.version)]
    revived = health(victim)
    assert revived["policy_version"] == policy.version and revived["weights_mixed"] is False
    assert revived["pid"] != victim_pid  # a new actor process
    assert checksums(victim) == checksums(survivor)
    check_greedy(victim, policy)


def test_router_sync_over_object_store_equals_one_over_shm(engines, policy, router):
    pairs = policy.step(40, engines)
    before = checksums(engines[0])
    over_store = router.update_weights(pairs, policy.version, transport="object_store", bucket_bytes=BUCKET_BYTES,
                                       verify=True)
    assert over_store["failed"] == {} and over_store["synced"] == [0, 1], over_store
    assert over_store["num_buckets"] >= 4
    store_sums = [checksums(engine) for engine in engines]
    assert store_sums[0] == store_sums[1] and embedding(store_sums[0]) != embedding(before)
    assert all(health(engine)["policy_version"] == policy.version for engine in engines)

    policy.version += 1  # the same weights again, as a newer version
    over_shm = router.update_weights(pairs, policy.version, transport="shm", bucket_bytes=BUCKET_BYTES, verify=True)
    assert over_shm["failed"] == {} and over_shm["synced"] == [0, 1], over_shm
    assert [checksums(engine) for engine in engines] == store_sums
    assert all(health(engine)["policy_version"] == policy.version for engine in engines)
    for engine in engines:
        check_greedy(engine, policy)


def test_router_syncs_with_the_same_settings_send_each_call_s_pairs(engines, policy, router):
    for seed in (50, 51):
        pairs = policy.step(seed, engines)
        stats = router.update_weights(pairs, policy.version, transport="shm", bucket_bytes=BUCKET_BYTES, verify=True)
        assert stats["failed"] == {} and stats["synced"] == [0, 1], stats
    for engine in engines:
        check_greedy(engine, policy)
