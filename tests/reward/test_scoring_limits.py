"""The scoring functions return within seconds on adversarial answers, called directly (no scorer
actor, no subprocess kill). The inputs run in a child process the test kills when one hangs, so a
regression fails its own case instead of hanging the suite."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from rlactors.reward.limits import DeadlineExceeded, call_within, explosion_reason, nesting_reason

HANG_GUARD_S = 30.0  # per input; a bounded input takes at most a few seconds, a regression minutes

MATH = "HuggingFaceH4/MATH-500"
ADVERSARIAL = {
    # name: (data_source, response, ground truth)
    "power tower": (MATH, r"\boxed{9^{9^{9^{9}}}}", "5"),
    "power of a power": (MATH, r"\boxed{10^{10^{10}}}", "5"),
    "negative power tower": (MATH, r"\boxed{2^{-9^{9^{9}}}}", "0"),
    "rational power tower": (MATH, r"\boxed{\left(\frac{1}{2}\right)^{10^{12}}}", "0"),
    "huge factorial": (MATH, r"\boxed{(10^{10})!}", "5"),
    "huge binomial": (MATH, r"\boxed{\binom{10^{9}}{10^{8}}}", "5"),
    "huge product": (MATH, r"\boxed{\prod_{k=1}^{10^{9}} k}", "5"),
    "huge sum": (MATH, r"\boxed{\sum_{k=1}^{10^{7}} \frac{1}{k}}", "5"),
    "polynomial blow-up": (MATH, r"\boxed{(x+y+z)^{1000}}", "x+y+z"),
    "product blow-up": (MATH, r"\boxed{" + "".join(f"({a}+{b})" for a, b in zip("acegikmoqs", "bdfhjlnprt", strict=True)) + "}", "x+1"),
    "nested braces": (MATH, r"\boxed{" + "{" * 400 + "1" + "}" * 400 + "}", "2"),
    "nested parentheses": (MATH, r"\boxed{" + "(" * 30 + "1" + ")" * 30 + "}", "2"),
    "nested brackets": (MATH, r"\boxed{" + "[" * 25 + "1" + "]" * 25 + "}", "2"),
    "slow series": (MATH, r"\boxed{\sum_{k=1}^{\infty} \frac{\sin(k^2)}{k^3}}", "1"),
    "slow integral": (MATH, r"\boxed{\int_0^{\infty} e^{-x^{7}} \sin(x^{5}) dx}", "1"),
    "giant number": (MATH, r"\boxed{" + "9" * 999 + "}", "5"),
    "long answer line": (MATH, "Answer: " + "1+" * 495 + "1", "5"),
    "unclosed box, 20 MB": (MATH, r"\boxed{" + "x{" * 10_000_000, "5"),
    "many boxes": (MATH, r"\boxed{1}" * 200_000, "2"),
    "backslashes, 20 MB": (MATH, r"\boxed{" + "\\" * 20_000_000, "5"),
    "gsm8k strict, 20 MB number": ("openai/gsm8k", "#### " + "1" * 20_000_000, "5"),
    "gsm8k comma chain": ("openai/gsm8k", "#### " + "1" + ",111" * 3_000_000 + ",11", "5"),
    "arithmetic, 10 MB integer": ("synthetic/arithmetic", "1" * 10_000_000, "5"),
    "arithmetic, 5,000 digits": ("synthetic/arithmetic", "7" * 5000, "5"),
}

CHILD = """
import json, sys, time
from rlactors.reward import default_compute_score
from tests.reward.test_scoring_limits import ADVERSARIAL
for name in json.loads(sys.argv[1]):
    start = time.monotonic()
    result = default_compute_score(*ADVERSARIAL[name])
    print(json.dumps([name, result, time.monotonic() - start]), flush=True)
"""


def score_in_children(names: list[str]) -> dict[str, tuple[dict, float] | str]:
    """name -> (result, seconds), or the reason it has none. A child that goes quiet for
    HANG_GUARD_S is killed, its case recorded as hung, and a fresh child takes the rest."""
    outcomes: dict[str, tuple[dict, float] | str] = {}
    remaining = list(names)
    while remaining:
        child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(remaining)], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, cwd=str(_repo_root()))
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(child.stdout), daemon=True)  # noqa: B023
        reader.start()
        seen = 0
        deadline = time.monotonic() + HANG_GUARD_S + 20.0  # the first case also imports sympy
        while reader.is_alive() and time.monotonic() < deadline:
            if len(lines) > seen:
                seen, deadline = len(lines), time.monotonic() + HANG_GUARD_S
            time.sleep(0.05)
        child.kill()
        child.wait()
        reader.join(timeout=10)
        for line in lines:
            name, result, seconds = json.loads(line)
            outcomes[name] = (result, seconds)
        remaining = [name for name in remaining if name not in outcomes]
        if remaining:  # the first unanswered case hung or crashed its child
            outcomes[remaining.pop(0)] = f"no result within {HANG_GUARD_S} s (or the child crashed)"
    return outcomes


def _repo_root():
    from pathlib import Path

    return Path(__file__).parents[2]


@pytest.fixture(scope="module")
def outcomes():
    return score_in_children(list(ADVERSARIAL))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_answer_scores_wrong_within_seconds(outcomes, name):
    outcome = outcomes[name]
    assert not isinstance(outcome, str), f"{name}: {outcome}"
    result, seconds = outcome
    assert seconds < HANG_GUARD_S, (name, seconds)  # a hang guard: the child reports its own time
    assert result["score"] == 0.0 and result["acc"] is False, (name, result)


def test_refusals_say_why():
    from rlactors.reward import compute_math_score

    tower = compute_math_score(r"\boxed{9^{9^{9^{9}}}}", "5")
    assert tower["unchecked"].startswith("answer not evaluated: a power would have")
    nested = compute_math_score(r"\boxed{" + "{" * 40 + "1" + "}" * 40 + "}", "1")
    assert nested["unchecked"] == "answer not parsed: brackets nested 40 deep (limit 10)"
    assert "unchecked" not in compute_math_score(r"\boxed{\frac{6}{8}}", r"\frac34")


@pytest.mark.parametrize("gold", [r"9^{9^{9^{9}}}", "{" * 20 + "1" + "}" * 20])
def test_a_ground_truth_that_cannot_be_checked_is_an_error(gold):
    from rlactors.reward import compute_math_score

    with pytest.raises(ValueError, match="math ground truth .* cannot be checked"):
        compute_math_score(r"\boxed{5}", gold)


def test_nesting_and_explosion_limits_pass_normal_answers():
    from rlactors.reward.scoring import _parse_latex

    normal = [r"\frac{\sqrt{3}}{2}", r"\left(\frac{1}{2}, \frac{\sqrt{3}}{2}\right)", r"2^{64}", "10!",
              r"\binom{100}{50}", r"(x+1)^{20}", r"\sum_{k=1}^{100} k", r"\{1, 2\}", r"(1, 2]", r"x^{1000}"]
    for answer in normal:
        assert nesting_reason(answer) is None, answer
        for item in _parse_latex(answer):
            assert explosion_reason(item) is None, answer


def test_call_within_interrupts_python_code_in_any_thread():
    def busy():
        while True:
            pass

    outcome = []

    def in_thread():
        try:
            call_within(busy, 0.5)
        except DeadlineExceeded as error:
            outcome.append(str(error))

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join(timeout=60)
    assert outcome == ["took over 0.5 s"]
    with pytest.raises(DeadlineExceeded):
        call_within(busy, 0.5)  # the main thread too
    with pytest.raises(ZeroDivisionError):
        call_within(lambda: 1 / 0, 5.0)
    assert call_within(lambda: 42, 0.2) == 42
    time.sleep(0.5)  # the disarmed deadline fires into nothing afterwards
