"""CalculatorEnvironment: a "calc" (or "calculator") tool that evaluates arithmetic.

Each model turn with calls to the tool is answered with their results, one `=<result>\\n` per call
(see `rlactors.environments.common` for the rendering); the argument is `expression` (hermes) or
`input` (plain: `[calc 37*58]`). A turn without a tool call is the final answer: the episode is
done, with reward 1.0 when the turn's last number equals the ground truth (numerically), else 0.0.
Tool turns get reward 0.0, so an episode cut at the rollout's turn limit still has a reward.

An unknown tool, a malformed call or an expression that cannot be evaluated is answered with an
`error: ...` observation, never an exception.

Evaluation is safe: the expression is parsed with `ast` and only numbers, + - * / // % **, unary
+ and -, and parentheses are evaluated; exponents over MAX_EXPONENT, results of over MAX_DIGITS
digits and expressions over MAX_EXPRESSION_CHARS characters are refused.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from rlactors.environments.common import answer_calls, answer_reward, environment_settings
from rlactors.environments.protocol import StepResult, Turn

TOOL_NAMES = ("calc", "calculator")
MAX_EXPONENT = 100
MAX_DIGITS = 50
# Bounds the parser's work and recursion (deeply nested parentheses).
MAX_EXPRESSION_CHARS = 500

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculationError(ValueError):
    """An expression that is not plain arithmetic or whose value is refused."""


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise CalculationError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculationError("the result is too large")
    if abs(value) >= 10**MAX_DIGITS:
        raise CalculationError(f"the result has over {MAX_DIGITS} digits")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, not complex
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculationError(f"exponent {right} is over {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculationError("division by zero") from None
        except OverflowError:
            raise CalculationError("the result is too large") from None
    raise CalculationError(f"not arithmetic: {ast.unparse(node)[:80]!r}")


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculationError says why there is none."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculationError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculationError(f"cannot parse {expression[:80]!r}") from None
    try:
        return _evaluate(tree)
    except RecursionError:
        raise CalculationError("expression nested too deeply") from None


def format_number(value: int | float) -> str:
    """Integers as written; a float with an integral value without its `.0` (6/3 is `2`)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


class CalculatorEnvironment:
    def __init__(self, data_source: str = "", ground_truth: Any = None, extra_info: dict | None = None,
                 observation_prefix: str = "=", **ignored: Any) -> None:
        settings = environment_settings("calculator", {"observation_prefix": observation_prefix}, extra_info)
        self.ground_truth = ground_truth
        self.observation_prefix: str = settings["observation_prefix"]

    def reset(self) -> str:
        return ""

    def step(self, turn: Turn) -> StepResult:
        if not turn.tool_calls:
            return StepResult(reward=answer_reward(turn.text, self.ground_truth), done=True)
        return StepResult(observation=answer_calls(turn.tool_calls, TOOL_NAMES, self._calculate,
                                                   self.observation_prefix), reward=0.0)

    @staticmethod
    def _calculate(call) -> str:
        expression = call.arguments.get("expression", call.arguments.get("input"))
        if not isinstance(expression, str):
            return 'error: the calculator takes an "expression" string'
        try:
            return format_number(calculate(expression))
        except CalculationError as error:
            return f"error: {error}"
