"""Reading a job: YAML or a dict in, a `JobConfig` or a `ConfigError` that names each bad field out."""
from __future__ import annotations

import yaml
from pydantic import ValidationError

from elastic.config.job import JobConfig
from elastic.config.secrets import is_secret_key, redact


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(job)"
        msg = err["msg"].removeprefix("Value error, ")
        # What was given, unless it is a whole mapping or may be a credential (under storage_options).
        shown = (err["type"] != "value_error" and "input" in err and not isinstance(err["input"], dict)
                 and not any(p == "storage_options" or is_secret_key(p) for p in err["loc"]))
        lines.append(f"  {loc}: {msg}" + (f" (got {redact(err['input'])!r})" if shown else ""))
    return "invalid job config:\n" + "\n".join(lines)


class ConfigError(ValueError):
    """A user setting is wrong; the message names the field and what to do."""


def load_job(path: str) -> JobConfig:
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"job file {path!r} not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"job file {path!r} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"job file {path!r}: expected a mapping at the top level")
    return parse_job(raw)


def parse_job(raw: dict) -> JobConfig:
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
