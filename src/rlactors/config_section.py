"""The base of every configuration section (`rlactors.config`): unknown keys are errors and
assignments are validated."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
