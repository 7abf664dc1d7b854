"""The LLM judge. Ray-free: the message (placeholders filled in one pass), the built-in verdicts and
a user's, an output without a verdict kept in its error. On the suite's vLLM engine (`engine` in
tests/conftest.py; the tiny model as judge): what the judge answers is what the engine writes for that message, parts and outputs kept
per sample, an output without a verdict scores 0 with the output in its error, a judge past its
time limit fails only its samples, and a judge whose engine sleeps (colocated) wakes it to judge."""

from __future__ import annotations

import textwrap

import pytest

from rlactors.config import RewardModelConfig, SamplingConfig
from rlactors.reward.judge import judge_message, read_verdict, verdict_parser
from rlactors.types import Group, PromptRequest, Sample

USER_VERDICTS = textwrap.dedent(
    """
    def length(output):
        return float(len(output))

    def text(output):
        return "7"

    def numpy_count(output):
        import numpy
        return numpy.int64(len(output))

    def yes(output):
        return True
    """
)


def test_the_message_fills_each_placeholder_once_and_keeps_other_braces():
    template = 'Q: {prompt} A: {response} ({ground_truth}) as JSON {"score": N}'
    assert judge_message(template, "2+3=", "it is {prompt}", "5") == 'Q: 2+3= A: it is {prompt} (5) as JSON {"score": N}'


def test_built_in_verdicts_take_the_last_one_written(tmp_path):
    score = verdict_parser("score")
    assert score("Score: 3 ... on reflection, **Score:** 8.5") == 8.5
    assert score("final SCORE = -1") == -1.0
    assert verdict_parser("brackets")("[[2]] no, [[ 9 ]]") == 9.0
    missing = read_verdict(score, "a fine answer, ten out of ten")
    assert missing.value is None and missing.output == "a fine answer, ten out of ten"
    assert missing.error == "ValueError: no verdict ('score: N') in the judge's output; output: 'a fine answer, ten out of ten'"


def test_a_user_verdict_must_return_a_finite_number(tmp_path):
    path = tmp_path / "verdicts.py"
    path.write_text(USER_VERDICTS)
    assert verdict_parser(f"{path}:length")("abc") == 3.0
    wrong = read_verdict(verdict_parser(f"{path}:text"), "whatever")
    assert wrong.value is None and "returned '7', not a finite number" in wrong.error
    assert verdict_parser(f"{path}:numpy_count")("abcd") == 4.0  # numpy's numbers are numbers
    assert "returned True, not a finite number" in read_verdict(verdict_parser(f"{path}:yes"), "x").error
    with pytest.raises(Exception, match="nothing_here"):
        verdict_parser(f"{path}:nothing_here")


def test_a_judge_whose_verdict_does_not_load_is_refused_before_the_run(tmp_path, tiny_model_dir):
    from rlactors.config import ConfigError
    from rlactors.pipelines.preflight import check_reward_models

    path = tmp_path / "verdicts.py"
    path.write_text(USER_VERDICTS)
    good = judge_config(tiny_model_dir, f"{path}:length")
    check_reward_models([good])
    with pytest.raises(ConfigError, match=r"reward.models\[1\].judge.verdict=.*nothing_here.* \('judge'\) does not load"):
        check_reward_models([good, good.model_copy(update={"judge": good.judge.model_copy(
            update={"verdict": f"{path}:nothing_here"})})])


# --------------------------------------------------------------------------------------------
# On the suite's engine


def groups_to_judge(tokenizer) -> list[Group]:
    ids = tokenizer("2+3=")["input_ids"]
    first = Group(PromptRequest("a0", ids, data_source="synthetic/arithmetic", ground_truth="5"),
                  [Sample("a0", i, ids, response_token_ids=[1], text=text, score=0.5, score_details={"acc": True})
                   for i, text in enumerate(["5", "6 because"])])
    first.samples[1].score_error = "prompt_id=a0 sample_index=1: ZeroDivisionError"  # the function failed: not judged
    other = Group(PromptRequest("g0", ids, data_source="openai/gsm8k", ground_truth="5"),
                  [Sample("g0", 0, ids, response_token_ids=[1], text="5", score=1.0)])
    return [first, other]


def judge_config(tiny_model_dir, verdict: str, **judge) -> RewardModelConfig:
    return RewardModelConfig(name="judge", path=str(tiny_model_dir), kind="judge", weight=0.25,
                             data_sources=["synthetic/arithmetic"],
                             judge={"verdict": verdict, "max_response_tokens": 6, "chat_template": False,
                                    "template": "Q {prompt} A {response} T {ground_truth} V", **judge})


@pytest.mark.vllm
def test_the_judge_scores_with_what_the_engine_writes_for_each_message(engine, tiny_model_dir, tmp_path):
    import ray

    from rlactors.models import load_tokenizer
    from rlactors.reward.model_scorer import RewardModelScorer

    path = tmp_path / "verdicts.py"
    path.write_text(USER_VERDICTS)
    tokenizer = load_tokenizer(tiny_model_dir)  # `engine`: the suite's, holding this module's weights
    judge = RewardModelScorer.remote(judge_config(tiny_model_dir, f"{path}:length"), str(tiny_model_dir), engine)
    first, other = ray.get(judge.score_groups.options(num_returns=2).remote(*groups_to_judge(tokenizer)), timeout=300)

    # The same message straight to the engine, greedy: the judge's output is what it writes.
    message = tokenizer("Q 2+3= A 5 T 5 V", add_special_tokens=False)["input_ids"]
    (direct_ref,) = list(engine.generate.remote([PromptRequest("direct", message)],
                                                SamplingConfig(num_samples_per_prompt=1, temperature=0.0,
                                                               max_response_tokens=6)))
    expected = ray.get(direct_ref, timeout=120).samples[0].text
    judged = first.samples[0]
    assert judged.score_details["reward_outputs"] == {"judge": expected}
    assert judged.score_details["reward_parts"] == {"judge": float(len(expected))}
    assert judged.score == pytest.approx(0.5 + 0.25 * len(expected)) and judged.score_error is None
    assert judged.score_details["acc"] is True  # the function's details are kept
    failed = first.samples[1]
    assert failed.score_error.endswith("ZeroDivisionError") and failed.score_details["reward_parts"] == {"judge": 0.0}
    assert other.samples[0].score == 1.0 and other.samples[0].score_details["reward_parts"] == {"judge": 0.0}
    assert "reward_outputs" not in other.samples[0].score_details
    assert ray.get(judge.metrics.remote(), timeout=60)["reward/judge/num_scored"] == 1

    # The built-in verdict on the same output (a tiny model writes no "score: N"): 0, output in the error.
    strict = RewardModelScorer.remote(judge_config(tiny_model_dir, "score"), str(tiny_model_dir), engine)
    unparsed = ray.get(strict.score.remote(groups_to_judge(tokenizer)[0]), timeout=300).samples[0]
    assert unparsed.score == 0.0 and unparsed.score_details["reward_outputs"] == {"judge": expected}
    assert unparsed.score_error == (f"prompt_id=a0 sample_index=0: reward model judge: ValueError: no verdict "
                                    f"('score: N') in the judge's output; output: {expected!r}")
    # No answer in time: the call's samples fail alone, each naming the bound.
    hurried = RewardModelScorer.remote(judge_config(tiny_model_dir, "score", call_timeout_s=1e-3), str(tiny_model_dir), engine)
    late = ray.get(hurried.score.remote(groups_to_judge(tokenizer)[0]), timeout=300).samples[0]
    assert late.score == 0.0 and "no verdict within 0.001 s (reward.models[].judge.call_timeout_s)" in late.score_error
    # Colocated time-sharing: the judge's engine sleeps while the trainer runs; a call that comes
    # meanwhile wakes it first (an asleep engine refuses to generate), and judges as before.
    try:
        assert ray.get(judge.offload.remote(), timeout=120) == 0 and ray.get(engine.health.remote())["asleep"]
        again = ray.get(judge.score.remote(groups_to_judge(tokenizer)[0]), timeout=300).samples[0]
        assert again.score_details["reward_outputs"] == {"judge": expected}
        assert not ray.get(engine.health.remote())["asleep"]
    finally:
        ray.get(engine.wake_up.remote(), timeout=120)  # the suite's engine, awake for the next test
    for actor in (judge, strict, hurried):
        ray.kill(actor)
