"""Multi-turn overlap: does a slow tool stall the engine, or do other samples' turns fill the wait?

One RolloutEngine (vLLM on CPU, the `small` preset) runs the same episodes twice per round: with a
tool that answers at once and with one that sleeps `--tool-delay-s` (100 ms) per call. Each
episode is 2 to 4 turns (drawn per episode, as real episodes vary) of at most `--turn-tokens`
tokens (EOS ignored), with a short observation between turns. Groups are fed as a rollout
producer feeds them: `--num-in-flight` groups at a time, the next sent as soon as one finishes,
so episodes start and end at different moments and a waiting sample's slot goes to another's turn.

Measured per run: model tokens generated (observation tokens excluded) over the wall time from the
first request to the last group. Rounds alternate the two tools so this machine's drift hits both
alike; the medians are compared. `overlap_ratio` = slow-tool tokens/s / instant-tool tokens/s
(the target is >= 0.8). `no_overlap_ratio` is what it would be if no turn ran while a tool waited:
the instant run's time over that time plus one delay per wave of turns (turns / episodes in flight).

    .venv/bin/python benchmarks/multiturn_overlap.py [--rounds 3] [--num-groups 96]

Prints a line per run, then one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import ray

from rlactors.config import EnvironmentConfig, RolloutConfig, SamplingConfig
from rlactors.models import build_tiny_model, load_tokenizer
from rlactors.types import PromptRequest

TOOL = Path(__file__).with_name("sleeping_tool.py")


def run(engine, tokenizer, num_groups: int, num_in_flight: int, delay_s: float, sampling: SamplingConfig,
        seed: int) -> dict:
    requests = [PromptRequest(f"p{i}", tokenizer.encode(f"{i}*{i + 7}="), group_id=f"p{i}#{seed}.{delay_s}",
                              extra_info={"delay_s": delay_s, "max_turns": 4})
                for i in range(num_groups)]
    pending = list(requests)
    in_flight, num_model_tokens, num_turns = [], 0, 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < num_in_flight:
            in_flight.append(engine.generate.remote([pending.pop(0)], sampling))
        done, _ = ray.wait([stream.completed() for stream in in_flight], num_returns=1, timeout=600)
        if not done:
            raise TimeoutError(f"no group finished within 600 s ({len(in_flight)} in flight)")
        for stream in [s for s in in_flight if s.completed() in done]:
            in_flight.remove(stream)
            for ref in stream:
                for sample in ray.get(ref).samples:
                    if sample.error or sample.environment_error:
                        raise RuntimeError(sample.error or sample.environment_error)
                    num_model_tokens += sample.num_model_tokens
                    num_turns += sample.num_turns
    elapsed_s = time.perf_counter() - start
    return {"delay_s": delay_s, "elapsed_s": elapsed_s, "num_model_tokens": num_model_tokens,
            "num_turns": num_turns, "tokens_per_s": num_model_tokens / elapsed_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-groups", type=int, default=96)
    parser.add_argument("--num-in-flight", type=int, default=32, help="groups generating at once")
    parser.add_argument("--num-samples", type=int, default=8, help="episodes per group")
    parser.add_argument("--turn-tokens", type=int, default=4, help="short turns: the tool's wait weighs the most")
    parser.add_argument("--tool-delay-s", type=float, default=0.1)
    args = parser.parse_args()

    model_path = build_tiny_model(Path(tempfile.mkdtemp(prefix="rlactors-overlap-")) / "small", preset="small")
    tokenizer = load_tokenizer(model_path)
    environment = EnvironmentConfig(name=f"{TOOL}:SleepingTool", max_turns=4, max_turn_tokens=args.turn_tokens)
    config = RolloutConfig(max_model_len=256, environment=environment)
    sampling = SamplingConfig(num_samples_per_prompt=args.num_samples, max_response_tokens=200, ignore_eos=True,
                              seed=0)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    from rlactors.rollout.engine import create_engine

    engine = create_engine(str(model_path), config)
    ray.get(engine.ready.remote())
    run(engine, tokenizer, args.num_in_flight, args.num_in_flight, 0.0, sampling, seed=-1)  # warm-up
    results = {0.0: [], args.tool_delay_s: []}
    for round_index in range(args.rounds):
        order = [0.0, args.tool_delay_s] if round_index % 2 == 0 else [args.tool_delay_s, 0.0]
        for delay_s in order:
            result = run(engine, tokenizer, args.num_groups, args.num_in_flight, delay_s, sampling, round_index)
            results[delay_s].append(result)
            print(f"round {round_index} tool delay {delay_s:.3f} s: {result['num_model_tokens']} model tokens, "
                  f"{result['num_turns']} turns in {result['elapsed_s']:.2f} s = {result['tokens_per_s']:.0f} tokens/s")
    instant_runs = results[0.0]
    instant_s = statistics.median(r["elapsed_s"] for r in instant_runs)
    num_turn_waves = statistics.median(r["num_turns"] for r in instant_runs) / (args.num_in_flight * args.num_samples)
    no_overlap = instant_s / (instant_s + num_turn_waves * args.tool_delay_s)
    instant = statistics.median(r["tokens_per_s"] for r in instant_runs)
    slow = statistics.median(r["tokens_per_s"] for r in results[args.tool_delay_s])
    ray.shutdown()
    print(json.dumps({"overlap_ratio": round(slow / instant, 4), "instant_tool_tokens_per_s": round(instant, 1),
                      "slow_tool_tokens_per_s": round(slow, 1),
                      "no_overlap_ratio": round(no_overlap, 4), "tool_delay_s": args.tool_delay_s,
                      "num_groups": args.num_groups, "num_in_flight_groups": args.num_in_flight,
                      "num_samples_per_group": args.num_samples, "turn_tokens": args.turn_tokens,
                      "rounds": args.rounds}))


if __name__ == "__main__":
    main()
