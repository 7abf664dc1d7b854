"""Scoring functions: pure Python, no Ray, veRL's signature.

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

A dict carries `score` plus extra fields (`acc`, `pred`, ...). `default_compute_score` picks the
scorer from `data_source`; a user function with the same signature replaces it everywhere
(`load_user_function("my_rewards.py:compute_score")`).

Each returns within a few seconds on any input, in any thread: the math scorer refuses answers
too long, too deeply nested or too explosive to evaluate (`9^{9^{9^9}}`, `(10^{10})!`), and gives
math-verify a deadline that needs no signal (`rlactors.reward.limits`); such an answer scores 0 with
the reason in `unchecked`. A user function has no such bound: the scorer actor
(`rlactors.reward.scorer`) runs every function in a subprocess it kills past `reward.timeout_s`.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from rlactors.reward.limits import DeadlineExceeded, call_within, explosion_reason, nesting_reason
from rlactors.runtime.user_code import load_object

GSM8K_SOURCES = frozenset({"openai/gsm8k", "synthetic/gsm8k"})
MATH_SOURCES = frozenset(
    {
        "DigitalLearningGmbH/MATH-lighteval",
        "lighteval/MATH",
        "HuggingFaceH4/MATH-500",
        "math_dapo",
        "synthetic/math",
    }
)
ARITHMETIC_SOURCES = frozenset({"synthetic/arithmetic"})
SEQUENCE_SOURCES = frozenset({"synthetic/countdown"})

# Longer extracted answers are scored wrong without parsing: no real answer is this long, and
# handing megabytes of garbage to sympy is how a scorer hangs.
MAX_ANSWER_CHARS = 1000
# Parsing and comparing two answers normally takes milliseconds; past this math-verify is stuck.
MATH_VERIFY_TIMEOUT_S = 3.0

# --------------------------------------------------------------------------------------------
# GSM8K

# A number as written in GSM8K answers: optional minus and dollar sign, digits with optional
# thousands commas (1,000 but not 1,00), optional decimals. Sentence-final periods are not decimals.
_GSM8K_NUMBER = r"-?\$?\s?-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_GSM8K_STRICT = re.compile(r"####\s*(" + _GSM8K_NUMBER + ")")
_GSM8K_ANY = re.compile(r"(?<![\d.,])(" + _GSM8K_NUMBER + ")")


def _parse_number(text: str) -> Decimal | None:
    cleaned = re.sub(r"[\s,$]", "", text)
    if cleaned.count("-") > 1:
        return None
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def extract_gsm8k_answer(solution_str: str, mode: str = "strict") -> str | None:
    """Strict: the number after the last `####`. Flexible: the last number in the text.
    Returns the number with commas and `$` removed, or None."""
    if mode == "strict":
        matches = _GSM8K_STRICT.findall(solution_str)
    elif mode == "flexible":
        matches = _GSM8K_ANY.findall(solution_str)
    else:
        raise ValueError(f"gsm8k mode must be 'strict' or 'flexible', got {mode!r}")
    return re.sub(r"[\s,$]", "", matches[-1]) if matches else None


def compute_gsm8k_score(solution_str: str, ground_truth: str, mode: str = "strict") -> dict:
    """1.0 when the extracted number equals the ground truth numerically (72 == 72.0 == 72.00).
    A ground truth holding a full solution (`... #### 72`) is reduced to its final number."""
    if "####" in ground_truth:
        ground_truth = ground_truth.rsplit("####", 1)[1]
    gold = _parse_number(ground_truth.strip())
    if gold is None:
        raise ValueError(f"gsm8k ground truth is not a number: {ground_truth!r}")
    pred = extract_gsm8k_answer(solution_str, mode)
    value = _parse_number(pred) if pred is not None else None
    acc = value is not None and value == gold
    return {"score": float(acc), "acc": acc, "pred": pred}


# --------------------------------------------------------------------------------------------
# MATH


# A backslash with the character after it (\{ and \} do not nest), or a brace.
_BRACE_OR_ESCAPE = re.compile(r"\\.|[{}]", re.DOTALL)


def last_boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` (braces balanced, `\\{` `\\}` are literal),
    or of `\\boxed 5` (up to the next `$`). None when absent or unclosed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    after_command = start + (6 if text.startswith("\\boxed", start) else 5)
    i = after_command
    while i < len(text) and text[i].isspace():
        i += 1
    if i == len(text) or text[i] != "{":
        if i > after_command:  # `\boxed 5`: the answer runs to the closing `$`
            return text[i:].split("$", 1)[0].strip() or None
        return None
    depth = 0
    for match in _BRACE_OR_ESCAPE.finditer(text, i):  # jumps over plain text: linear and fast
        token = match.group()
        if token == "{":
            depth += 1
        elif token == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : match.start()]
    return None


_ANSWER_LINE = re.compile(r"answer\s*:\s*(.*)", re.IGNORECASE)


def extract_math_answer(solution_str: str) -> str | None:
    """The last boxed answer; failing that, the rest of the last `Answer:` line (DAPO's format)."""
    boxed = last_boxed_content(solution_str)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(solution_str)
    if lines:
        answer = lines[-1].strip().removesuffix(".").strip().strip("$").strip()
        return answer or None
    return None


class _DropTimeoutDisabledWarning(logging.Filter):
    # math-verify warns once that its signal alarm is off; here that is deliberate (see module doc).
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


# Pairs that make math-verify import the sympy modules it loads lazily (simplify, solve, sets),
# once, before any deadline: an import cut short by the deadline would be retried, but slowly.
_WARM_UP = (("\\frac{1}{2}", "0.5"), ("(x+1)^2", "x^2+2x+1"), ("x=1", "1"), ("(1,2]", "\\{1,2\\}"))
_warmed_up = False


def _math_verify():
    global _warmed_up
    import math_verify  # imported on first use: sympy takes ~0.4 s to import

    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTimeoutDisabledWarning) for f in logger.filters):
            logger.addFilter(_DropTimeoutDisabledWarning())
    if not _warmed_up:
        _warmed_up = True
        for gold, pred in _WARM_UP:
            math_verify.verify(_parse_latex(gold), _parse_latex(pred), timeout_seconds=None)
    return math_verify


def _parse_latex(answer: str) -> list:
    math_verify = _math_verify()
    return math_verify.parse(
        "$" + answer + "$", extraction_config=[math_verify.LatexExtractionConfig()], parsing_timeout=None
    )


def math_answers_equal(gold: str, pred: str) -> bool:
    """math-verify equivalence of two LaTeX answers: 3/4 == \\frac{3}{4} == 0.75, intervals,
    sets; units (`\\text{ cm}`) and degrees (`^\\circ`) are stripped. Answers that cannot be
    checked within a few seconds are unequal (see `compare_math_answers`)."""
    return compare_math_answers(gold, pred)[0]


def compare_math_answers(gold: str, pred: str) -> tuple[bool, str | None]:
    """(equal, why the prediction could not be checked or None). A prediction over
    MAX_ANSWER_CHARS, nested too deeply or too explosive to evaluate, or whose comparison runs past
    MATH_VERIFY_TIMEOUT_S, is unequal. A gold answer nested too deeply or too explosive is a
    ValueError: no prediction could be checked against it."""
    if not gold.strip() or not pred.strip():
        return False, None
    if len(pred) > MAX_ANSWER_CHARS:
        return False, f"answer longer than {MAX_ANSWER_CHARS} characters"
    reason = nesting_reason(gold)
    if reason is not None:
        raise ValueError(f"math ground truth {gold[:200]!r} cannot be checked: {reason}")
    reason = nesting_reason(pred)
    if reason is not None:
        return False, f"answer not parsed: {reason}"
    math_verify = _math_verify()  # imported (and warmed up) outside the deadline

    def parse_and_verify() -> tuple[bool, str | None]:
        gold_parsed, pred_parsed = _parse_latex(gold), _parse_latex(pred)
        for item in gold_parsed:
            reason = explosion_reason(item)
            if reason is not None:
                raise ValueError(f"math ground truth {gold[:200]!r} cannot be checked: {reason}")
        if not gold_parsed or not pred_parsed:
            return False, None
        for item in pred_parsed:
            reason = explosion_reason(item)
            if reason is not None:
                return False, f"answer not evaluated: {reason}"
        return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None)), None

    try:
        return call_within(parse_and_verify, MATH_VERIFY_TIMEOUT_S)
    except DeadlineExceeded:
        return False, f"comparison took over {MATH_VERIFY_TIMEOUT_S} s"


def compute_math_score(solution_str: str, ground_truth: str) -> dict:
    """1.0 when the last boxed answer (or `Answer:` line) is equivalent to the ground truth.
    A ground truth holding a full solution is reduced to its last boxed answer. An answer that
    could not be checked scores 0 and says why in `unchecked`."""
    gold = last_boxed_content(ground_truth) if "\\boxed" in ground_truth else ground_truth
    if gold is None or not gold.strip():
        raise ValueError(f"math ground truth has no answer: {ground_truth[:200]!r}")
    pred = extract_math_answer(solution_str)
    acc, unchecked = compare_math_answers(gold, pred) if pred is not None else (False, None)
    if pred is not None and len(pred) > MAX_ANSWER_CHARS:
        pred = pred[:MAX_ANSWER_CHARS] + "...(truncated)"
    result = {"score": float(acc), "acc": acc, "pred": pred}
    if unchecked is not None:
        result["unchecked"] = unchecked
    return result


# --------------------------------------------------------------------------------------------
# Arithmetic (`37+45=` -> `82`)

MAX_INTEGER_DIGITS = 4300  # Python's default limit on int() of a string
_LEADING_INTEGER = re.compile(r"\s*(-?[0-9]+)(\.[0-9])?")


def extract_leading_integer(response: str) -> int | None:
    """The integer the response starts with, or None.

    Accepted: optional leading whitespace, an optional `-`, ASCII digits; whatever follows the
    digits is ignored (`82`, ` 82`, `82\\n37+45=` all read 82), except a decimal point followed by
    a digit (`82.5` is not an integer: None). Not accepted: `+82`, thousands commas (`1,000` reads
    1), non-ASCII digits, words, integers of over MAX_INTEGER_DIGITS digits. Leading zeros are
    read as the value (`082` reads 82)."""
    match = _LEADING_INTEGER.match(response)
    if match is None or match.group(2) is not None:
        return None
    digits = match.group(1).lstrip("-").lstrip("0")
    if len(digits) > MAX_INTEGER_DIGITS:  # int() refuses such strings (and they equal no answer)
        return None
    return int(match.group(1))


def compute_arithmetic_score(solution_str: str, ground_truth: str) -> dict:
    """1.0 when the response's leading integer equals the integer ground truth."""
    try:
        gold = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"arithmetic ground truth is not an integer: {ground_truth!r}") from None
    pred = extract_leading_integer(solution_str)
    acc = pred is not None and pred == gold
    return {"score": float(acc), "acc": acc, "pred": pred}


# --------------------------------------------------------------------------------------------
# Sequences (the countdown task)


def compute_sequence_score(solution_str: str, ground_truth: str) -> dict:
    """Partial credit for writing out a long exact answer: the characters equal to the ground
    truth's at the same position, over the longer of the two lengths, so a response cut short, run
    on or wrong in places keeps a share (RL needs that signal: long answers are rarely all right).
    `acc` is the exact match. One pass, O(length): it scores hundreds of long responses a step."""
    gold = str(ground_truth).strip()
    if not gold:
        raise ValueError("sequence ground truth is empty")
    response = solution_str.strip()
    matching = sum(a == b for a, b in zip(response, gold, strict=False))  # the shorter one's length
    return {"score": matching / max(len(response), len(gold)), "acc": response == gold}


# --------------------------------------------------------------------------------------------
# Dispatch, DAPO overlong shaping, user functions, result checking


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    gsm8k_mode: str = "strict",
) -> dict:
    """Score one response with the scorer for its `data_source`; unknown sources are an error."""
    if data_source in GSM8K_SOURCES:
        return compute_gsm8k_score(solution_str, ground_truth, gsm8k_mode)
    if data_source in MATH_SOURCES or data_source.lower().startswith("aime"):
        return compute_math_score(solution_str, ground_truth)
    if data_source in ARITHMETIC_SOURCES:
        return compute_arithmetic_score(solution_str, ground_truth)
    if data_source in SEQUENCE_SOURCES:
        return compute_sequence_score(solution_str, ground_truth)
    known = sorted(GSM8K_SOURCES | MATH_SOURCES | ARITHMETIC_SOURCES | SEQUENCE_SOURCES) + ["aime*"]
    raise ValueError(
        f"no scorer for data_source {data_source!r}; known: {', '.join(known)}; "
        "set reward.custom_function for others"
    )


def overlong_penalty(
    num_response_tokens: int, max_response_tokens: int, buffer_tokens: int, penalty_factor: float
) -> float:
    """DAPO's soft overlong punishment, added to the score: 0 up to `max - buffer` tokens, then
    falling linearly to `-penalty_factor` at `max_response_tokens`."""
    if not 0 < buffer_tokens <= max_response_tokens:
        raise ValueError(
            f"buffer_tokens must be in 1..max_response_tokens ({max_response_tokens}), got {buffer_tokens}"
        )
    expected_tokens = max_response_tokens - buffer_tokens
    return min(-(num_response_tokens - expected_tokens) / buffer_tokens * penalty_factor, 0.0)


def load_user_function(spec: str) -> Callable[..., Any]:
    """`package.module:function` (importable) or `path/to/file.py:function`."""
    return load_object(spec, "reward function", module_prefix="_rlactors_user_reward_")


def _plain(value: Any) -> Any:
    # Details travel through pickles to other actors and into metrics: keep them plain.
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return repr(value)


def check_score(result: Any) -> tuple[float, dict[str, Any]]:
    """(score, details) from a scorer's return value; raises on a wrong type, a dict without a
    real `score`, or a score that is NaN or infinite."""
    details: dict[str, Any] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise TypeError(f"score dict has no 'score' key (keys: {sorted(map(str, result))})")
        for key, value in result.items():
            if not isinstance(key, str):
                raise TypeError(f"score dict key {key!r} is not a string")
            if key != "score":
                details[key] = _plain(value)
        result = result["score"]
    if not isinstance(result, numbers.Real):
        raise TypeError(f"score must be a real number or a dict with 'score', got {type(result).__name__}")
    score = float(result)
    if not math.isfinite(score):
        raise ValueError(f"score is {score}")
    return score, details
