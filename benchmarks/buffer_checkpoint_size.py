"""Replay buffer checkpoint size and in-memory records as a run grows (no Ray, no engines).

Simulates a colocated run on `BufferCore` with synthetic groups: each step feeds prompts from a
small dataset (so the run crosses many epochs), reserves and puts a batch (some groups fail, some
have zero variance and are dropped by dynamic sampling), samples, acks; a checkpoint every
`--checkpoint-every` steps. Reports, after 10, 100 and `--num-steps` steps:

- checkpoint_bytes_N: the bytes of the buffer's checkpoint folder (`save_buffer_state`);
- records_in_memory_N: ledger rows, events and batch ids the buffer holds in memory (the in-flight
  window and the log rows waiting to be appended);
- finished_prompt_ids_in_memory_N: the newest epoch's finished prompt_ids, kept to refuse a prompt
  added twice (at most the data set's size);
- ledger_log_bytes_N: the run-level ledger log on disk (finished rows and events, written once
  each; not in the checkpoint).

`ratio` is checkpoint_bytes at `--num-steps` over that at 10: about 1 when the checkpoint is
bounded by the in-flight window (it varies with how many prompts are in flight at the cut).

    .venv/bin/python benchmarks/buffer_checkpoint_size.py [--num-steps 1000] [--batch-size 8]

Prints one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from rlactors.buffer import BufferCore, LedgerLog, save_buffer_state
from rlactors.types import Group, PromptRequest, Sample


def make_group(request: PromptRequest, policy_version: int, step: int, num_samples: int) -> Group:
    """Four short scored samples; every 16th group failed on one sample, every 8th has zero variance."""
    index = int(request.prompt_id[1:])
    error = f"prompt_id={request.prompt_id!r}: engine died" if index % 16 == 3 else None
    scores = [1.0] * num_samples if (index + step) % 8 == 5 else [float(i % 2) for i in range(num_samples)]
    samples = [
        Sample(request.prompt_id, i, request.prompt_token_ids, [7, 8, 9, 10], [-0.5] * 4, [policy_version] * 4,
               error=error if i == 0 else None, text="abcd", score=score, score_details={"acc": score})
        for i, score in enumerate(scores)
    ]
    return Group(request, samples)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def records_in_memory(core: BufferCore) -> int:
    """Rows the buffer holds for the ledger, the event log and batch bookkeeping."""
    return len(core.entries) + core.log.num_pending_rows() + len(core.nacked_batch_ids) + len(core.unacked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--dataset-size", type=int, default=256)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="buffer_checkpoint_size_"))
    core = BufferCore(capacity_groups=2 * args.batch_size, max_staleness=0, dynamic_sampling=True,
                      max_generation_rounds=20, log=LedgerLog(folder / "ledger"))
    dataset = [PromptRequest(f"p{i}", [1, 2, 3, i % 50]) for i in range(args.dataset_size)]
    position, epoch, result = 0, 0, {}
    for step in range(1, args.num_steps + 1):
        while (batch := core.sample(args.batch_size, step - 1)) is None:
            num_pending = len(core.reissued) + len(core.fresh)
            if num_pending < args.batch_size:
                take = min(args.batch_size - num_pending, len(dataset) - position)
                core.add_prompts(dataset[position:position + take], epoch)
                position += take
                if position == len(dataset):
                    position, epoch = 0, epoch + 1
            core.put([make_group(r, step - 1, step, args.num_samples) for r in core.reserve(args.batch_size)])
        core.ack(batch.batch_id)
        core.set_policy_version(step)
        measure = step in (10, 100, args.num_steps)
        if step % args.checkpoint_every == 0 or measure:
            save_buffer_state(core.state_dict(), folder / "checkpoint" / "buffer")
        if measure:
            result[f"checkpoint_bytes_{step}"] = folder_bytes(folder / "checkpoint")
            result[f"records_in_memory_{step}"] = records_in_memory(core)
            result[f"finished_prompt_ids_in_memory_{step}"] = len(core.epochs.finished_in_newest)
            result[f"ledger_log_bytes_{step}"] = folder_bytes(folder / "ledger")
    result["ratio"] = round(result[f"checkpoint_bytes_{args.num_steps}"] / result["checkpoint_bytes_10"], 3)
    result["num_epochs"] = epoch
    result["num_trained"] = core.metrics()["num_trained"]
    shutil.rmtree(folder)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
