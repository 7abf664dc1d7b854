"""The base of every configuration section (`rlactors.config`): unknown keys are errors and
assignments are validated; and the error a bad configuration raises."""

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the dotted path."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
