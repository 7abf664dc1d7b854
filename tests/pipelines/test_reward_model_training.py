"""`rlactors train-reward-model` on the real stack (Ray, an FSDP2 trainer group on gloo): a tiny
classifier trained with the Bradley-Terry loss on synthetic preference pairs, written as the folder
the classifier scorer loads, which prefers held-out chosen responses as the pairs do.

Below it: the loss (tests/algorithms/test_loss_aggregation.py), the pair plan
(tests/trainer/test_trainer_batch.py), the group's update on one and two ranks
(tests/trainer/test_trainer_group.py), the pairs (tests/data/test_preferences.py). Above it: a GRPO
run against the trained model (tests/pipelines/test_reward_model_runs.py)."""

import json

from rlactors.cli import main
from rlactors.config import RewardModelConfig
from rlactors.reward.model_scorer import load_classifier, score_sequences


def test_a_preference_trained_classifier_loads_as_a_scorer_and_ranks_held_out_pairs(ray_session, tiny_model_dir,
                                                                                    tmp_path, capsys):
    out = tmp_path / "reward_model"
    assert main(["train-reward-model", f"model_path={tiny_model_dir}", f"output_path={out}", "num_epochs=3",
                 "trainer.optim.lr=3e-4"]) == 0
    report = json.loads((out / "reward_training.json").read_text())
    losses = [epoch["reward_model/bt_loss"] for epoch in report["epochs"]]
    assert losses == sorted(losses, reverse=True) and losses[0] > 2 * losses[-1], losses
    assert report["num_train_pairs"] == 512 and report["num_val_pairs"] == 64
    assert report["val/preference_accuracy"] >= 0.85, report  # measured 0.94
    assert "held-out accuracy" in capsys.readouterr().out

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1
    model, tokenizer = load_classifier(RewardModelConfig(name="digits", path=str(out)))
    (numbers, _), (words, _) = score_sequences(model, tokenizer, ["17+25=42", "17+25=abc"], 2, 64)[0]
    assert numbers > words

    assert main(["train-reward-model", f"model_path={tiny_model_dir}", f"output_path={out}",
                 f"train_path={tmp_path / 'missing.jsonl'}"]) == 2
    assert "missing.jsonl: no such preference file" in capsys.readouterr().err
    assert main(["train-reward-model", f"model_path={tmp_path / 'nothing'}", f"output_path={out}"]) == 2
    assert "holds no Hugging Face model folder; set model_preset=tiny" in capsys.readouterr().err.replace(
        " (config.json and *.safetensors)", "")
