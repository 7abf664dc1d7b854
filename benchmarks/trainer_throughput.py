"""Trainer throughput: `TrainerGroup.update_policy` vs a plain single-process torch training loop.

Both train the same model on the same batch with the same maths: micro-batches of sequences sorted
by length under the same token budget, the PPO clipped loss (token-mean over the whole batch), the
entropy metric, gradient clipping and one AdamW step. The plain loop has no Ray, no FSDP and no
planning, so the ratio measures what the trainer's machinery costs. Runs alternate (baseline,
trainer, baseline, ...) so background load hits both alike; throughputs are each side's median,
the ratio is the median of the per-pair ratios.

    .venv/bin/python benchmarks/trainer_throughput.py [--preset small] [--num-sequences 256]

Prints one final JSON line with tokens_per_s, baseline_tokens_per_s, ratio and peak_rss_bytes
(the trainer rank's peak resident memory; the baseline's is baseline_peak_rss_bytes). The same
plain loop also runs inside a Ray actor process (ratio_vs_baseline_in_actor): on a loaded machine
a Ray worker process can run the very same loop slower than the driver, and this separates that
from the trainer's own cost.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time

import ray
import torch

from rlactors.algorithms import (
    aggregate_loss,
    chunked_entropy_from_logits,
    logprobs_from_logits,
    ppo_policy_loss,
)
from rlactors.config import AlgorithmConfig, OptimConfig, TrainerConfig
from rlactors.models import build_tiny_model, load_model
from rlactors.trainer.batch import TrainBatch, pad_right
from rlactors.trainer.group import TrainerGroup


def make_batch(num_sequences: int, seed: int) -> TrainBatch:
    """Prompts of 15-24 and responses of 40-59 random tokens (~70 per sequence), 8 per group."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(low, high):
        return torch.randint(4, 250, (int(torch.randint(low, high, (1,), generator=generator)),),
                             generator=generator).tolist()

    batch = TrainBatch([tokens(15, 25) for _ in range(num_sequences)], [tokens(40, 60) for _ in range(num_sequences)],
                       [i // 8 for i in range(num_sequences)])
    batch.set_field("advantages", [torch.randn(len(r), generator=generator) for r in batch.response_token_ids])
    return batch


def plain_step(model, optimizer, batch: TrainBatch, max_tokens: int, algorithm: AlgorithmConfig) -> None:
    """One update as a plain single-process loop would write it."""
    order = sorted(range(len(batch)), key=lambda i: -batch.sequence_lengths[i])
    micro_batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * batch.sequence_lengths[current[0]] > max_tokens:
            micro_batches.append(current)
            current = []
        current.append(i)
    micro_batches.append(current)
    num_tokens = sum(batch.response_lengths)
    for indices in micro_batches:
        input_ids = pad_right([torch.tensor(batch.prompt_token_ids[i] + batch.response_token_ids[i]) for i in indices])
        prompt_lengths = torch.tensor([len(batch.prompt_token_ids[i]) for i in indices]).unsqueeze(1)
        width = max(batch.response_lengths[i] for i in indices)
        positions = (prompt_lengths - 1 + torch.arange(width)).clamp(max=input_ids.shape[1] - 1)
        labels = pad_right([torch.tensor(batch.response_token_ids[i]) for i in indices], width)
        mask = torch.arange(width) < torch.tensor([batch.response_lengths[i] for i in indices]).unsqueeze(1)
        old = pad_right([batch.token_field("old_logprobs")[i] for i in indices], width)
        advantages = pad_right([batch.token_field("advantages")[i] for i in indices], width)
        logits = model(input_ids=input_ids).logits
        logits = torch.gather(logits, 1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
        logp = logprobs_from_logits(logits, labels)
        per_token, _ = ppo_policy_loss(logp, old, advantages, mask, algorithm.clip_ratio_low,
                                       algorithm.clip_ratio_high, algorithm.clip_ratio_c)
        aggregate_loss(per_token, mask, "token-mean", global_num_tokens=num_tokens).backward()
        with torch.no_grad():
            chunked_entropy_from_logits(logits)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class PlainLoop:
    """The plain loop in a Ray actor process: same process kind as a trainer rank, to tell the
    trainer's own cost apart from what running in a Ray worker process costs on a busy machine."""

    def __init__(self, model_dir: str, num_threads: int, lr: float):
        torch.set_num_threads(num_threads)
        self.model = load_model(model_dir)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self, batch: TrainBatch, max_tokens: int, algorithm: AlgorithmConfig) -> float:
        start = time.perf_counter()
        plain_step(self.model, self.optimizer, batch, max_tokens, algorithm)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--num-sequences", type=int, default=256)
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=8192)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="Timed updates per side, after one warm-up each.")
    args = parser.parse_args()

    torch.set_num_threads(args.num_threads)
    model_dir = build_tiny_model(tempfile.mkdtemp(prefix="trainer-bench-") + "/model", args.preset, seed=0)
    batch = make_batch(args.num_sequences, seed=0)
    num_tokens = sum(batch.sequence_lengths)
    algorithm = AlgorithmConfig()
    optim = OptimConfig(lr=1e-5)

    # Room for the trainer rank and the in-actor plain loop (they never run at the same time).
    ray.init(address="local", num_cpus=2 * args.num_threads, include_dashboard=False, log_to_driver=False)
    trainer = TrainerConfig(num_workers=1, num_cpus_per_worker=args.num_threads, optim=optim,
                            max_tokens_per_micro_batch=args.max_tokens_per_micro_batch)
    group = TrainerGroup("actor", model_dir, trainer, algorithm)
    batch.set_field("old_logprobs", group.compute_logprobs(batch)["logprobs"])

    model = load_model(model_dir)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr)
    plain_actor = ray.remote(PlainLoop).options(num_cpus=args.num_threads).remote(
        str(model_dir), args.num_threads, optim.lr)
    batch_ref = ray.put(batch)
    baseline_s, trainer_s, actor_baseline_s = [], [], []
    for repeat in range(args.repeats + 1):  # repeat 0 warms all up and is not counted
        start = time.perf_counter()
        plain_step(model, optimizer, batch, args.max_tokens_per_micro_batch, algorithm)
        elapsed_baseline = time.perf_counter() - start
        start = time.perf_counter()
        metrics = group.update_policy(batch)
        elapsed_trainer = time.perf_counter() - start
        elapsed_actor = ray.get(plain_actor.step.remote(batch_ref, args.max_tokens_per_micro_batch, algorithm))
        if repeat:
            baseline_s.append(elapsed_baseline)
            trainer_s.append(elapsed_trainer)
            actor_baseline_s.append(elapsed_actor)
    assert metrics["actor/num_skipped_steps"] == 0, metrics

    worker = group.workers[0]
    peak_rss_bytes = ray.get(worker.__ray_call__.remote(
        lambda self: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    group.shutdown()
    ray.shutdown()
    tokens_per_s = num_tokens / statistics.median(trainer_s)
    baseline_tokens_per_s = num_tokens / statistics.median(baseline_s)
    print(json.dumps({
        "preset": args.preset, "num_sequences": args.num_sequences, "num_tokens_per_update": num_tokens,
        "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch, "num_threads": args.num_threads,
        "trainer_update_s": [round(s, 3) for s in trainer_s], "baseline_update_s": [round(s, 3) for s in baseline_s],
        "tokens_per_s": round(tokens_per_s, 1), "baseline_tokens_per_s": round(baseline_tokens_per_s, 1),
        # Median over the interleaved (baseline, trainer) pairs: a pair shares the machine's load.
        "ratio": round(statistics.median(b / t for b, t in zip(baseline_s, trainer_s, strict=True)), 3),
        "peak_rss_bytes": peak_rss_bytes,
        "baseline_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "baseline_in_actor_update_s": [round(s, 3) for s in actor_baseline_s],
        "ratio_vs_baseline_in_actor": round(statistics.median(
            b / t for b, t in zip(actor_baseline_s, trainer_s, strict=True)), 3),
    }))


if __name__ == "__main__":
    main()
