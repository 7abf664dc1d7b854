"""An LLM judge's verdicts (`reward.models`, kind judge; the replica actor is
`rlactors.reward.model_scorer.RewardModelScorer`): each sample's prompt and response go into the
judge's message (`judge.template`), a rollout engine serving the judge model (our own
`RolloutEngine`: vLLM, placed by the plan like any engine) writes a verdict, and a parser turns it
into the sample's part of the reward (`rlactors.reward.parts`: `weight * value`, the value in
`score_details["reward_parts"][name]`, the judge's output in `score_details["reward_outputs"][name]`).

    verdicts = judge_verdicts(engine, judge_tokenizer, verdict_parser(judge.verdict), items, judge)

Verdicts (`judge.verdict`): "score" takes the output's last `score: N` (or `score = N`, any case,
markdown bold allowed), "brackets" its last `[[N]]`; anything else names a user function
(`module:function` or `path/to/file.py:function`) that takes the output text and returns a number.
An output without a verdict, a parser that raises or returns no finite number, a message the judge
engine refuses (longer than `judge.max_model_len`) or no answer within `judge.call_timeout_s`: the
sample scores 0 with `score_error` naming it and holding the judge's output; the batch goes on.
"""

from __future__ import annotations

import math
import numbers
import re
import time
from collections.abc import Callable

import ray

from rlactors.config import SamplingConfig
from rlactors.config.reward_model import JudgeConfig
from rlactors.reward.parts import Verdict, Where
from rlactors.reward.scoring import load_user_function
from rlactors.runtime.calls import error_text
from rlactors.types import PromptRequest

__all__ = ["judge_message", "judge_verdicts", "read_verdict", "verdict_parser"]

PLACEHOLDER = re.compile(r"\{(prompt|response|ground_truth)\}")
NUMBER = r"(-?\d+(?:\.\d+)?)"
BUILT_IN = {
    "score": (re.compile(r"score\s*\**\s*[:=]\s*\**\s*" + NUMBER, re.IGNORECASE), "'score: N'"),
    "brackets": (re.compile(r"\[\[\s*" + NUMBER + r"\s*\]\]"), "'[[N]]'"),
}
MAX_OUTPUT_CHARS_IN_ERROR = 500


def judge_message(template: str, prompt: str, response: str, ground_truth: str) -> str:
    """The template with {prompt}, {response} and {ground_truth} filled in, in one pass (a response
    that writes "{prompt}" stays as written; other braces in the template are kept)."""
    values = {"prompt": prompt, "response": response, "ground_truth": ground_truth}
    return PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def verdict_parser(spec: str) -> Callable[[str], float]:
    """The function from a judge's output to its value (see the module doc); it raises ValueError
    when the output holds no verdict."""
    if spec in BUILT_IN:
        pattern, what = BUILT_IN[spec]

        def parse(output: str) -> float:
            found = pattern.findall(output)
            if not found:
                raise ValueError(f"no verdict ({what}) in the judge's output")
            return float(found[-1])

        return parse
    function = load_user_function(spec)

    def parse_with_user_function(output: str) -> float:
        value = function(output)
        # Any real number (numpy's too), but not a bool: True is no rating.
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"verdict function {spec} returned {value!r}, not a finite number")
        return float(value)

    return parse_with_user_function


def read_verdict(parse: Callable[[str], float], output: str) -> Verdict:
    try:
        return Verdict(parse(output), output=output)
    except Exception as error:  # noqa: BLE001 - recorded on the sample, with the output
        return Verdict(error=f"{error_text(error, max_chars=300)}; output: {output[:MAX_OUTPUT_CHARS_IN_ERROR]!r}",
                       output=output)


def judge_verdicts(engine, tokenizer, parse: Callable[[str], float], items: list, judge: JudgeConfig
                   ) -> dict[Where, Verdict]:
    """A Verdict per item (`rlactors.reward.parts.samples_to_score`): the judge engine's output for
    the sample's message, read by `parse` (see the module doc for what fails a sample)."""
    # Ids of this call alone: a call retried after a restart never meets the first one's requests.
    call = f"judge/{time.time_ns()}"
    requests = []
    for n, (where, prompt, request, sample) in enumerate(items):
        message = judge_message(judge.template, prompt, sample.text, request.ground_truth)
        text = (tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                              add_generation_prompt=True) if judge.chat_template else message)
        requests.append((where, PromptRequest(f"{call}/{n}", tokenizer(text, add_special_tokens=False)["input_ids"])))
    sampling = SamplingConfig(num_samples_per_prompt=1, temperature=judge.temperature,
                              max_response_tokens=judge.max_response_tokens)
    outputs = _generate(engine, [request for _, request in requests], sampling, judge.call_timeout_s)
    verdicts = {}
    for where, request in requests:
        output = outputs.get(request.group_id)
        if output is None:
            verdicts[where] = Verdict(error=f"the judge gave no verdict within {judge.call_timeout_s:g} s "
                                            f"(reward.models[].judge.call_timeout_s)")
        elif isinstance(output, Exception):
            verdicts[where] = Verdict(error=error_text(output, max_chars=500))
        else:
            verdicts[where] = output if isinstance(output, Verdict) else read_verdict(parse, output)
    return verdicts


def _generate(engine, requests: list[PromptRequest], sampling: SamplingConfig,
              timeout_s: float) -> dict[str, str | Verdict | Exception]:
    """{group_id: the judge's output text, or a Verdict holding the engine's error for that message,
    or the error that ended the engine's stream}; a request not answered within `timeout_s` is
    missing (it is aborted)."""
    if not requests:
        return {}
    found: dict[str, str | Verdict | Exception] = {}
    deadline = time.monotonic() + timeout_s
    stream = engine.generate.remote(requests, sampling)
    try:
        while len(found) < len(requests):
            ready, _ = ray.wait([stream], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                engine.abort.remote([r.group_id for r in requests if r.group_id not in found])
                break
            group = ray.get(next(stream), timeout=max(1.0, deadline - time.monotonic()))
            sample = group.samples[0]
            found[group.group_id] = Verdict(error=sample.error) if sample.error else sample.text
    except StopIteration:
        pass
    except ray.exceptions.RayError as error:  # the engine died or refused the call: every unanswered sample
        found |= {r.group_id: error for r in requests if r.group_id not in found}
    return found
