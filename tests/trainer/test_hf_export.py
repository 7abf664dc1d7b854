"""The trained model as a Hugging Face folder (`rlactors.trainer.hf_export`): from a live two-rank
trainer and from its saved checkpoint, the same weights; the folder loads in transformers and in a
vLLM engine and gives the trainer's logprobs; it appears whole or not at all."""

import json
import subprocess
import sys

import pytest
import ray
import torch
from safetensors.torch import load_file
from trainer_helpers import random_batch, trainer_config
from transformers import AutoModelForCausalLM

from rlactors.config import AlgorithmConfig, OptimConfig, RolloutConfig, SamplingConfig
from rlactors.trainer.group import TrainerGroup
from rlactors.trainer.hf_export import INDEX_FILE, export_checkpoint, trainer_checkpoint_dir, write_hf_folder


@pytest.fixture(scope="module")
def trained(ray_session, tiny_model_dir, tmp_path_factory):
    """Two ranks (weights sharded between them), a few SFT steps away from the initial model,
    exported live and checkpointed at the same point."""
    folder = tmp_path_factory.mktemp("export")
    group = TrainerGroup("actor", tiny_model_dir, trainer_config(num_workers=2, optim=OptimConfig(lr=1e-2)),
                         AlgorithmConfig())
    for seed in range(3):
        group.sft_step(random_batch(8, seed=seed))
    group.save_hf(str(folder / "live"))
    checkpoint = group.save_checkpoint(str(folder / "checkpoints"), 3)
    yield {"group": group, "live": folder / "live", "checkpoint": checkpoint, "folder": folder}
    group.shutdown()


def folder_weights(path) -> dict[str, torch.Tensor]:
    index = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    weights = {}
    for shard in sorted(set(index.values())):
        weights |= load_file(str(path / shard))
    assert set(weights) == set(index)
    return weights


def transformers_logprobs(path, batch) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    result = []
    with torch.no_grad():
        for prompt, response in zip(batch.prompt_token_ids, batch.response_token_ids, strict=True):
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            result.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0])
    return result


def test_the_live_export_gives_the_trainers_logprobs(trained, tiny_model_dir):
    batch = random_batch(4, seed=9)
    trainer = trained["group"].compute_logprobs(batch)["logprobs"]
    exported = transformers_logprobs(trained["live"], batch)
    for ours, theirs in zip(trainer, exported, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    initial = transformers_logprobs(tiny_model_dir, batch)
    assert max(float((a - b).abs().max()) for a, b in zip(initial, exported, strict=True) if len(a)) > 1e-3
    assert (trained["live"] / "tokenizer.json").is_file() and (trained["live"] / "generation_config.json").is_file()
    assert not list(trained["folder"].glob(".live.*"))  # no temporary left beside it


def test_the_checkpoint_export_equals_the_live_one(trained, tiny_model_dir, tmp_path):
    out = export_checkpoint(trained["checkpoint"], tmp_path / "from_checkpoint", model_path=tiny_model_dir,
                            shard_bytes=1 << 16)
    index = json.loads((out / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2  # one shard per bucket: never the whole model at once
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding: stored once
    live, from_checkpoint = folder_weights(trained["live"]), folder_weights(out)
    assert live.keys() == from_checkpoint.keys()
    assert all(torch.equal(live[name], from_checkpoint[name]) for name in live)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in live.values())
    assert len({path.stat().st_mode & 0o777 for path in out.iterdir()}) == 1  # shards as readable as the rest


def test_export_command_reads_any_checkpoint_path(trained, tiny_model_dir, tmp_path):
    root = trained["folder"] / "checkpoints"  # the root: its `latest` names the checkpoint
    assert trainer_checkpoint_dir(root) == trainer_checkpoint_dir(trained["checkpoint"])
    result = subprocess.run([sys.executable, "-m", "rlactors", "export", str(root), str(tmp_path / "hf"),
                             "--model", str(tiny_model_dir)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"model: {tmp_path / 'hf'}" in result.stdout
    assert folder_weights(tmp_path / "hf").keys() == folder_weights(trained["live"]).keys()
    missing = subprocess.run([sys.executable, "-m", "rlactors", "export", str(tmp_path / "nothing"),
                              str(tmp_path / "hf2")], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and str(tmp_path / "nothing") in missing.stderr and "not a checkpoint" in missing.stderr


def test_a_failed_export_leaves_the_previous_folder_whole(tiny_model_dir, tmp_path):
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    first = write_hf_folder([list(state.items())], tmp_path / "hf", tiny_model_dir)
    before = folder_weights(first)

    def failing_buckets():
        yield [(name, torch.zeros_like(tensor)) for name, tensor in list(state.items())[:3]]
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_hf_folder(failing_buckets(), tmp_path / "hf", tiny_model_dir)
    after = folder_weights(tmp_path / "hf")
    assert all(torch.equal(before[name], after[name]) for name in before)
    # The next export clears what the failed one left and replaces the folder.
    write_hf_folder([[(name, tensor + 1) for name, tensor in state.items()]], tmp_path / "hf", tiny_model_dir)
    assert torch.equal(folder_weights(tmp_path / "hf")["model.norm.weight"], state["model.norm.weight"] + 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.vllm
@pytest.mark.slow  # a vLLM of its own; the export's logprobs in transformers: the live-export test above,
# and vLLM loading these weights at every sync: tests/weight_sync
def test_a_vllm_engine_serves_the_export_with_the_trainers_logprobs(trained):
    from rlactors.models import load_tokenizer
    from rlactors.rollout.engine import create_engine
    from rlactors.trainer.batch import TrainBatch
    from rlactors.types import PromptRequest

    tokenizer = load_tokenizer(trained["live"])
    engine = create_engine(str(trained["live"]), RolloutConfig(max_model_len=64))
    try:
        requests = [PromptRequest(f"p{i}", tokenizer.encode(text)) for i, text in enumerate(["12+34=", "7*8="])]
        sampling = SamplingConfig(num_samples_per_prompt=2, max_response_tokens=12, seed=3)
        samples = [s for ref in engine.generate.remote(requests, sampling) for s in ray.get(ref).samples]
    finally:
        ray.kill(engine)
    batch = TrainBatch([s.prompt_token_ids for s in samples], [s.response_token_ids for s in samples],
                       list(range(len(samples))))
    trainer = trained["group"].compute_logprobs(batch)["logprobs"]
    for sample, expected in zip(samples, trainer, strict=True):
        assert sample.num_response_tokens > 0
        assert (torch.tensor(sample.response_logprobs) - expected).abs().max() < 1e-4
