"""The base of every settings model: unknown keys are errors, settings are immutable, and neither
a model's repr nor a validation error shows a credential (elastic/config/secrets.py)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from elastic.config.secrets import redact


class Strict(BaseModel):
    # hide_input_in_errors: pydantic's own message quotes the input (a whole job, storage_options
    # included) for a check that fails; loading.format_validation_error says what was given instead.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    def __repr_args__(self):
        for name, value in super().__repr_args__():
            yield name, redact({name: value})[name]
