"""Reward models as scorers. Ray-free: a tiny classifier's logits batched as one at a time and as a
plain transformers forward, long sequences cut to their end, a failing sequence named while its batch
is kept, the chat format. On a real local Ray: the pool's stages summing the weighted parts, a data
source's choice of models, a failed rollout left unscored, counters and their checkpoint, a replica
killed mid-call restarted with each group scored once, and offload/onload for colocated time-sharing."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from rlactors.config import ConfigError, RewardConfig, RewardModelConfig
from rlactors.models import load_tokenizer
from rlactors.reward.model_scorer import classifier_text, load_classifier, score_sequences
from rlactors.types import Group, PromptRequest, Sample


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from rlactors.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_rm", seed=1, head="classifier")


@pytest.fixture(scope="module")
def classifier(reward_model_dir):
    return load_classifier(RewardModelConfig(name="quality", path=str(reward_model_dir)))


def plain_logit(classifier, text: str) -> float:
    model, tokenizer = classifier
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([tokenizer(text)["input_ids"]])).logits[0, 0])


def test_a_batch_scores_as_each_sequence_alone_and_as_a_plain_forward(classifier):
    texts = ["2+3=5", "2+3=a much longer answer, 6", "7"]
    batched, num_truncated = score_sequences(*classifier, texts, batch_size=2, max_tokens=64)
    assert num_truncated == 0 and all(error is None for _, error in batched)
    values = [value for value, _ in batched]
    assert values == pytest.approx([plain_logit(classifier, text) for text in texts], abs=1e-5)
    assert len({round(value, 4) for value in values}) == 3  # the model reads the text


def test_a_long_sequence_keeps_its_last_tokens_and_is_counted(classifier):
    model, tokenizer = classifier
    text = "x" * 40 + " and the answer is 12"
    (result,), num_truncated = score_sequences(model, tokenizer, [text], batch_size=4, max_tokens=10)
    with torch.no_grad():
        tail = model(input_ids=torch.tensor([tokenizer(text)["input_ids"][-10:]])).logits[0, 0]
    assert num_truncated == 1 and result == (pytest.approx(float(tail), abs=1e-5), None)


def test_a_batch_pads_with_the_models_pad_id_where_the_tokenizers_differs(reward_model_dir, tmp_path):
    # A classifier whose config.pad_token_id (what transformers pools by) is not its tokenizer's pad id.
    shutil.copytree(reward_model_dir, tmp_path / "rm")
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    tokenizer = load_tokenizer(tmp_path / "rm")
    config["pad_token_id"] = tokenizer.eos_token_id
    assert config["pad_token_id"] != tokenizer.pad_token_id
    (tmp_path / "rm" / "config.json").write_text(json.dumps(config))
    classifier = load_classifier(RewardModelConfig(name="quality", path=str(tmp_path / "rm")))
    texts = ["2+3=5", "2+3=a much longer answer, 6"]
    batched, _ = score_sequences(*classifier, texts, batch_size=2, max_tokens=64)
    assert [value for value, _ in batched] == pytest.approx([plain_logit(classifier, text) for text in texts], abs=1e-5)


class RefusesBang(torch.nn.Module):
    """The classifier, raising on any sequence holding a '!' (a sequence the real model cannot take)."""

    def __init__(self, model, bang_id: int):
        super().__init__()
        self.model, self.bang_id, self.config = model, bang_id, model.config

    def forward(self, input_ids, attention_mask):
        if (input_ids == self.bang_id).any():
            raise ValueError("cannot read '!'")
        return self.model(input_ids=input_ids, attention_mask=attention_mask)


def test_a_failing_sequence_is_named_and_the_rest_of_its_batch_scored(classifier):
    model, tokenizer = classifier
    texts = ["ok", "bad!", "fine"]
    results, _ = score_sequences(RefusesBang(model, tokenizer.convert_tokens_to_ids("!")), tokenizer, texts, 3, 64)
    assert results[1] == (None, "ValueError: cannot read '!'")
    assert [results[0][0], results[2][0]] == pytest.approx([plain_logit(classifier, "ok"), plain_logit(classifier, "fine")],
                                                           abs=1e-5)


def test_the_chat_format_goes_through_the_models_template(classifier):
    _, tokenizer = classifier
    text = classifier_text("2+3=", "5", "chat", tokenizer)
    assert text == tokenizer.apply_chat_template([{"role": "user", "content": "2+3="},
                                                  {"role": "assistant", "content": "5"}], tokenize=False)
    assert classifier_text("2+3=", "5", "join", tokenizer) == "2+3=5"
    tokenizer_without = type("NoTemplate", (), {"chat_template": None})()
    with pytest.raises(ValueError, match="chat template"):
        classifier_text("2+3=", "5", "chat", tokenizer_without)


# --------------------------------------------------------------------------------------------
# On Ray, through the pool


def arithmetic_group(tokenizer, prompt_id: str, prompt: str, answer: str, texts: list[str],
                     data_source: str = "synthetic/arithmetic") -> Group:
    ids = tokenizer(prompt)["input_ids"]
    request = PromptRequest(prompt_id, ids, data_source=data_source, ground_truth=answer)
    return Group(request, [Sample(prompt_id, i, ids, response_token_ids=[1] * len(text), text=text)
                           for i, text in enumerate(texts)])


@pytest.fixture(scope="module")
def model_pool(ray_session, reward_model_dir):
    from rlactors.reward.pool import RewardPool

    rm = RewardModelConfig(name="quality", path=str(reward_model_dir), weight=2.0, batch_size=2,
                           data_sources=["synthetic/arithmetic", "chat/open"])
    config = RewardConfig(num_workers=1, timeout_s=60.0, function_weight=0.5, models=[rm],
                          function_data_sources=["synthetic/arithmetic", "openai/gsm8k"])
    # The tiny policy and reward model share the character tokenizer: either folder gives it.
    pool = RewardPool(config, max_response_tokens=64, policy_tokenizer_path=str(reward_model_dir))
    yield pool
    pool.shutdown()


def expected_score(classifier, prompt: str, text: str, correct: bool, scored_by_model: bool = True) -> float:
    return 0.5 * float(correct) + (2.0 * plain_logit(classifier, prompt + text) if scored_by_model else 0.0)


def test_the_reward_is_the_weighted_sum_of_its_parts_each_kept(model_pool, classifier):
    import ray

    _, tokenizer = classifier
    arithmetic = arithmetic_group(tokenizer, "a0", "2+3=", "5", ["5", "6", "five"])
    arithmetic.samples[2].error = "prompt_id=a0: engine died"  # a failed rollout: nothing to score
    other = arithmetic_group(tokenizer, "g0", "7-2=", "5", ["#### 5"], data_source="openai/gsm8k")
    before = model_pool.metrics()
    a, g = ray.get(model_pool.score_many([arithmetic, other]))

    assert [s.score for s in a.samples[:2]] == pytest.approx(
        [expected_score(classifier, "2+3=", "5", True), expected_score(classifier, "2+3=", "6", False)], abs=1e-5)
    assert a.samples[0].score_details["reward_parts"] == {"function": 1.0,
                                                          "quality": pytest.approx(plain_logit(classifier, "2+3=5"), abs=1e-5)}
    failed = a.samples[2]
    assert failed.score == 0.0 and failed.score_error.endswith("engine died")
    assert failed.score_details["reward_parts"] == {"function": 0.0, "quality": 0.0}
    # gsm8k is not the model's data source: the function's part alone, the model's recorded as 0.
    assert g.samples[0].score == pytest.approx(0.5) and g.samples[0].score_details["reward_parts"]["quality"] == 0.0
    after = model_pool.metrics()
    assert after["reward/quality/num_scored"] - before["reward/quality/num_scored"] == 2
    assert after["reward/quality/num_samples"] - before["reward/quality/num_samples"] == 4


def test_a_data_source_the_function_does_not_list_is_the_models_alone(model_pool, classifier):
    """A chat row, which no rule could score (the function would raise on its data source), is not
    sent to the function: its part is 0 with no error, and the model's part is the reward."""
    import ray

    _, tokenizer = classifier
    before = model_pool.metrics()
    chat = ray.get(model_pool.score(arithmetic_group(tokenizer, "c0", "Say hi.", "", ["hi", "no"],
                                                     data_source="chat/open")))
    for sample in chat.samples:
        assert sample.score_error is None
        assert sample.score_details["reward_parts"] == {
            "function": 0.0, "quality": pytest.approx(plain_logit(classifier, "Say hi." + sample.text), abs=1e-5)}
        assert sample.score == pytest.approx(2.0 * sample.score_details["reward_parts"]["quality"])
    assert model_pool.metrics()["reward/num_errors"] == before["reward/num_errors"]


def test_the_pools_checkpoint_holds_each_models_counters(model_pool):
    state = model_pool.state_dict()
    assert set(state["models"]) == {"quality"} and state["models"]["quality"]["counts"]["num_samples"] >= 0
    changed = {**state, "models": {"quality": {"counts": {**state["models"]["quality"]["counts"], "num_scored": 41},
                                               "scoring_s": 2.5}}}
    model_pool.load_state_dict(changed)
    assert model_pool.state_dict() == changed
    model_pool.load_state_dict(state)


def test_a_replica_killed_mid_call_is_restarted_and_each_group_scored_once(model_pool, classifier):
    import ray

    _, tokenizer = classifier
    replica = model_pool.model_actors[0][0]
    pid_before = ray.get(replica.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    groups = [arithmetic_group(tokenizer, f"k{i}", f"{i}+1=", str(i + 1), [str(i + 1), "0" * 30])
              for i in range(12)]
    refs = model_pool.score_many(groups)
    ray.kill(replica, no_restart=False)  # Ray restarts it and retries the calls it had (max_task_retries)
    scored = ray.get(refs, timeout=300)

    for i, group in enumerate(scored):
        assert [s.score for s in group.samples] == pytest.approx(
            [expected_score(classifier, f"{i}+1=", str(i + 1), True),
             expected_score(classifier, f"{i}+1=", "0" * 30, False)], abs=1e-5)
    assert ray.get(replica.__ray_call__.remote(lambda self: os.getpid()), timeout=60) != pid_before


def test_offloaded_classifiers_move_once_and_score_alike_after_an_onload(model_pool, classifier):
    """Colocated time-sharing on CPU (where a move to the host copies nothing, but the calls are those a
    GPU run makes): offload moves every weight once, and a call meanwhile onloads first, then scores as before."""
    import ray

    model, tokenizer = classifier
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_pool.offload() == weight_bytes and model_pool.offload() == 0
    group = ray.get(model_pool.score(arithmetic_group(tokenizer, "o0", "2+3=", "5", ["5"])))
    assert group.samples[0].score == pytest.approx(expected_score(classifier, "2+3=", "5", True), abs=1e-5)
    assert model_pool.onload() == 0  # the call brought it back
    assert model_pool.offload() == weight_bytes and model_pool.onload() == weight_bytes


def test_a_model_name_is_its_own_and_a_pool_with_models_needs_the_policy_tokenizer(ray_session, reward_model_dir):
    from pydantic import ValidationError

    from rlactors.reward.pool import RewardPool

    rm = RewardModelConfig(name="quality", path=str(reward_model_dir))
    for names in (["quality", "quality"], ["function"]):
        with pytest.raises(ValidationError, match="distinct and not 'function'"):
            RewardConfig(models=[rm.model_copy(update={"name": name}) for name in names])
    with pytest.raises(ValueError, match="policy's tokenizer path"):
        RewardPool(RewardConfig(models=[rm]))
    missing = rm.model_copy(update={"name": "judge", "path": str(reward_model_dir / "nothing")})
    with pytest.raises(ConfigError, match=r"reward.models\[1\].path: .*nothing \('judge'\) holds no"):
        RewardPool(RewardConfig(models=[rm, missing]), policy_tokenizer_path=str(reward_model_dir))
