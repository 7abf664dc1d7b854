"""Train a reward model on preference pairs: `rlactors train-reward-model [CONFIG] [key=value ...]`.

    pairs (a file, or synthetic: `rlactors.data.preferences`)
      -> texts as the classifier scorer reads them (`classifier_text`, `classifier_token_ids`)
      -> a TrainBatch: pair p is sequences 2p (chosen) and 2p+1 (rejected), each a whole text
      -> TrainerGroup("reward_model"): each epoch a seeded order of the pairs, one Bradley-Terry
         step per `batch_size_pairs` (`TrainerWorker.update_reward_model`)
      -> save_hf(output_path): a one-label sequence classifier, the folder `reward.models` loads
      -> held-out accuracy: that folder scored by the scorer's own `score_sequences`

    output_path/                      the Hugging Face folder (config, weights, tokenizer)
    output_path/reward_training.json  the config, each epoch's metrics, the held-out accuracy
    output_path.logs/                 every process's log (the terminal gets warnings and errors)

The model is scored exactly as a run's classifier scorer will score it (same text, same tokens, same
pooling at the last token), so the held-out accuracy is the accuracy the run's rewards will have.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from rlactors.config import ConfigError, RewardModelConfig, RewardTrainingConfig
from rlactors.data.preferences import PreferencePair, read_preference_pairs, synthetic_preference_pairs
from rlactors.models import ensure_model, is_model_folder, load_tokenizer
from rlactors.pipelines.build import init_ray
from rlactors.reward.model_scorer import (
    classifier_text,
    classifier_token_ids,
    load_classifier,
    score_sequences,
)
from rlactors.runtime.durable import write_durably
from rlactors.trainer.batch import TrainBatch
from rlactors.trainer.group import TrainerGroup


def preference_data(config: RewardTrainingConfig) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(training pairs, held-out pairs): from the files named, else synthetic."""
    if config.train_path is None:
        return (synthetic_preference_pairs(config.num_synthetic_pairs, config.seed, "train"),
                synthetic_preference_pairs(config.num_synthetic_val_pairs, config.seed, "test")
                if config.val_path is None else read_preference_pairs(config.val_path))
    return read_preference_pairs(config.train_path), \
        read_preference_pairs(config.val_path) if config.val_path is not None else []


def pair_texts(pairs: list[PreferencePair], tokenizer, input_format: str) -> list[str]:
    """Chosen then rejected text of each pair, in order, as the scorer reads them."""
    return [classifier_text(pair.prompt, response, input_format, tokenizer)
            for pair in pairs for response in (pair.chosen, pair.rejected)]


def preference_batch(pairs: list[PreferencePair], tokenizer, input_format: str, max_tokens: int) -> TrainBatch:
    """The pairs as a TrainBatch for `TrainerGroup.update_reward_model`: each text whole in
    `prompt_token_ids` (no response: the score is read at its last token); group i is pair i."""
    token_ids, _ = classifier_token_ids(tokenizer, pair_texts(pairs, tokenizer, input_format), max_tokens)
    return TrainBatch(prompt_token_ids=token_ids, response_token_ids=[[] for _ in token_ids],
                      group_ids=[i // 2 for i in range(len(token_ids))],
                      prompt_ids=[pair.pair_id for pair in pairs for _ in range(2)],
                      sample_indices=[i % 2 for i in range(len(token_ids))])


def pair_accuracy(model_path: str, pairs: list[PreferencePair], config: RewardTrainingConfig) -> dict[str, float]:
    """Held-out figures of the folder at `model_path`, scored by the classifier scorer's functions:
    the share of pairs whose chosen text scores higher, and the mean score margin."""
    model, tokenizer = load_classifier(RewardModelConfig(name="trained", path=model_path))
    results, _ = score_sequences(model, tokenizer, pair_texts(pairs, tokenizer, config.input_format),
                                 batch_size=32, max_tokens=config.max_tokens)
    failed = [(pairs[i // 2].pair_id, error) for i, (score, error) in enumerate(results) if score is None]
    if failed:
        raise RuntimeError(f"{len(failed)} held-out texts the trained model could not score, the first of pair "
                           f"{failed[0][0]!r}: {failed[0][1]}")
    margins = torch.tensor([results[i][0] - results[i + 1][0] for i in range(0, len(results), 2)])
    return {"val/preference_accuracy": float((margins > 0).float().mean()),
            "val/score_margin": float(margins.mean())}


def train_reward_model(config: RewardTrainingConfig) -> dict:
    """Train, write `config.output_path`, and return the report (also written beside the weights)."""
    output = Path(config.output_path).absolute()
    if config.model_preset is None and not is_model_folder(config.model_path):
        raise ConfigError(f"model_path {config.model_path!r} holds no Hugging Face model folder (config.json and "
                          "*.safetensors); set model_preset=tiny to build a random-init one there")
    model_path = str(ensure_model(config.model_path, config.model_preset, build_if_missing=config.model_preset is not None))
    train_pairs, val_pairs = preference_data(config)
    tokenizer = load_tokenizer(model_path)
    batch = preference_batch(train_pairs, tokenizer, config.input_format, config.max_tokens)
    num_steps_per_epoch = -(-len(train_pairs) // config.batch_size_pairs)
    init_ray(output.parent / f"{output.name}.logs")
    group = TrainerGroup("reward_model", model_path, config.trainer, seed=config.seed)
    epochs = []
    try:
        for epoch in range(config.num_epochs):
            order = list(range(len(train_pairs)))
            random.Random(f"{config.seed}/{epoch}").shuffle(order)
            shuffled = batch.select([i for pair in order for i in (2 * pair, 2 * pair + 1)])
            metrics = group.update_reward_model(shuffled, num_mini_batches=num_steps_per_epoch)
            epochs.append({"epoch": epoch + 1} | metrics)
            print(f"epoch {epoch + 1}/{config.num_epochs}: loss {metrics['reward_model/bt_loss']:.4f}, "
                  f"accuracy {metrics['reward_model/preference_accuracy']:.3f}", flush=True)
        group.save_hf(str(output))
    finally:
        group.shutdown()
    report = {"config": config.model_dump(mode="json"), "num_train_pairs": len(train_pairs),
              "num_val_pairs": len(val_pairs), "epochs": epochs}
    if val_pairs:
        report |= pair_accuracy(str(output), val_pairs, config)
        print(f"held-out accuracy {report['val/preference_accuracy']:.3f} on {len(val_pairs)} pairs", flush=True)
    write_durably(output / "reward_training.json", (json.dumps(report, indent=2) + "\n").encode())
    print(f"reward model: {output} (Hugging Face folder; name it in reward.models[].path)")
    return report
