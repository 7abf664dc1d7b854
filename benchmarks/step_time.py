"""Step time: where a colocated GRPO step goes, against the two things a step cannot avoid.

One GRPO config (the `small` preset, the synthetic arithmetic task, 16 prompts x 8 samples, lr
1e-4, one optimizer step per batch, no KL, colocated), responses up to 16 and up to 96 tokens
(`--max-response-tokens`). For each setting, in one run:
- the pipeline (`run_pipeline`): two warm-up steps, then `--num-steps` timed ones. Each timed
  step's phases come from its metrics (`timing_s/*`: generation with scoring and the buffer,
  sleep, batch assembly, old-logprob pass, advantages, update, weight sync, wake-up), as medians
  in seconds and as shares of the step; `driver_other` is the rest of the step. Each core's idle
  share over the timed steps is read from /proc/stat, and the CPU seconds per step of each kind of
  process (trainer rank, engine actor, vLLM's engine core and worker, Ray's own, ...) from psutil.
- raw vLLM: `vllm.LLM` in a process of its own, on the engine's own arguments, generating the
  prompts of the timed steps (the data set in the pipeline's order) with the same sampling
  settings, one request per sample as the engine sends them;
- a plain update in this process: the transformers model, one forward/backward per micro-batch
  under the trainer's token budget, one AdamW step (benchmarks/trainer_throughput.py's plain loop)
  on the raw generation's batches.

`overhead_ratio` = median step / (median raw generation + median plain update).

    .venv/bin/python benchmarks/step_time.py [--num-steps 5] [--max-response-tokens 16 96]

Prints a summary per setting, then one final JSON line: overhead_ratio per setting (and their
maximum), step_s, raw_generation_s, plain_update_s, the phases, core idle shares, response lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from trainer_throughput import plain_step  # this folder: the script's own

from rlactors.config import AlgorithmConfig, load_config
from rlactors.metrics import read_metrics
from rlactors.models import build_tiny_model, load_model
from rlactors.trainer.batch import TrainBatch

NUM_WARMUP_STEPS = 2
# Phases of a colocated step, as the driver times them (each a `timing_s/<phase>` metric).
PHASES = ("gen", "sleep", "assemble", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
          "weight_sync", "wake_up")


def overrides(model_path: Path, output_dir: Path, max_response_tokens: int, num_steps: int) -> list[str]:
    return [
        f"model.path={model_path}", "model.preset=small", "data.task=arithmetic", "data.num_train_rows=2000",
        "data.num_val_rows=16", f"rollout.max_model_len={64 + max_response_tokens}",
        "rollout.sampling.num_samples_per_prompt=8", f"rollout.sampling.max_response_tokens={max_response_tokens}",
        "trainer.optim.lr=1e-4", "trainer.num_mini_batches=1", "trainer.num_epochs=1",
        "algorithm.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
        f"pipeline.num_steps={num_steps}", "pipeline.batch_size_prompts=16", "pipeline.val_every_steps=0",
        f"pipeline.output_dir={output_dir}", "pipeline.resume=never", "pipeline.mode=colocated",
    ]


def cpu_times() -> list[tuple[int, int]]:
    """(idle, total) jiffies of each core, from /proc/stat."""
    cores = []
    with open("/proc/stat") as stat:
        for line in stat:
            if line.startswith("cpu") and line[3].isdigit():
                values = [int(v) for v in line.split()[1:]]
                cores.append((values[3] + values[4], sum(values)))  # idle + iowait
    return cores


def process_cpu_s() -> dict[tuple[int, float], tuple[str, float]]:
    """Every process (pid and start time: a pid can be reused, and a kernel worker's name changes
    with its work) by its label (its title's first word: `ray::TrainerWorker`, `VLLM::EngineCore`,
    `raylet`, ...) and its CPU seconds so far (user + system)."""
    import psutil

    found = {}
    for process in psutil.process_iter():
        try:
            title = " ".join(process.cmdline()) or process.name()
            label = title.split()[0].rsplit("/", 1)[-1].split(".")[0] if title else "?"
            times = process.cpu_times()
            found[(process.pid, process.create_time())] = (label, times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


class IdleWatch:
    """Each core's idle share, and the CPU seconds of each kind of process, between the metrics log
    reaching `start_lines` and `end_lines` lines."""

    def __init__(self, metrics_path: Path, start_lines: int, end_lines: int):
        self.path, self.marks = metrics_path, {}
        self.wanted = {"start": start_lines, "end": end_lines}
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while "end" not in self.marks:
            lines = len(self.path.read_text().splitlines()) if self.path.exists() else 0
            for mark, wanted in self.wanted.items():
                if mark not in self.marks and lines >= wanted:
                    self.marks[mark] = cpu_times()
                    self.marks[f"{mark}_processes"] = process_cpu_s()
            time.sleep(0.05)

    def shares(self) -> list[float]:
        self.thread.join(timeout=10)
        start, end = self.marks["start"], self.marks["end"]
        return [round((e_idle - s_idle) / max(e_total - s_total, 1), 3)
                for (s_idle, s_total), (e_idle, e_total) in zip(start, end, strict=True)]

    def process_cpu_s(self, num_steps: int, top: int = 10) -> dict[str, float]:
        """CPU seconds per step of each kind of process over the timed steps, the busiest first."""
        start, end = self.marks["start_processes"], self.marks["end_processes"]
        per_label: dict[str, float] = {}
        for process, (label, seconds) in end.items():
            before = start[process][1] if process in start else 0.0
            per_label[label] = per_label.get(label, 0.0) + seconds - before
        busiest = sorted(per_label.items(), key=lambda item: -item[1])[:top]
        return {label: round(seconds / num_steps, 3) for label, seconds in busiest}


def run_pipeline_timed(model_path: Path, output_dir: Path, max_response_tokens: int, num_steps: int) -> dict:
    from rlactors.pipelines import run_pipeline

    config = load_config(None, overrides(model_path, output_dir, max_response_tokens, NUM_WARMUP_STEPS + num_steps))
    # metrics.jsonl: a line for step 0 (validation), then one per step.
    watch = IdleWatch(output_dir / "metrics.jsonl", 1 + NUM_WARMUP_STEPS, 1 + NUM_WARMUP_STEPS + num_steps)
    run_pipeline(config)
    history = [h for h in read_metrics(output_dir / "metrics.jsonl") if h["step"] > NUM_WARMUP_STEPS]
    step_s = statistics.median(h["timing_s/step"] for h in history)
    phases = {phase: statistics.median(h.get(f"timing_s/{phase}", 0.0) for h in history) for phase in PHASES}
    phases = {phase: seconds for phase, seconds in phases.items() if seconds > 0}
    phases["driver_other"] = max(step_s - sum(phases.values()), 0.0)
    return {"step_s": step_s, "steps_s": [round(h["timing_s/step"], 3) for h in history],
            "phases_s": {k: round(v, 4) for k, v in phases.items()},
            "phase_shares": {k: round(v / step_s, 3) for k, v in phases.items()},
            "core_idle_shares": watch.shares(),
            "process_cpu_s_per_step": watch.process_cpu_s(num_steps),
            "response_length_mean": statistics.mean(h["response_length/mean"] for h in history),
            "max_tokens_per_micro_batch": config.trainer.max_tokens_per_micro_batch,
            "config": config}


def step_prompts(config, output_dir: Path, num_steps: int) -> list[list[list[int]]]:
    """The prompt token ids of each timed step, in the order the pipeline took them."""
    from rlactors.data import PromptDataset
    from rlactors.models import load_tokenizer
    from rlactors.pipelines.build import data_files, requests_for

    train_files, _ = data_files(config, output_dir)
    data = config.data
    dataset = PromptDataset.from_files(train_files, seed=data.seed, shuffle=data.shuffle)
    tokenizer = load_tokenizer(config.model.path)
    batches = [dataset.next_batch(config.pipeline.batch_size_prompts) for _ in range(NUM_WARMUP_STEPS + num_steps)]
    return [[request.prompt_token_ids for request in requests_for(rows, tokenizer, config)] for rows in batches]


def raw_generation(spec_path: str) -> None:
    """In a process of its own: vllm.LLM generating each step's prompts; writes the times and responses."""
    from vllm import LLM

    from rlactors.config import Config
    from rlactors.rollout.vllm_args import engine_kwargs, sampling_params
    from rlactors.runtime.device import default_dtype, engine_env

    spec = json.loads(Path(spec_path).read_text())
    config = Config.model_validate(spec["config"])
    rollout, setting = config.rollout, config.rollout.sampling
    os.environ.update(engine_env("cpu", rollout.use_aiter, rollout.cpu_kv_cache_bytes))
    llm = LLM(**engine_kwargs(config.model.path, rollout, "cpu", default_dtype("cpu"), seed=config.pipeline.seed))
    params = sampling_params(setting, setting.max_response_tokens, seed=None)
    results = []
    for prompts in spec["step_prompts"]:
        inputs = [{"prompt_token_ids": prompt} for prompt in prompts for _ in range(setting.num_samples_per_prompt)]
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        results.append({"seconds": time.perf_counter() - start,
                        "prompts": [list(o.prompt_token_ids) for o in outputs],
                        "responses": [list(o.outputs[0].token_ids) for o in outputs]})
    Path(spec["out"]).write_text(json.dumps(results))


def plain_updates(model_path: Path, generated: list[dict], max_tokens: int, num_samples: int) -> list[float]:
    """One plain update per generated step, on that step's prompts and responses; seconds of each."""
    model = load_model(model_path)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for step in generated:
        responses = [r or [0] for r in step["responses"]]  # an empty response still costs its prompt
        batch = TrainBatch(step["prompts"], responses, [i // num_samples for i in range(len(responses))])
        batch.set_field("old_logprobs", [torch.zeros(len(r)) for r in responses])
        batch.set_field("advantages", [torch.randn(len(r), generator=generator) for r in responses])
        start = time.perf_counter()
        plain_step(model, optimizer, batch, max_tokens, AlgorithmConfig())
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(work: Path, model_path: Path, max_response_tokens: int, num_steps: int) -> dict:
    output_dir = work / f"run-{max_response_tokens}"
    pipeline = run_pipeline_timed(model_path, output_dir, max_response_tokens, num_steps)
    config = pipeline.pop("config")
    spec = {"config": config.model_dump(mode="json"), "out": str(work / f"raw-{max_response_tokens}.json"),
            "step_prompts": step_prompts(config, output_dir, num_steps)}
    spec_path = work / f"raw-{max_response_tokens}-spec.json"
    spec_path.write_text(json.dumps(spec))
    subprocess.run([sys.executable, __file__, "--raw-generation-of", str(spec_path)], check=True, timeout=1800,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    generated = json.loads(Path(spec["out"]).read_text())[NUM_WARMUP_STEPS:]
    updates = plain_updates(model_path, generated, pipeline["max_tokens_per_micro_batch"],
                            config.rollout.sampling.num_samples_per_prompt)[1:]  # the first warms up
    generation_s = statistics.median(step["seconds"] for step in generated)
    update_s = statistics.median(updates)
    lengths = [len(r) for step in generated for r in step["responses"]]
    return {**pipeline, "raw_generation_s": round(generation_s, 4), "plain_update_s": round(update_s, 4),
            "raw_response_length_mean": round(statistics.mean(lengths), 2),
            "overhead_ratio": round(pipeline["step_s"] / (generation_s + update_s), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-steps", type=int, default=5, help="timed steps per setting, after two warm-up steps")
    parser.add_argument("--max-response-tokens", type=int, nargs="+", default=[16, 96])
    parser.add_argument("--raw-generation-of", default=None, help=argparse.SUPPRESS)  # the raw engine's process
    args = parser.parse_args()
    if args.raw_generation_of:
        raw_generation(args.raw_generation_of)
        return
    began = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="step-time-"))
    model_path = build_tiny_model(work / "model", "small", seed=0)
    results = {}
    for max_tokens in args.max_response_tokens:
        result = results[str(max_tokens)] = measure(work, model_path, max_tokens, args.num_steps)
        print(f"responses up to {max_tokens} tokens: step {result['step_s']:.3f} s vs raw generation "
              f"{result['raw_generation_s']:.3f} s + plain update {result['plain_update_s']:.3f} s: "
              f"overhead_ratio {result['overhead_ratio']}; phases (s): {result['phases_s']}; "
              f"idle per core {result['core_idle_shares']}; CPU s per step by process {result['process_cpu_s_per_step']}")
    print(json.dumps({
        "overhead_ratio": {key: result["overhead_ratio"] for key, result in results.items()},
        "max_overhead_ratio": max(result["overhead_ratio"] for result in results.values()),
        "settings": results, "num_steps": args.num_steps, "elapsed_s": round(time.perf_counter() - began, 1),
    }))


if __name__ == "__main__":
    main()
