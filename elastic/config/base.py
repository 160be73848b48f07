"""The base of every settings model: unknown keys are errors, settings are immutable."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
