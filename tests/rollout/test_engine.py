"""RolloutEngine against real vLLM (CPU) and a transformers reference, on the rollout tests' shared
engine (`engine` in tests/conftest.py)."""

from __future__ import annotations

import time

import pytest
import torch
from rollout_helpers import (
    collect,
    perturb_and_send,
    prompts,
    reference_greedy,
    reference_logprobs,
    wait_until_generating,
)

from rlactors.config import SamplingConfig
from rlactors.types import PromptRequest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LONG_TOKENS = 220  # long enough that a response is still being generated when we interrupt it


def test_greedy_and_logprobs_match_transformers_forward(engine, reference):
    model, tokenizer = reference
    version = _version(engine)
    greedy = SamplingConfig(num_samples_per_prompt=1, temperature=0.0, max_response_tokens=24, ignore_eos=True)
    texts = ["12+34=", "Simplify 6/8."]
    for group in collect(engine, prompts(tokenizer, texts), greedy):
        text = texts[int(group.prompt_id[1:])]
        assert group.samples[0].response_token_ids == reference_greedy(model, tokenizer.encode(text), 24), text
    requests = prompts(tokenizer, ["12+34=", "hello", "7*8="])
    for temperature in (1.0, 0.7):
        sampling = SamplingConfig(num_samples_per_prompt=2, temperature=temperature, max_response_tokens=24, seed=1)
        groups = collect(engine, requests, sampling)
        assert sorted(g.prompt_id for g in groups) == ["p0", "p1", "p2"]
        differences = []
        for group in groups:
            assert [s.sample_index for s in group.samples] == [0, 1]
            for sample in group.samples:
                assert sample.finish_reason in ("stop", "length") and sample.error is None
                assert len(sample.response_logprobs) == sample.num_response_tokens > 0
                assert sample.token_policy_versions == [version] * sample.num_response_tokens
                assert sample.prompt_token_ids == group.request.prompt_token_ids
                expected = reference_logprobs(model, sample.prompt_token_ids, sample.response_token_ids, temperature)
                differences.append((torch.tensor(sample.response_logprobs).double() - expected).abs())
        differences = torch.cat(differences)
        print(f"temperature {temperature}: logprob |engine - transformers| max {differences.max():.2e} "
              f"mean {differences.mean():.2e} over {differences.numel()} tokens")
        assert differences.max() < 1e-4


def test_groups_stream_in_completion_order(engine, reference):
    _, tokenizer = reference
    requests = prompts(tokenizer, ["long one", "short one"])
    sampling = [
        SamplingConfig(num_samples_per_prompt=2, max_response_tokens=LONG_TOKENS, ignore_eos=True),
        SamplingConfig(num_samples_per_prompt=2, max_response_tokens=2, ignore_eos=True),
    ]
    groups = collect(engine, requests, sampling)
    assert [g.prompt_id for g in groups] == ["p1", "p0"]  # the short group does not wait for the long one
    assert [s.num_response_tokens for g in groups for s in g.samples] == [2, 2, LONG_TOKENS, LONG_TOKENS]
    assert all(s.finish_reason == "length" for g in groups for s in g.samples)


def test_health_answers_while_the_engine_generates(engine, reference):
    """The router probes a quiet replica with `health()` under a short timeout: it must answer while
    the engine is busy generating, not after."""
    import ray

    from rlactors.runtime.calls import get_within

    _, tokenizer = reference
    sampling = SamplingConfig(num_samples_per_prompt=4, max_response_tokens=LONG_TOKENS, ignore_eos=True)
    stream = engine.generate.remote(prompts(tokenizer, ["one", "two", "three", "four"]), sampling)
    wait_until_generating(engine)
    latencies_s, in_flight, outputs = [], [], []
    for _ in range(20):
        start = time.perf_counter()
        health = get_within(engine.health.remote(), 30, "health() while generating")
        latencies_s.append(time.perf_counter() - start)
        in_flight.append(health["num_in_flight_samples"])
        outputs.append(health["num_engine_outputs"])
    groups = [ray.get(ref) for ref in stream]
    # The engine core's progress, which the router's watchdog reads: it grows while generating.
    done = get_within(engine.health.remote(), 30, "health() after generating")
    assert not health["paused"] and done["num_engine_outputs"] > outputs[0], (outputs, done["num_engine_outputs"])
    assert done["num_engine_outputs"] >= 4 * LONG_TOKENS  # one output per sample per engine step, at least
    print(f"health() while generating: median {sorted(latencies_s)[len(latencies_s) // 2] * 1e3:.1f} ms, "
          f"max {max(latencies_s) * 1e3:.1f} ms; in-flight samples seen {in_flight}")
    assert len(groups) == 4 and health["healthy"] and health["error"] is None
    assert in_flight[0] > 0  # answered mid-generation, not once it was over


def test_bad_requests_get_errors_naming_the_prompt_and_the_rest_finish(engine, reference):
    _, tokenizer = reference
    good = tokenizer.encode("1+1=")
    requests = [
        PromptRequest("empty", []),
        PromptRequest("too-long", good * 100),
        PromptRequest("bad-token", [5, 10_000_000]),
        PromptRequest("bad-sampling", good),
        PromptRequest("good", good),
    ]
    ok = {"num_samples_per_prompt": 2, "max_response_tokens": 4}
    sampling = [ok, ok, ok, {**ok, "temperature": -1.0}, ok]
    groups = {g.prompt_id: g for g in collect(engine, requests, sampling)}
    assert set(groups) == {"empty", "too-long", "bad-token", "bad-sampling", "good"}
    expected_words = {"empty": "empty prompt", "too-long": "max_model_len", "bad-token": "vocabulary",
                      "bad-sampling": "temperature"}
    for prompt_id, words in expected_words.items():
        samples = groups[prompt_id].samples
        assert samples and all(s.finish_reason == "error" for s in samples), prompt_id
        assert all(f"prompt_id={prompt_id!r}" in s.error and words in s.error for s in samples), samples[0].error
    assert [s.finish_reason for s in groups["good"].samples] != ["error", "error"]
    assert all(s.error is None and s.num_response_tokens > 0 for s in groups["good"].samples)


def test_text_is_the_decoded_response_and_stop_strings_cut_it(engine, reference):
    _, tokenizer = reference
    greedy = SamplingConfig(num_samples_per_prompt=1, temperature=0.0, max_response_tokens=32, ignore_eos=True)
    [group] = collect(engine, prompts(tokenizer, ["hello world"]), greedy)
    sample = group.samples[0]
    assert sample.text == tokenizer.decode(sample.response_token_ids, skip_special_tokens=True)
    # A stop string taken from the middle of that text ends the same greedy response there.
    stop = sample.text[10:12]
    cut = sample.text.index(stop)
    stopped = SamplingConfig(num_samples_per_prompt=1, temperature=0.0, max_response_tokens=32, stop=[stop])
    [group] = collect(engine, prompts(tokenizer, ["hello world"]), stopped)
    assert group.samples[0].finish_reason == "stop"
    assert group.samples[0].text == sample.text[:cut]


def test_a_greedy_baseline_comes_beside_the_samples_and_is_the_greedy_response(engine, reference):
    """ReMax's baseline (`sampling.greedy_baseline`): one more response per prompt, greedy whatever
    the sampling temperature, kept out of `samples`."""
    model, tokenizer = reference
    sampling = SamplingConfig(num_samples_per_prompt=3, temperature=1.0, max_response_tokens=12, seed=3,
                              ignore_eos=True, greedy_baseline=True)
    groups = collect(engine, prompts(tokenizer, ["12+34=", "hello"]), sampling)
    for group in groups:
        assert [s.sample_index for s in group.samples] == [0, 1, 2]
        baseline = group.baseline
        assert baseline is not None and baseline.sample_index == 3 and baseline.error is None
        expected = reference_greedy(model, group.request.prompt_token_ids, 12)
        assert baseline.response_token_ids == expected
        assert len({tuple(s.response_token_ids) for s in group.samples} | {tuple(expected)}) > 1  # the others sample
    [plain] = collect(engine, prompts(tokenizer, ["hello"]), sampling.model_copy(update={"greedy_baseline": False}))
    assert plain.baseline is None


def test_weight_update_then_greedy_equals_transformers(engine, reference):
    model, tokenizer = reference
    version = _version(engine) + 1
    stats, total_bytes = perturb_and_send(engine, model, version, seed=1)
    assert stats["policy_version"] == version
    assert stats["weight_bytes"] == total_bytes and stats["num_tensors"] == len(model.state_dict()) - 1  # tied head
    assert stats["weight_sync_s"] > 0 and stats["bytes_per_s"] > 0
    print(f"weight update: {total_bytes} bytes in {stats['weight_sync_s']:.4f} s")

    texts = ["12+34=", "hello world", "abc", "99-1="]
    greedy = SamplingConfig(num_samples_per_prompt=1, temperature=0.0, max_response_tokens=24, ignore_eos=True)
    groups = {g.prompt_id: g for g in collect(engine, prompts(tokenizer, texts), greedy)}
    for i, text in enumerate(texts):
        sample = groups[f"p{i}"].samples[0]
        assert sample.response_token_ids == reference_greedy(model, tokenizer.encode(text), 24), text
        assert sample.token_policy_versions == [version] * 24
    # Sampled tokens' logprobs too: every layer, the tied output head included, holds the new weights.
    sampled = SamplingConfig(num_samples_per_prompt=2, temperature=1.0, max_response_tokens=16, seed=3)
    for group in collect(engine, prompts(tokenizer, texts), sampled):
        for sample in group.samples:
            expected = reference_logprobs(model, sample.prompt_token_ids, sample.response_token_ids, 1.0)
            assert (torch.tensor(sample.response_logprobs).double() - expected).abs().max() < 1e-4


def test_partial_rollout_resumes_under_new_weights(engine, reference):
    import ray

    model, tokenizer = reference
    old_version = _version(engine)
    old_model_state = {k: v.clone() for k, v in model.state_dict().items()}
    # 128 responses of LONG_TOKENS take ~1.4 s on a warm engine on an idle 2-core machine (32 took
    # 0.45 s, within the wait below, so none was interrupted). A cold engine's first steps are
    # slow enough that an update 0.3 s in finds no tokens yet: warm it first.
    requests = prompts(tokenizer, [f"question {i}:" for i in range(16)])
    collect(engine, requests[:2], SamplingConfig(num_samples_per_prompt=2, max_response_tokens=8, seed=1))
    sampling = SamplingConfig(num_samples_per_prompt=8, max_response_tokens=LONG_TOKENS, ignore_eos=True, seed=3)
    health_before, clock_started = ray.get(engine.health.remote()), time.monotonic()
    clock_before = health_before["time_s"]
    stream = engine.generate.remote(requests, sampling)
    wait_until_generating(engine)
    time.sleep(0.3)  # let responses get part-way (a test of labels, not of speed)
    new_version = old_version + 1
    perturb_and_send(engine, model, new_version, seed=2)
    groups = [ray.get(ref) for ref in stream]
    health_after, clock_elapsed_s = ray.get(engine.health.remote()), time.monotonic() - clock_started
    clock_after = health_after["time_s"]

    assert sorted(g.prompt_id for g in groups) == sorted(r.prompt_id for r in requests)
    old_model = type(model)(model.config).eval()
    old_model.load_state_dict(old_model_state)
    num_spanning = 0
    for group in groups:
        for sample in group.samples:
            versions = sample.token_policy_versions
            assert sample.finish_reason == "length" and sample.num_response_tokens == LONG_TOKENS
            assert len(versions) == len(sample.response_logprobs) == LONG_TOKENS
            assert versions == sorted(versions) and set(versions) <= {old_version, new_version}
            if len(set(versions)) == 2:
                num_spanning += 1
                # Each token's logprob is that of the weights its label names.
                boundary = versions.index(new_version)
                engine_logprobs = torch.tensor(sample.response_logprobs).double()
                for reference_model, span in ((old_model, slice(0, boundary)), (model, slice(boundary, None))):
                    expected = reference_logprobs(reference_model, sample.prompt_token_ids,
                                                  sample.response_token_ids, 1.0)
                    assert (engine_logprobs[span] - expected[span]).abs().max() < 1e-4
    assert num_spanning > 0, "no response was interrupted: nothing carries two policy versions"
    # Where vLLM labels tokens itself (>= 0.32), it agrees with the engine's own labels on every piece.
    assert ray.get(engine.health.remote())["num_version_disagreements"] == 0
    # The engine's clock: generating for at least the wait above, paused for the update, and every
    # second of the call in one of its states.
    spent = {state: clock_after[state] - clock_before[state] for state in clock_after}
    assert spent["generating"] >= 0.3 and spent["paused"] > 0.0, spent
    assert abs(sum(spent.values()) - clock_elapsed_s) < 0.25, (spent, clock_elapsed_s)
    # Occupancy: 128 responses of one length run side by side from start to end (vLLM's default
    # max_num_seqs on CPU is 128: all of them), however the update paused them.
    running = (health_after["running_request_s"] - health_before["running_request_s"]) / spent["generating"]
    slots = health_after["max_num_seqs"]
    assert 0.8 * min(128, slots) < running <= slots, (running, slots)
    print(f"{num_spanning} of {sum(len(g.samples) for g in groups)} responses span versions "
          f"{old_version} and {new_version}")


def test_without_partial_rollouts_each_response_is_labelled_with_the_weights_that_made_all_of_it(engine, reference):
    """partial_rollout off, more requests in flight than vLLM schedules at once (max_num_seqs),
    and a weight update mid-generation: vLLM's pause lets the running requests finish, while the
    queued ones (and any it preempted) would run after the update under the new weights. Every
    response still comes from one version, and every token's logprob is that of the weights its
    label names (float64 reference)."""
    import ray

    model, tokenizer = reference
    old_version = _version(engine)
    old_model = type(model)(model.config).eval()
    old_model.load_state_dict(model.state_dict())
    started = ray.get(engine.__ray_call__.remote(lambda self: self.config), timeout=60)
    max_num_seqs = ray.get(engine.__ray_call__.remote(lambda self: self.llm.vllm_config.scheduler_config.max_num_seqs))
    num_samples = 8
    requests = prompts(tokenizer, [f"queued {i}:" for i in range(max_num_seqs // num_samples + 8)], prefix="w")
    sampling = SamplingConfig(num_samples_per_prompt=num_samples, max_response_tokens=48, ignore_eos=True, seed=4)
    disagreements_before = ray.get(engine.health.remote())["num_version_disagreements"]
    ray.get(engine.use_run_settings.remote(started.model_copy(update={"partial_rollout": False})), timeout=60)
    try:
        stream = engine.generate.remote(requests, sampling)
        wait_until_generating(engine)
        new_version = old_version + 1
        perturb_and_send(engine, model, new_version, seed=5)
        groups = [ray.get(ref) for ref in stream]
    finally:
        ray.get(engine.use_run_settings.remote(started), timeout=60)

    assert len(requests) * num_samples > max_num_seqs
    assert sorted(g.prompt_id for g in groups) == sorted(r.prompt_id for r in requests)
    by_version = {old_version: old_model, new_version: model}
    for group in groups:
        for sample in group.samples:
            assert sample.finish_reason == "length" and sample.num_response_tokens == 48
            (version,) = set(sample.token_policy_versions)  # never two versions in one response
            expected = reference_logprobs(by_version[version], sample.prompt_token_ids, sample.response_token_ids, 1.0)
            assert (torch.tensor(sample.response_logprobs).double() - expected).abs().max() < 1e-4, (
                sample.prompt_id, sample.sample_index, version)
    versions = {s.token_policy_versions[0] for g in groups for s in g.samples}
    assert versions == {old_version, new_version}, versions  # the update came mid-generation
    assert ray.get(engine.health.remote())["num_version_disagreements"] == disagreements_before


def test_abort_named_group_keeps_partial_tokens(engine, reference):
    import ray

    _, tokenizer = reference
    requests = prompts(tokenizer, ["stop me", "let me finish"])
    sampling = SamplingConfig(num_samples_per_prompt=2, max_response_tokens=LONG_TOKENS, ignore_eos=True)
    stream = engine.generate.remote(requests, sampling)
    wait_until_generating(engine)
    assert ray.get(engine.abort.remote(["p0#0"])) == 2
    groups = {g.prompt_id: g for g in (ray.get(ref) for ref in stream)}
    assert all(s.finish_reason == "abort" and s.num_response_tokens < LONG_TOKENS for s in groups["p0"].samples)
    assert all(len(s.token_policy_versions) == s.num_response_tokens for s in groups["p0"].samples)
    assert all(s.finish_reason == "length" and s.num_response_tokens == LONG_TOKENS for s in groups["p1"].samples)


def test_sleep_blocks_generation_until_wake_up(engine, reference):
    import ray

    model, tokenizer = reference
    ray.get(engine.sleep.remote())
    assert ray.get(engine.health.remote())["asleep"] is True
    with pytest.raises(Exception, match="asleep"):
        collect(engine, prompts(tokenizer, ["zzz"]))
    version = _version(engine) + 1
    perturb_and_send(engine, model, version, seed=4)  # weights may arrive while asleep
    ray.get(engine.wake_up.remote())
    assert ray.get(engine.health.remote())["asleep"] is False
    groups = collect(engine, prompts(tokenizer, ["awake"]), SamplingConfig(num_samples_per_prompt=1,
                                                                         max_response_tokens=4, ignore_eos=True))
    assert groups[0].samples[0].token_policy_versions == [version] * 4


def test_a_sleeping_cpu_engine_s_vllm_processes_are_stopped_until_its_next_call(engine, reference):
    """On CPU, sleep stops vLLM's engine core and workers (they would keep polling the trainer's
    cores); any call into vLLM continues them first, and a wake-up leaves them running."""
    import psutil
    import ray

    from rlactors.rollout.engine_core import vllm_processes

    model, tokenizer = reference
    processes = vllm_processes(ray.get(engine.health.remote())["pid"])
    assert len(processes) >= 2, processes  # the engine core and its worker

    def states() -> set[str]:
        return {process.status() for process in processes}

    ray.get(engine.sleep.remote())
    assert states() == {psutil.STATUS_STOPPED}
    version = _version(engine) + 1
    perturb_and_send(engine, model, version, seed=5)  # a weight sync while asleep goes through
    assert psutil.STATUS_STOPPED not in states()
    ray.get(engine.sleep.remote())  # still asleep (the KV cache): nothing to do, nothing stopped again
    ray.get(engine.wake_up.remote())
    assert psutil.STATUS_STOPPED not in states()
    groups = collect(engine, prompts(tokenizer, ["awake"]), SamplingConfig(num_samples_per_prompt=1,
                                                                         max_response_tokens=4, ignore_eos=True))
    assert groups[0].samples[0].token_policy_versions == [version] * 4


@pytest.mark.parametrize("sleep_level", [1, 2])
def test_sleeping_engine_wakes_weights_then_loads_then_wakes_the_kv_cache(engine, reference, sleep_level):
    """The colocated order, as the phase log records it; on CPU vLLM frees nothing, but the tags it
    keeps asleep (and so whether it schedules) follow the same calls as on a GPU."""
    import ray

    model, tokenizer = reference
    # The fixture's engine, at this test's level (a config field the actor reads at each sleep).
    ray.get(engine.__ray_call__.remote(
        lambda actor: setattr(actor, "config", actor.config.model_copy(update={"sleep_level": sleep_level}))))
    try:
        num_before = len(ray.get(engine.phase_log.remote()))
        ray.get(engine.sleep.remote())
        assert ray.get(engine.health.remote())["sleeping_tags"] == ["weights", "kv_cache"]
        if sleep_level == 2:  # the weights were discarded: nothing may wake them but a load
            with pytest.raises(Exception, match="discarded the weights"):
                ray.get(engine.wake_up.remote())
        with pytest.raises(Exception, match="allowed values"):
            ray.get(engine.wake_up.remote(["weights", "activations"]))
        version = _version(engine) + 1
        perturb_and_send(engine, model, version, seed=10 + sleep_level)
        health = ray.get(engine.health.remote())
        assert health["sleeping_tags"] == ["kv_cache"] and health["asleep"] is True
        with pytest.raises(Exception, match="asleep"):
            collect(engine, prompts(tokenizer, ["zzz"]))
        assert ray.get(engine.wake_up.remote())["tags"] == ["kv_cache"]
        assert ray.get(engine.wake_up.remote()) is None  # nothing left asleep
        groups = collect(engine, prompts(tokenizer, ["awake"]), SamplingConfig(num_samples_per_prompt=1,
                                                                             max_response_tokens=4, ignore_eos=True))
        assert groups[0].samples[0].token_policy_versions == [version] * 4
        log = ray.get(engine.phase_log.remote())[num_before:]
        assert [(e["phase"], e.get("tags"), e.get("level")) for e in log] == [
            ("sleep", None, sleep_level), ("wake_up", ["weights"], None), ("load_weights", None, None),
            ("wake_up", ["kv_cache"], None), ("generate", None, None)]
        assert [e["index"] for e in log] == list(range(log[0]["index"], log[0]["index"] + 5))
        assert all(e["memory"]["host_rss_bytes"] > 0 for e in log)  # the vLLM worker process's
        assert log[2]["policy_version"] == version and log[2]["weight_bytes"] > 0
    finally:
        ray.get(engine.__ray_call__.remote(
            lambda actor: setattr(actor, "config", actor.config.model_copy(update={"sleep_level": 1}))))


def test_state_dict_round_trip(engine, reference):
    import ray

    _, tokenizer = reference
    state = ray.get(engine.state_dict.remote())
    assert state == {"policy_version": _version(engine)}
    ray.get(engine.load_state_dict.remote({"policy_version": state["policy_version"] + 10}))
    assert ray.get(engine.state_dict.remote()) == {"policy_version": state["policy_version"] + 10}
    groups = collect(engine, prompts(tokenizer, ["x"]), SamplingConfig(num_samples_per_prompt=1,
                                                                        max_response_tokens=3, ignore_eos=True))
    assert groups[0].samples[0].token_policy_versions == [state["policy_version"] + 10] * 3
    with pytest.raises(Exception, match="older"):
        ray.get(engine.start_weight_update.remote(state["policy_version"]))


def test_another_run_s_sampling_is_taken_and_other_engine_settings_are_refused_naming_them(engine, reference):
    """What a run that takes kept engines hands them (`RolloutEngine.new_run`, and `ready` for a
    replica Ray restarted): the per-run rollout settings; a started engine cannot change the rest."""
    import ray

    _, tokenizer = reference
    started = ray.get(engine.__ray_call__.remote(lambda self: self.config), timeout=60)
    other = started.model_copy(update={"max_model_len": started.max_model_len + 1, "enforce_eager": False})
    with pytest.raises(ray.exceptions.RayTaskError, match=r"other rollout\.enforce_eager, rollout\.max_model_len$"):
        ray.get(engine.use_run_settings.remote(other), timeout=60)
    short = SamplingConfig(num_samples_per_prompt=3, max_response_tokens=2, ignore_eos=True)
    try:
        ray.get(engine.ready.remote(started.model_copy(update={"sampling": short, "on_abort": "requeue"})), timeout=60)
        group, = collect(engine, prompts(tokenizer, ["x"]))  # no sampling given: the run's
        assert [s.num_response_tokens for s in group.samples] == [2, 2, 2]
    finally:
        ray.get(engine.use_run_settings.remote(started), timeout=60)
    assert ray.get(engine.__ray_call__.remote(lambda self: self.config), timeout=60) == started


def test_cpu_front_end_and_engine_core_stay_off_the_model_cores(engine):
    import os

    import psutil
    import ray

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to keep apart")
    health = ray.get(engine.health.remote())
    front_end_cores = set(health["front_end_cpu_cores"])
    actor = psutil.Process(health["pid"])
    engine_cores = [child for child in actor.children() if child.name().startswith("VLLM::")]
    workers = [worker for core in engine_cores for worker in core.children(recursive=True)]
    assert front_end_cores and engine_cores and workers
    for process in [actor, *engine_cores]:  # every thread, Ray's and vLLM's included
        for thread in process.threads():
            try:
                affinity = os.sched_getaffinity(thread.id)
            except ProcessLookupError:  # the thread ended after the listing
                continue
            assert affinity == front_end_cores, (process.name(), thread.id)
    for worker in workers:  # the model's threads, bound by vLLM to the cores left to them
        assert set(worker.cpu_affinity()).isdisjoint(front_end_cores), worker.name()


def _version(engine) -> int:
    import ray

    return ray.get(engine.health.remote())["policy_version"]
