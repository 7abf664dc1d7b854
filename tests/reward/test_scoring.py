"""Table-driven tests of the pure scoring functions (no Ray)."""

from __future__ import annotations

import math

import pytest

from rlactors.reward.scoring import (
    MAX_ANSWER_CHARS,
    check_score,
    compute_arithmetic_score,
    compute_gsm8k_score,
    compute_math_score,
    compute_sequence_score,
    default_compute_score,
    extract_gsm8k_answer,
    extract_leading_integer,
    extract_math_answer,
    last_boxed_content,
    load_user_function,
    overlong_penalty,
)

GARBAGE = ("x7}{\\boxed{ ####" * 70_000)[:1_000_000]  # 1 MB, with unbalanced braces and markers

# --------------------------------------------------------------------------------------------
# GSM8K

GSM8K_EXTRACT = [
    # (mode, text, expected extraction)
    ("strict", "so she has 72 left.\n#### 72", "72"),
    ("strict", "#### 1,000", "1000"),
    ("strict", "#### $1,234.50", "1234.50"),
    ("strict", "#### -5", "-5"),
    ("strict", "first #### 3 then #### 4", "4"),
    ("strict", "The answer is 72.", None),
    ("strict", "", None),
    ("strict", "答案是 #### 42 元", "42"),
    ("flexible", "The answer is 72.", "72"),
    ("flexible", "It costs $1,000 in total", "1000"),
    ("flexible", "from 3.5 down to -2.", "-2"),
    ("flexible", "1, 2, 3", "3"),
    ("flexible", "1,00", "1"),  # not a thousands grouping
    ("flexible", "no digits at all", None),
    ("flexible", "", None),
    ("flexible", "总共 ４２ 个, 即 42", "42"),
]


@pytest.mark.parametrize("mode,text,expected", GSM8K_EXTRACT)
def test_extract_gsm8k_answer(mode, text, expected):
    assert extract_gsm8k_answer(text, mode) == expected


GSM8K_SCORES = [
    # (mode, response, ground truth, acc)
    ("strict", "#### 72", "72", True),
    ("strict", "#### 72.00", "72", True),
    ("strict", "#### 73", "72", False),
    ("strict", "#### 1,000", "1000", True),
    ("strict", "#### 1000", "1,000", True),
    ("strict", "#### -3", "3", False),
    ("strict", "#### -3", "-3", True),
    ("strict", "The answer is 72", "72", False),  # strict needs ####
    ("flexible", "The answer is 72", "72", True),
    ("strict", "#### 18", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = 18\n#### 18", True),
    ("strict", "", "72", False),
    ("flexible", GARBAGE, "7", True),  # the last number in the garbage is 7
    ("strict", GARBAGE, "7", False),
]


@pytest.mark.parametrize("mode,response,ground_truth,acc", GSM8K_SCORES)
def test_gsm8k_score(mode, response, ground_truth, acc):
    result = compute_gsm8k_score(response, ground_truth, mode)
    assert result["acc"] is acc
    assert result["score"] == float(acc)


def test_gsm8k_bad_ground_truth_and_mode():
    with pytest.raises(ValueError, match="not a number"):
        compute_gsm8k_score("#### 3", "three")
    with pytest.raises(ValueError, match="strict"):
        extract_gsm8k_answer("#### 3", "loose")


# --------------------------------------------------------------------------------------------
# MATH

BOXED = [
    (r"so $\boxed{\frac{3}{4}}$.", r"\frac{3}{4}"),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not nest
    (r"\boxed{a \\ {b}}", r"a \\ {b}"),  # a LaTeX line break before a brace
    (r"\fbox{x{y}z}", "x{y}z"),
    (r"\boxed 5$ done", "5"),
    (r"\boxed {7}", "7"),
    (r"\boxed{1} and later \boxed{2}", "2"),
    (r"\boxed{1} then a cut-off \boxed{\frac{2", None),
    (r"\boxedx", None),
    ("", None),
    ("no box", None),
    (r"\boxed{π ≈ 3}", "π ≈ 3"),
]


@pytest.mark.parametrize("text,expected", BOXED)
def test_last_boxed_content(text, expected):
    assert last_boxed_content(text) == expected


def test_answer_line_when_no_box():
    assert extract_math_answer("work...\nAnswer: $42$.") == "42"
    assert extract_math_answer("answer: 7\nANSWER: 8") == "8"
    assert extract_math_answer("Answer:") is None
    assert extract_math_answer(r"Answer: 3 but \boxed{4}") == "4"  # the boxed answer wins


MATH_SCORES = [
    # (response, ground truth, acc)
    (r"The answer is $\boxed{\frac{3}{4}}$.", r"\frac{3}{4}", True),
    (r"$\boxed{3/4}$", r"\frac{3}{4}", True),
    (r"$\boxed{\dfrac{3}{4}}$", r"\frac{3}{4}", True),
    (r"$\boxed{0.75}$", r"\frac34", True),
    (r"$\boxed{0.5}$", r"\frac12", True),
    (r"$\boxed{\frac{6}{8}}$", r"\frac{3}{4}", True),
    (r"$\boxed{\frac{4}{3}}$", r"\frac{3}{4}", False),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}/2", True),
    (r"\boxed{(1, 2]}", r"(1,2]", True),
    (r"\boxed{[1, 2]}", r"(1,2]", False),
    (r"\boxed{90^\circ}", "90", True),
    (r"\boxed{5 \text{ cm}}", "5", True),
    (r"\boxed{1,000}", "1000", True),
    (r"\boxed{-3}", "-3", True),
    (r"\boxed{-3}", "3", False),
    (r"\boxed{\{2, 1\}}", r"\{1,2\}", True),
    (r"\fbox{12}", "12", True),
    ("Answer: 12", "12", True),
    (r"Answer: \frac{1}{2}", "0.5", True),
    (r"no final answer, 12", "12", False),
    ("", "12", False),
    (r"\boxed{}", "12", False),
    (r"\boxed{١٢}", "12", False),  # Arabic-Indic digits are not read as 12
    (r"答案是 \boxed{12}", "12", True),
    (
        r"the solution... so \boxed{\frac{1}{2}}",
        r"Since ... we get $\boxed{\frac12}$.",
        True,
    ),  # full gold solution
    (GARBAGE, "7", False),
    (r"\boxed{" + "1+" * 5000 + "1}", "5001", False),  # over MAX_ANSWER_CHARS: wrong without parsing
]


@pytest.mark.parametrize("response,ground_truth,acc", MATH_SCORES)
def test_math_score(response, ground_truth, acc):
    result = compute_math_score(response, ground_truth)
    assert result["acc"] is acc
    assert result["score"] == float(acc)
    assert result["pred"] is None or len(result["pred"]) <= MAX_ANSWER_CHARS + len("...(truncated)")


def test_math_score_reports_pred_and_rejects_empty_gold():
    assert compute_math_score(r"\boxed{\dfrac{1}{2}}", "0.5")["pred"] == r"\dfrac{1}{2}"
    with pytest.raises(ValueError, match="no answer"):
        compute_math_score(r"\boxed{1}", "  ")


# --------------------------------------------------------------------------------------------
# Arithmetic

ARITHMETIC = [
    # (response after the prompt, leading integer or None)
    ("82", 82),
    (" 82", 82),
    ("82\n37+45=82", 82),
    ("82.", 82),  # a sentence-final period
    ("82 is the answer", 82),
    ("820", 820),
    ("082", 82),
    ("-3", -3),
    ("82.5", None),
    ("+82", None),
    ("1,000", 1),
    ("eighty-two", None),
    ("８２", None),  # full-width digits are not accepted
    ("", None),
    ("\n", None),
]


@pytest.mark.parametrize("response,expected", ARITHMETIC)
def test_extract_leading_integer(response, expected):
    assert extract_leading_integer(response) == expected


@pytest.mark.parametrize(
    "response,ground_truth,acc",
    [
        ("82", "82", True),
        ("82", " 82 ", True),
        ("820", "82", False),
        ("8", "82", False),
        ("-3", "-3", True),
        ("", "82", False),
        (GARBAGE, "82", False),
    ],
)
def test_arithmetic_score(response, ground_truth, acc):
    assert compute_arithmetic_score(response, ground_truth) == {
        "score": float(acc),
        "acc": acc,
        "pred": extract_leading_integer(response),
    }


def test_arithmetic_bad_ground_truth():
    with pytest.raises(ValueError, match="not an integer"):
        compute_arithmetic_score("82", "82.0")


# --------------------------------------------------------------------------------------------
# Sequences (countdown)


@pytest.mark.parametrize(
    "response,ground_truth,score,acc",
    [
        ("03,02,01", "03,02,01", 1.0, True),
        (" 03,02,01\n", "03,02,01", 1.0, True),  # surrounding whitespace is not the answer
        ("03,02", "03,02,01", 5 / 8, False),  # cut short: the matching prefix, over the answer's length
        ("03,02,01,00", "03,02,01", 8 / 11, False),  # run on: over the response's length
        ("03,12,01", "03,02,01", 7 / 8, False),  # one wrong character
        ("02,01", "03,02,01", 3 / 8, False),  # a skipped number: only separators and tens digits align
        ("", "03,02,01", 0.0, False),
        (GARBAGE, "03,02,01", 0.0, False),
    ],
)
def test_sequence_score(response, ground_truth, score, acc):
    assert compute_sequence_score(response, ground_truth) == {"score": pytest.approx(score), "acc": acc}


def test_sequence_score_rejects_empty_ground_truth():
    with pytest.raises(ValueError, match="empty"):
        compute_sequence_score("01", " ")


# --------------------------------------------------------------------------------------------
# Dispatch


@pytest.mark.parametrize(
    "data_source,response,ground_truth",
    [
        ("openai/gsm8k", "#### 5", "5"),
        ("synthetic/gsm8k", "#### 5", "5"),
        ("DigitalLearningGmbH/MATH-lighteval", r"\boxed{5}", "5"),
        ("HuggingFaceH4/MATH-500", r"\boxed{5}", "5"),
        ("math_dapo", "Answer: 5", "5"),
        ("aime24", r"\boxed{5}", "5"),
        ("AIME2025", r"\boxed{5}", "5"),
        ("synthetic/math", r"\boxed{5}", "5"),
        ("synthetic/arithmetic", "5", "5"),
        ("synthetic/countdown", "02 01", "02 01"),
    ],
)
def test_dispatch_by_data_source(data_source, response, ground_truth):
    assert default_compute_score(data_source, response, ground_truth)["acc"] is True
    assert default_compute_score(data_source, "", ground_truth)["acc"] is False


def test_dispatch_gsm8k_mode_and_unknown_source():
    assert default_compute_score("openai/gsm8k", "it is 5", "5")["acc"] is False
    assert default_compute_score("openai/gsm8k", "it is 5", "5", gsm8k_mode="flexible")["acc"] is True
    with pytest.raises(ValueError, match="'my/dataset'.*custom_function"):
        default_compute_score("my/dataset", "5", "5")


# --------------------------------------------------------------------------------------------
# DAPO overlong shaping

OVERLONG = [
    # (length, max, buffer, factor, penalty)
    (0, 16, 4, 1.0, 0.0),
    (12, 16, 4, 1.0, 0.0),  # exactly max - buffer: no penalty yet
    (13, 16, 4, 1.0, -0.25),
    (14, 16, 4, 1.0, -0.5),
    (16, 16, 4, 1.0, -1.0),
    (16, 16, 4, 0.5, -0.5),
    (4096, 4096, 1024, 1.0, -1.0),
    (3584, 4096, 1024, 1.0, -0.5),
    (8, 8, 8, 1.0, -1.0),
]


@pytest.mark.parametrize("length,max_tokens,buffer,factor,penalty", OVERLONG)
def test_overlong_penalty(length, max_tokens, buffer, factor, penalty):
    assert overlong_penalty(length, max_tokens, buffer, factor) == pytest.approx(penalty)


@pytest.mark.parametrize("buffer", [0, 17])
def test_overlong_penalty_bad_buffer(buffer):
    with pytest.raises(ValueError, match="buffer_tokens"):
        overlong_penalty(10, 16, buffer, 1.0)


# --------------------------------------------------------------------------------------------
# Return values and user functions

CHECKS = [
    (1, (1.0, {})),
    (True, (1.0, {})),
    (0.25, (0.25, {})),
    ({"score": 1, "acc": True, "pred": "5"}, (1.0, {"acc": True, "pred": "5"})),
    ({"score": 0.5, "weird": {1, 2}}, (0.5, {"weird": "{1, 2}"})),  # non-plain details become text
]


@pytest.mark.parametrize("result,expected", CHECKS)
def test_check_score(result, expected):
    assert check_score(result) == expected


@pytest.mark.parametrize(
    "result,error,match",
    [
        (math.nan, ValueError, "nan"),
        (math.inf, ValueError, "inf"),
        ("1.0", TypeError, "str"),
        (None, TypeError, "NoneType"),
        ({"acc": True}, TypeError, "no 'score'"),
        ({"score": math.nan}, ValueError, "nan"),
        ({"score": 1.0, 3: "x"}, TypeError, "key 3"),
    ],
)
def test_check_score_rejects(result, error, match):
    with pytest.raises(error, match=match):
        check_score(result)


def test_load_user_function_from_file_and_module(tmp_path, monkeypatch):
    source = (
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str == ground_truth), 'source': data_source}\n"
    )
    (tmp_path / "my_rewards.py").write_text(source)
    from_file = load_user_function(f"{tmp_path / 'my_rewards.py'}:compute_score")
    assert from_file("d", "a", "a") == {"score": 1.0, "source": "d"}
    monkeypatch.syspath_prepend(str(tmp_path))
    from_module = load_user_function("my_rewards:compute_score")
    assert from_module("d", "a", "b")["score"] == 0.0


@pytest.mark.parametrize(
    "spec,error,match",
    [
        ("no_colon", ValueError, "expected 'module:function'"),
        ("json:", ValueError, "expected"),
        ("json:not_there", AttributeError, "no callable 'not_there'"),
        ("json:__doc__", AttributeError, "no callable"),
        ("does/not/exist.py:f", FileNotFoundError, "no file"),
        ("no_such_module_xyz:f", ModuleNotFoundError, "no_such_module_xyz"),
    ],
)
def test_load_user_function_errors(spec, error, match):
    with pytest.raises(error, match=match):
        load_user_function(spec)
