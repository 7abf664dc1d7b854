"""Rollout throughput: the RolloutEngine actor vs raw `vllm.LLM.generate`, and weight-sync speed.

Both sides run the same model with the same engine arguments (`engine_kwargs`) on identical
prompts and sampling settings: by default 32 prompts x n=8 x 64 new tokens (ignore_eos, so every
sample has exactly 64), temperature 1, the sampled token's logprob returned. Raw vLLM gets `n=8`
in one call; the actor gets the batch through its streaming `generate` (8 requests per prompt)
and the driver collects every Group. Both engines stay up and run alternately, each warmed up
once and then timed `--repeats` times: this machine's speed drifts by up to 20% over minutes, and
two phases run one after the other would measure the drift. While one engine is timed, the other's
vLLM processes are stopped (SIGSTOP): an idle engine's worker still wakes its 13 gloo threads
~100 times a second each, on the model's core. Measured without stopping, the idle raw engine
(nice 0) took 0.13-0.20 s of CPU from each ~3.5 s actor run (Ray's workers run at nice 15), the
idle actor 0.05-0.06 s from each raw run.

Reported: the median run of each side (`tokens_per_s`, `raw_tokens_per_s`, `ratio`), and, for
comparison, the best run of each (`ratio_best`). Medians, because the two sides' spreads differ:
raw vLLM's front end and engine core float over the cores, so its runs vary more (3,900-5,800
tokens/s in one run of this benchmark) and its best run is a lucky placement, not its speed.

Weight sync: the model's weights (a tied lm_head once, as a trainer sends them) go from this
process to the actor over shared memory (`shm`, buckets of `rollout.weight_bucket_bytes`) through a
`WeightSender`, timed by the sender (`weight_sync_s`: start_weight_update to finish_weight_update,
every bucket copied into a segment and loaded by vLLM's layerwise reload), best of `--repeats`
after one warm-up, with the raw engine stopped; `memcpy_ratio` is weight_sync_s over the time of one
plain in-process copy of the same bytes (benchmarks/weight_sync.py measures syncs from a trainer rank).

    .venv/bin/python benchmarks/rollout_throughput.py [--preset small] [--num-prompts 32]

Prints one final JSON line with tokens_per_s, raw_tokens_per_s, ratio, weight_sync_s,
weight_bytes and memcpy_ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

import psutil
import ray

from rlactors.config import RolloutConfig, SamplingConfig
from rlactors.models import build_tiny_model
from rlactors.rollout.engine_core import vllm_processes
from rlactors.runtime.device import default_dtype, detect_platform, engine_env
from rlactors.types import PromptRequest


def make_prompts(num_prompts: int) -> list[list[int]]:
    """Deterministic prompts of 12-27 tokens drawn from the byte tokens (ids 4-259)."""
    return [[4 + (7 * i + 13 * j) % 256 for j in range(12 + i % 16)] for i in range(num_prompts)]


def start_raw_engine(model_path: str, config: RolloutConfig, sampling: SamplingConfig):
    """vllm.LLM in this process, on the same engine arguments as the actor; returns a timed call."""
    platform = detect_platform()
    os.environ.update(engine_env(platform, config.use_aiter, config.cpu_kv_cache_bytes))
    from vllm import LLM, SamplingParams

    from rlactors.rollout.vllm_args import engine_kwargs

    llm = LLM(**engine_kwargs(model_path, config, platform, default_dtype(platform), seed=0))
    params = SamplingParams(n=sampling.num_samples_per_prompt, temperature=sampling.temperature,
                            max_tokens=sampling.max_response_tokens, ignore_eos=True, logprobs=0)

    def generate(prompts) -> tuple[int, float]:
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(c.token_ids) for o in outputs for c in o.outputs), elapsed

    return llm, generate


def start_actor(model_path: str, config: RolloutConfig, sampling: SamplingConfig):
    """The RolloutEngine actor; returns it and a timed call collecting every streamed Group."""
    from rlactors.rollout.engine import create_engine

    ray.init(address="local", num_cpus=int(config.num_cpus_per_engine), include_dashboard=False, log_to_driver=False)
    engine = create_engine(model_path, config)
    ray.get(engine.ready.remote())

    def generate(prompts) -> tuple[int, float]:
        requests = [PromptRequest(f"p{i}", p) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        groups = [ray.get(ref) for ref in engine.generate.remote(requests, sampling)]
        elapsed = time.perf_counter() - start
        return sum(s.num_response_tokens for g in groups for s in g.samples), elapsed

    return engine, generate


@contextlib.contextmanager
def stopped(processes: list[psutil.Process]):
    """SIGSTOP `processes` for the duration, so an idle engine's threads cannot preempt the timed one."""
    for process in processes:
        process.suspend()
    try:
        yield
    finally:
        for process in processes:
            process.resume()


def weight_sync(engine, model_path: str, repeats: int, bucket_bytes: int) -> dict:
    """Best of `repeats` full-model syncs over shm (after one warm-up) and one plain copy of the bytes."""
    import torch

    from rlactors.models import load_model
    from rlactors.weight_sync.choice import WeightSyncSettings
    from rlactors.weight_sync.sender import WeightSender

    model = load_model(model_path)
    tied = model.config.tie_word_embeddings
    state = [(name, t) for name, t in model.state_dict().items() if not (tied and name == "lm_head.weight")]
    sender = WeightSender(rank=0)
    settings = WeightSyncSettings("shm", bucket_bytes, None, call_timeout_s=RolloutConfig().call_timeout_s)
    syncs = [sender.send(lambda: iter(state), {0: (engine, 0)}, version, settings) for version in range(1, repeats + 2)]
    sender.shutdown()
    failed = [sync["failed"] for sync in syncs if sync["failed"]]
    assert not failed, f"weight syncs failed: {failed}"
    best_sync = min(syncs[1:], key=lambda s: s["weight_sync_s"])  # the first is a warm-up
    targets = [torch.empty_like(t) for _, t in state]
    copy_times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for target, (_, tensor) in zip(targets, state, strict=True):
            target.copy_(tensor)
        copy_times.append(time.perf_counter() - start)
    return best_sync | {"memcpy_s": min(copy_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--num-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9, help="timed runs of each, alternating")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs given to the engine actor")
    args = parser.parse_args()

    model_path = str(build_tiny_model(tempfile.mkdtemp() + "/model", preset=args.preset, seed=0))
    config = RolloutConfig(num_cpus_per_engine=args.num_cpus, max_model_len=256)
    sampling = SamplingConfig(num_samples_per_prompt=args.num_samples, temperature=1.0,
                              max_response_tokens=args.num_tokens, ignore_eos=True)
    prompts = make_prompts(args.num_prompts)

    llm, raw_generate = start_raw_engine(model_path, config, sampling)
    engine, actor_generate = start_actor(model_path, config, sampling)
    raw_processes = vllm_processes(os.getpid())
    actor_processes = vllm_processes(ray.get(engine.health.remote())["pid"])
    assert raw_processes and actor_processes, "vLLM's engine processes were not found"
    raw, actor = [], []
    for _ in range(args.repeats + 1):  # the first run of each is a warm-up
        with stopped(actor_processes):
            raw.append(raw_generate(prompts))
        with stopped(raw_processes):
            actor.append(actor_generate(prompts))
    raw, actor = raw[1:], actor[1:]
    expected_tokens = args.num_prompts * args.num_samples * args.num_tokens
    assert all(num_tokens == expected_tokens for num_tokens, _ in raw + actor), (raw, actor, expected_tokens)
    tokens_per_s = expected_tokens / statistics.median(elapsed for _, elapsed in actor)
    raw_tokens_per_s = expected_tokens / statistics.median(elapsed for _, elapsed in raw)
    ratio_best = min(elapsed for _, elapsed in raw) / min(elapsed for _, elapsed in actor)
    with stopped(raw_processes):
        sync = weight_sync(engine, model_path, args.repeats, config.weight_bucket_bytes)
    llm.llm_engine.engine_core.shutdown()
    print("tokens/s per run, raw vLLM:", [round(expected_tokens / elapsed) for _, elapsed in raw],
          "actor:", [round(expected_tokens / elapsed) for _, elapsed in actor])
    print(f"median: raw vLLM {raw_tokens_per_s:.0f} tokens/s, actor {tokens_per_s:.0f} tokens/s; "
          f"weight sync: {sync['weight_bytes']} bytes in {sync['weight_sync_s']:.4f} s "
          f"({sync['bytes_per_s'] / 1e6:.0f} MB/s), plain copy {sync['memcpy_s']:.4f} s")
    print(json.dumps({
        "tokens_per_s": round(tokens_per_s, 1),
        "raw_tokens_per_s": round(raw_tokens_per_s, 1),
        "ratio": round(tokens_per_s / raw_tokens_per_s, 4),
        "ratio_best": round(ratio_best, 4),
        "weight_sync_s": round(sync["weight_sync_s"], 5),
        "weight_bytes": sync["weight_bytes"],
        "bytes_per_s": round(sync["bytes_per_s"], 1),
        "memcpy_ratio": round(sync["weight_sync_s"] / sync["memcpy_s"], 2),
        "num_tokens": expected_tokens,
        "preset": args.preset,
    }))
    ray.shutdown()


if __name__ == "__main__":
    main()
