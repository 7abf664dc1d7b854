"""Loading a configuration: YAML, dotted command-line overrides, and errors that name the field.

    config = load_config("examples/quickstart_cpu.yaml", ["trainer.optim.lr=2e-5"])
    dump_config(config, "run/config.yaml")

A bad key or value raises `ConfigError` naming the full dotted path (`trainer.optim.lr`) and, where
the field is a choice, the allowed values.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from rlactors.config.section import ConfigError
from rlactors.config.sections import Config


def _field_at(model: type[BaseModel], path: tuple) -> tuple[type[BaseModel] | None, Any]:
    """Walk `path` through nested models; returns (parent model class, field info or None)."""
    parent: type[BaseModel] | None = model
    info = None
    for key in path:
        if parent is None or not isinstance(key, str) or key not in parent.model_fields:
            return parent, None
        info = parent.model_fields[key]
        annotation = info.annotation
        parent = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return parent, info


def _allowed_values(annotation: Any) -> list[Any]:
    values: list[Any] = []
    for arg in typing.get_args(annotation) or ():
        values += _allowed_values(arg)
    if typing.get_origin(annotation) is Literal:
        values = list(typing.get_args(annotation))
    elif annotation is type(None):
        values = [None]
    return values


def _explain(error: ValidationError, model: type[BaseModel]) -> ConfigError:
    lines = []
    for item in error.errors():
        loc = tuple(k for k in item["loc"] if not (isinstance(k, str) and k.startswith(("literal[", "function-"))))
        dotted = ".".join(str(k) for k in loc)
        if item["type"] == "extra_forbidden":
            parent, _ = _field_at(model, loc[:-1])
            known = sorted(parent.model_fields) if parent is not None else []
            lines.append(f"{dotted}: unknown key; allowed keys here: {', '.join(known)}")
            continue
        _, info = _field_at(model, loc)
        message = f"{dotted}: {item['msg']} (got {item.get('input')!r})"
        allowed = _allowed_values(info.annotation) if info is not None else []
        if allowed:
            message += f"; allowed values: {', '.join(repr(v) for v in allowed)}"
        lines.append(message)
    return ConfigError("invalid configuration:\n  " + "\n  ".join(lines))


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(keys[: i + 1])}: is a value, cannot set {dotted}")
        node = child
    node[keys[-1]] = value


_SCIENTIFIC = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")


def parse_override(text: str) -> tuple[str, Any]:
    """`trainer.optim.lr=2e-5` -> ("trainer.optim.lr", 2e-05); values are parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    value = yaml.safe_load(raw) if raw.strip() else None
    if isinstance(value, str) and _SCIENTIFIC.fullmatch(value):
        value = float(value)  # YAML 1.1 reads 2e-5 as a string (it wants a dot); a user means a number
    return key.strip(), value


def build_config(tree: dict | None = None, overrides: list[str] | None = None, model: type[BaseModel] = Config):
    """Validate a plain dict (e.g. from YAML) after applying dotted overrides, as a `model` (a run's
    `Config`, or another job's root such as `RewardTrainingConfig`)."""
    tree = dict(tree or {})
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    try:
        return model.model_validate(tree)
    except ValidationError as error:
        raise _explain(error, model) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, model: type[BaseModel] = Config):
    """Load YAML (or start from defaults when path is None), apply overrides, validate."""
    tree: dict = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"{path}: no such config file")
        with open(path) as handle:
            tree = yaml.safe_load(handle) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    return build_config(tree, overrides, model)


def config_to_dict(config: BaseModel) -> dict:
    return config.model_dump(mode="json")


def dump_config(config: BaseModel, path: str | Path | None = None) -> str:
    """YAML text of the config; written to `path` when given. Loading it gives the same config."""
    text = yaml.safe_dump(config_to_dict(config), sort_keys=False)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    return text


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted path, description) of every leaf field: the reference of all settings."""
    rows = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += describe_fields(annotation, f"{prefix}{name}.")
        else:
            rows.append((f"{prefix}{name}", info.description or ""))
    return rows
