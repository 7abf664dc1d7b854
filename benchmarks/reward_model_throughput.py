"""Reward-model throughput: the classifier scorer against a plain transformers forward, and the
share of a colocated GRPO step a reward model adds.

- sequences: `--num-groups` groups of 8 responses to arithmetic prompts, each response up to
  `--response-tokens` characters (the `small` preset as a classifier, character tokenizer: one token
  per character), the same texts for both sides;
- plain: `load_classifier` and `score_sequences` in this process, `--batch-size` sequences per
  forward, torch on this process's threads;
- scorer: one `RewardModelScorer` replica (`rlactors.reward.model_scorer`) with as many Ray CPUs as
  this process has torch threads (Ray gives an actor that many OpenMP threads), fed the groups as
  object refs in calls of 16 groups (the pool's `reward.max_groups_per_call`), its results left in
  the object store; timed from the first call to the last result ready.
  Each side runs once to warm up, then `--repeats` times, alternating; the medians count.
- step share (unless `--no-step`): two colocated GRPO runs of the `small` preset (16 prompts x 8
  samples of up to 16 tokens, the arithmetic rule), one with the same reward model beside the rule;
  the median step time over the steps after two of warm-up. `step_share` = 1 - without / with.

`ratio` = scorer samples/s / plain samples/s. Target: >= 0.9.

    .venv/bin/python benchmarks/reward_model_throughput.py [--num-groups 32] [--no-step]

Prints a summary, then one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from rlactors.config import RewardModelConfig, load_config
from rlactors.metrics import read_metrics
from rlactors.models import build_tiny_model
from rlactors.reward.model_scorer import RewardModelScorer, load_classifier, score_sequences
from rlactors.types import Group, PromptRequest, Sample

NUM_SAMPLES = 8
GROUPS_PER_CALL = 16
NUM_WARMUP_STEPS = 2


def make_groups(tokenizer, num_groups: int, response_tokens: int, seed: int = 0) -> list[Group]:
    rng = random.Random(seed)
    words = ["the", "answer", "is", "so", "then", "plus", "minus", "we", "get", "="]
    groups = []
    for g in range(num_groups):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        ids = tokenizer(f"{a}+{b}=")["input_ids"]
        request = PromptRequest(f"p{g}", ids, data_source="synthetic/arithmetic", ground_truth=str(a + b))
        samples = []
        for i in range(NUM_SAMPLES):
            text = ""
            while len(text) < rng.randint(response_tokens // 2, response_tokens):
                text += rng.choice(words + [str(rng.randint(0, 200))]) + " "
            samples.append(Sample(f"p{g}", i, ids, response_token_ids=[1] * len(text), text=text[:response_tokens]))
        groups.append(Group(request, samples))
    return groups


def time_plain(model, tokenizer, texts: list[str], batch_size: int) -> float:
    start = time.perf_counter()
    results, _ = score_sequences(model, tokenizer, texts, batch_size, max_tokens=4096)
    assert all(error is None for _, error in results)
    return time.perf_counter() - start


def time_scorer(replica, group_refs: list) -> float:
    start = time.perf_counter()
    refs = []
    for first in range(0, len(group_refs), GROUPS_PER_CALL):
        chunk = group_refs[first:first + GROUPS_PER_CALL]
        refs += replica.score_groups.options(num_returns=len(chunk)).remote(*chunk)
    ray.wait(refs, num_returns=len(refs), timeout=600, fetch_local=False)
    elapsed = time.perf_counter() - start
    assert ray.get(refs[-1], timeout=60).samples[0].score_error is None
    return elapsed


def throughput(model_dir: Path, args) -> dict:
    config = RewardModelConfig(name="rm", path=str(model_dir), batch_size=args.batch_size)
    model, tokenizer = load_classifier(config)
    groups = make_groups(tokenizer, args.num_groups, args.response_tokens)
    prompt_texts = {g.prompt_id: tokenizer.decode(g.request.prompt_token_ids) for g in groups}
    texts = [prompt_texts[g.prompt_id] + s.text for g in groups for s in g.samples]
    threads = torch.get_num_threads()
    ray.init(num_cpus=max(threads, 2), include_dashboard=False, log_to_driver=False)
    try:
        replica = RewardModelScorer.options(num_cpus=threads).remote(config, str(model_dir))
        ray.get(replica.ready.remote(), timeout=300)
        group_refs = [ray.put(g) for g in groups]
        time_plain(model, tokenizer, texts[:args.batch_size], args.batch_size)  # warm-up
        time_scorer(replica, group_refs[:GROUPS_PER_CALL])
        plain_s, scorer_s = [], []
        for _ in range(args.repeats):
            plain_s.append(time_plain(model, tokenizer, texts, args.batch_size))
            scorer_s.append(time_scorer(replica, group_refs))
    finally:
        ray.shutdown()
    plain, scorer = statistics.median(plain_s), statistics.median(scorer_s)
    return {"num_samples": len(texts), "torch_threads": threads, "plain_samples_per_s": round(len(texts) / plain, 1),
            "scorer_samples_per_s": round(len(texts) / scorer, 1), "ratio": round(plain / scorer, 3),
            "plain_s": [round(s, 3) for s in plain_s], "scorer_s": [round(s, 3) for s in scorer_s]}


def median_step_s(policy_dir: Path, output_dir: Path, num_steps: int, *extra: str) -> float:
    from rlactors.pipelines import run_pipeline

    config = load_config(None, [
        f"model.path={policy_dir}", "model.preset=small", "data.task=arithmetic", "data.num_train_rows=2000",
        "data.num_val_rows=16", "rollout.max_model_len=80", "rollout.sampling.num_samples_per_prompt=8",
        "rollout.sampling.max_response_tokens=16", "trainer.optim.lr=1e-4", "algorithm.use_kl_loss=false",
        f"pipeline.num_steps={NUM_WARMUP_STEPS + num_steps}", "pipeline.batch_size_prompts=16",
        "pipeline.val_every_steps=0", f"pipeline.output_dir={output_dir}", "pipeline.resume=never",
        "pipeline.mode=colocated", *extra])
    run_pipeline(config)
    history = [h for h in read_metrics(output_dir / "metrics.jsonl") if h["step"] > NUM_WARMUP_STEPS]
    return statistics.median(h["timing_s/step"] for h in history)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-groups", type=int, default=32)
    parser.add_argument("--response-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--no-step", action="store_true", help="only the throughput comparison")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        model_dir = build_tiny_model(folder / "reward_model", preset="small", seed=1, head="classifier")
        result = throughput(model_dir, args)
        print(f"plain {result['plain_samples_per_s']} samples/s, scorer {result['scorer_samples_per_s']} samples/s "
              f"({result['num_samples']} sequences, {result['torch_threads']} threads): ratio {result['ratio']}")
        if not args.no_step:
            policy_dir = build_tiny_model(folder / "policy", preset="small", seed=0)
            without = median_step_s(policy_dir, folder / "without", args.num_steps)
            with_model = median_step_s(policy_dir, folder / "with", args.num_steps,
                                       f"reward.models=[{{name: rm, path: {model_dir}, batch_size: {args.batch_size}}}]")
            result |= {"step_s_without": round(without, 3), "step_s_with": round(with_model, 3),
                       "step_share": round(1 - without / with_model, 3)}
            print(f"colocated step: {without:.3f} s without the reward model, {with_model:.3f} s with it "
                  f"(share {result['step_share']})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
