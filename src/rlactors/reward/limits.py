"""Bounds that keep the math scorer's LaTeX parsing and sympy comparison to a few seconds on any input.

Three layers, cheapest first:

1. `nesting_reason(text)`: the LaTeX parser's prediction time grows exponentially with bracket
   nesting (a depth-14 `{{...}}` takes seconds, depth 20 minutes), so deeper answers are not parsed.
2. `explosion_reason(expr)`: a walk over the parsed (still unevaluated) sympy tree that refuses what
   sympy would turn into an enormous exact number (`9^{9^{9^9}}`, `(10^{10})!`, huge binomials,
   sums over millions of terms) or an enormous polynomial expansion (`(x+y+z)^{1000}`). Big-integer
   arithmetic runs inside C and cannot be interrupted, so these have to be refused before it starts.
3. `call_within(function, timeout_s)`: a deadline for whatever Python-level work is left (sympy's
   simplification, the parser). It raises `DeadlineExceeded` inside the calling thread (via
   `PyThreadState_SetAsyncExc`), so it works in any thread, unlike math-verify's SIGALRM, and it is
   a BaseException, so the `except Exception` blocks in sympy and math-verify do not swallow it.

Normal answers are far below every limit: their results are unchanged.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

# Deeper bracket nesting than any real answer; parsing stays under about a second at this depth.
MAX_NESTING_DEPTH = 10
# Exact numbers with more digits than this are never a real answer (9^{10^6}, ~10^6 digits, takes
# 0.2 s to compute; its comparisons more).
MAX_EXACT_DIGITS = 100_000
# Monomials a polynomial expansion may produce: simplify on ~1,000 terms takes seconds.
MAX_EXPANDED_TERMS = 500
# Terms a `\sum` or `\prod` with numeric limits may add up exactly (1,000 reciprocals: ~0.2 s).
MAX_SERIES_TERMS = 1_000
# Exponents above 10^15 are not even estimated: with a base other than 0 or +-1 they explode.
_MAX_ESTIMATED_LOG10 = 15.0
_LOG10_2 = math.log10(2)

_OPENERS = {"{": "}", "(": ")", "[": "]"}
_CLOSERS = frozenset(_OPENERS.values())

T = TypeVar("T")


def nesting_reason(text: str, max_depth: int = MAX_NESTING_DEPTH) -> str | None:
    """Why `text` is too deeply nested to parse (brackets `{ ( [`, escaped or not), or None."""
    depth = deepest = 0
    for char in text:
        if char in _OPENERS:
            depth += 1
            deepest = max(deepest, depth)
        elif char in _CLOSERS:
            depth = max(depth - 1, 0)  # unbalanced closers do not make the rest shallower than 0
    if deepest > max_depth:
        return f"brackets nested {deepest} deep (limit {max_depth})"
    return None


# --------------------------------------------------------------------------------------------
# The sympy tree walk


class _Refused(Exception):
    pass


def explosion_reason(expr: Any) -> str | None:
    """Why evaluating `expr` (a parsed, unevaluated sympy object; anything else passes) could take
    minutes or exhaust memory, or None. Looks at the tree only: nothing is evaluated."""
    from sympy import Basic
    from sympy.matrices import MatrixBase

    if not isinstance(expr, (Basic, MatrixBase)):
        return None
    try:
        _walk(expr, {})
    except _Refused as refusal:
        return str(refusal)
    except RecursionError:
        return "expression nested too deeply to inspect"
    return None


def _walk(expr: Any, seen: dict) -> tuple[float | None, float]:
    """(bound, log10 of terms) for `expr`. bound: an upper bound on log10 of the largest integer
    (numerator or denominator) an exact evaluation produces, None when `expr` is not an exact
    number (symbols, floats, pi); terms: an upper bound on the monomials of its expansion.
    Raises _Refused past a limit. `seen` memoizes shared subtrees."""
    key = id(expr)
    if key in seen:
        return seen[key]
    result = _walk_uncached(expr, seen)
    seen[key] = result
    return result


def _walk_uncached(expr: Any, seen: dict) -> tuple[float | None, float]:
    from sympy import Add, Float, Integer, Mul, Pow, Product, Rational, Sum
    from sympy.core.function import Application
    from sympy.matrices import MatrixBase

    if isinstance(expr, MatrixBase):
        for element in expr:
            _walk(element, seen)
        return None, 0.0
    if isinstance(expr, Integer):
        return _digits(int(expr)), 0.0
    if isinstance(expr, Rational):
        return max(_digits(int(expr.p)), _digits(int(expr.q))), 0.0
    if isinstance(expr, Float):
        return None, 0.0  # approximate: evaluated in floating point, never exactly
    children = [_walk(arg, seen) for arg in getattr(expr, "args", ())]
    bounds = [bound for bound, _ in children]
    exact = bool(children) and all(bound is not None for bound in bounds)
    if isinstance(expr, Add):
        return (sum(bounds) + 1.0 if exact else None), _log_sum([terms for _, terms in children])
    if isinstance(expr, Mul):
        return (sum(bounds) if exact else None), _expansion(sum(terms for _, terms in children), "a product")
    if isinstance(expr, Pow):
        return _power(expr, children)
    if isinstance(expr, (Sum, Product)):
        _check_series(expr, seen)
        return None, 0.0
    if isinstance(expr, Application) and exact:
        return _function(expr, bounds), 0.0
    return None, 0.0


def _digits(value: int) -> float:
    return math.log10(abs(value) + 1)  # exact for any int size; 0 only for 0


def _value(bound: float) -> float:
    """Upper bound on |x| from the bound on its digits."""
    return math.inf if bound > _MAX_ESTIMATED_LOG10 else 10.0**bound


def _exact_result(bound: float, what: str) -> float:
    if bound > MAX_EXACT_DIGITS:
        digits = "over 10^15" if math.isinf(bound) else f"about {bound:.3g}"
        raise _Refused(f"{what} would have {digits} digits (limit {MAX_EXACT_DIGITS})")
    return bound


def _power(expr: Any, children: list[tuple[float | None, float]]) -> tuple[float | None, float]:
    from sympy import Integer

    (base_bound, base_terms), (exponent_bound, _) = children
    base, exponent = expr.args
    if base_bound is not None and exponent_bound is not None:
        if base_bound == 0.0 or base in (Integer(1), Integer(-1)):  # 0, 1 or -1 to any power
            return 0.0, 0.0
        return _exact_result(_value(exponent_bound) * base_bound, "a power"), 0.0
    if exponent.is_Integer and int(exponent) > 1 and base_terms > 0.0:
        # (a + b + ...)^n expands into C(n + t - 1, t - 1) monomials for t terms in the base.
        num_terms = 10.0**min(base_terms, _MAX_ESTIMATED_LOG10)
        return None, _expansion(_log_binomial(int(exponent) + num_terms - 1, num_terms - 1), "a power")
    return None, base_terms


def _function(expr: Any, bounds: list[float]) -> float:
    """Bound for a function of exact numbers: combinatorial ones (factorial, binomial, fibonacci,
    bell, harmonic, ...) grow like n log n digits in their argument; others stay near their input."""
    module = getattr(expr.func, "__module__", "") or ""
    if not module.startswith(("sympy.functions.combinatorial", "sympy.ntheory")):
        return max(bounds) + 1.0
    name = getattr(expr.func, "__name__", "a function")
    if name == "binomial":
        n, k = (_value(bound) for bound in bounds[:2])
        return _exact_result(min(n * _LOG10_2, k * bounds[0]), "a binomial coefficient")
    largest = max(_value(bound) for bound in bounds)
    return _exact_result(2.0 * largest * math.log10(largest + 2.0), f"{name}()")


def _check_series(expr: Any, seen: dict) -> None:
    """A sum or product with numeric limits is evaluated term by term: bound the count."""
    for limit in expr.limits:
        if len(limit) != 3:
            continue
        _, lower, upper = limit
        lower_bound, _ = _walk(lower, seen)
        upper_bound, _ = _walk(upper, seen)
        if lower_bound is not None and upper_bound is not None:
            if _value(lower_bound) + _value(upper_bound) > MAX_SERIES_TERMS:
                raise _Refused(f"a sum or product over more than {MAX_SERIES_TERMS} terms")


def _expansion(log_terms: float, what: str) -> float:
    if log_terms > math.log10(MAX_EXPANDED_TERMS):
        raise _Refused(f"expanding {what} would give over {MAX_EXPANDED_TERMS} terms")
    return log_terms


def _log_sum(logs: list[float]) -> float:
    """log10 of the sum of 10^x over `logs`."""
    if not logs:
        return 0.0
    top = max(logs)
    if top > _MAX_ESTIMATED_LOG10:
        return top + 1.0
    return math.log10(sum(10.0**x for x in logs))


def _log_binomial(n: float, k: float) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(10)


# --------------------------------------------------------------------------------------------
# The deadline


class DeadlineExceeded(BaseException):
    """Raised inside a thread whose `call_within` ran out of time. A BaseException so that library
    code catching Exception does not swallow it and carry on."""


def call_within(function: Callable[[], T], timeout_s: float) -> T:
    """`function()`, or DeadlineExceeded once it has run `timeout_s` seconds.

    A timer thread sets the exception asynchronously in this thread; Python raises it at the next
    bytecode, so code inside one long C call (big-integer arithmetic, a regex) is interrupted only
    when that call returns: `explosion_reason` keeps those out. Invariant: the exception is set at
    most once, only while `function` may still be running (under `lock`), and any still pending
    when this returns is cleared, so it never escapes into the caller's later code."""
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _set_async_exception(thread_id, DeadlineExceeded)

    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    outcome: tuple[bool, Any] | None = None  # (True, result) or (False, the exception it raised)
    timer.start()
    while True:  # runs again only when the exception lands after `function` has returned
        try:
            if outcome is None and not state["fired"]:
                try:
                    outcome = (True, function())
                except DeadlineExceeded:
                    raise
                except BaseException as error:  # re-raised below, once the timer is disarmed
                    outcome = (False, error)
            with lock:
                state["done"] = True
                _set_async_exception(thread_id, None)  # clears one set but not yet raised
            break
        except DeadlineExceeded:
            continue
    timer.cancel()
    if outcome is None:
        raise DeadlineExceeded(f"took over {timeout_s} s")
    succeeded, value = outcome
    if not succeeded:
        raise value
    return value


def _set_async_exception(thread_id: int, exception: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exception) if exception is not None else None
    )
