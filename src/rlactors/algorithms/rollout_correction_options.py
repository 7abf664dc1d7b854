"""The options of rollout correction (`rollout_correction`): importance weight levels, rejection
options and their thresholds, with veRL's string forms of them (`rollout_is_threshold`,
`rollout_rs`, `rollout_rs_threshold`) parsed into the arguments of `rollout_importance_weights`
and `rollout_rejection_mask`, and checked the same way whichever form they came in. Nothing here
touches a tensor: the configuration parses its rollout correction when it is loaded, so a bad
threshold is refused before a run starts.
"""

from __future__ import annotations

from collections.abc import Sequence

# Importance weights per token, or one per sequence on each of its tokens.
IS_LEVELS = ("token", "sequence")
# <where>_<statistic>: the statistic k1, k2 or k3 of each token, or its sum, mean or max over the sequence.
REJECTION_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)

# A rejection option's bounds: an upper bound, or (lower, upper) for a k1 option.
Threshold = float | tuple[float, float]


def parse_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """veRL's `rollout_is_threshold` spec -> `(threshold, threshold_lower)`.

    A number or a number-like string is a TIS cap (lower None); `"lower_upper"` (e.g. `"0.5_2.0"`)
    selects IcePop. veRL's `_parse_rollout_is_threshold`; bounds must be positive, lower <= upper.
    """
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise TypeError(f"rollout_is_threshold must be a number or a string, got {spec!r}")
    lower: float | None = None
    try:
        if isinstance(spec, str) and "_" in spec:
            lower_text, upper_text = spec.strip().split("_", 1)
            lower, upper = float(lower_text), float(upper_text)
        else:
            upper = float(spec)
    except ValueError as exc:
        raise ValueError(f"invalid rollout_is_threshold {spec!r}") from exc
    check_importance_thresholds(upper, lower)
    return upper, lower


def check_importance_thresholds(threshold: float, threshold_lower: float | None) -> None:
    """Refuse a non-positive TIS cap, or an IcePop lower bound outside (0, threshold]."""
    if threshold <= 0:
        raise ValueError(f"importance weight threshold must be positive, got {threshold}")
    if threshold_lower is not None and not 0 < threshold_lower <= threshold:
        raise ValueError(f"IcePop lower bound must be in (0, {threshold}], got {threshold_lower}")


def parse_rejection(options: str, thresholds: str | float | None) -> tuple[list[str], list[Threshold]]:
    """veRL's `rollout_rs` / `rollout_rs_threshold` config values -> `rollout_rejection_mask` args.

    `options` is comma separated (`"token_k1,seq_mean_k3"`; duplicates dropped, first kept);
    `thresholds` one entry per option, comma separated, or a single entry shared by all. A k1 entry
    is `"lower_upper"` (`"0.5_2.0"`) or an upper bound alone, the lower then being its reciprocal;
    other options take an upper bound alone. As veRL's `_parse_rollout_rs_thresholds`.
    """
    names = list(dict.fromkeys(part.strip() for part in options.split(",") if part.strip()))
    if not names:
        raise ValueError("rollout_rs must name at least one option")
    unknown = [name for name in names if name not in REJECTION_OPTIONS]
    if unknown:
        raise ValueError(f"unknown rejection options {unknown}; expected some of {REJECTION_OPTIONS}")
    if thresholds is None:
        raise ValueError("rollout_rs_threshold must be given for rejection sampling")
    if isinstance(thresholds, bool) or not isinstance(thresholds, int | float | str):
        raise TypeError(f"rollout_rs_threshold must be a number or a string, got {thresholds!r}")
    specs = [str(thresholds)] if not isinstance(thresholds, str) else [p.strip() for p in thresholds.split(",")]
    specs = [spec for spec in specs if spec]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"{len(specs)} rollout_rs thresholds for {len(names)} options; give 1 or {len(names)}")
    specs = specs * len(names) if len(specs) == 1 else specs
    parsed: list[Threshold] = []
    for name, spec in zip(names, specs, strict=True):
        if "_" in spec and not name.endswith("k1"):
            raise ValueError(f"option {name!r} takes a single upper bound, got {spec!r}")
        try:
            parsed.append(tuple(float(part) for part in spec.split("_", 1)) if "_" in spec else float(spec))
        except ValueError as exc:
            raise ValueError(f"invalid threshold {spec!r} for option {name!r}") from exc
    return names, parsed


def rejection_bounds(
    options: Sequence[str], thresholds: Sequence[Threshold]
) -> list[tuple[str, float | None, float]]:
    """Validated (option, lower or None, upper); a k1 option given one number gets lower = 1/upper."""
    if isinstance(options, str):
        raise TypeError("options must be a sequence of option names; parse veRL's strings with parse_rejection")
    if not options or len(options) != len(thresholds):
        raise ValueError(f"need one threshold per option, got {len(options)} options, {len(thresholds)} thresholds")
    if len(set(options)) != len(options):
        raise ValueError(f"duplicate rejection options in {list(options)}")
    bounds = []
    for option, threshold in zip(options, thresholds, strict=True):
        if option not in REJECTION_OPTIONS:
            raise ValueError(f"unknown rejection option {option!r}; expected one of {REJECTION_OPTIONS}")
        if isinstance(threshold, tuple | list):
            if not option.endswith("k1"):
                raise ValueError(f"option {option!r} takes a single upper bound, got {threshold!r}")
            lower, upper = (float(value) for value in threshold)
        else:
            upper = float(threshold)
            lower = 1.0 / upper if option.endswith("k1") and upper > 0 else None
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"thresholds for {option!r} must be positive with lower <= upper, got {threshold!r}")
        bounds.append((option, lower, upper))
    return bounds
