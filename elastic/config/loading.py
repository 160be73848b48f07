"""Reading a job: YAML or a dict in, a `JobConfig` or a `ConfigError` that names each bad field out."""
from __future__ import annotations

import yaml
from pydantic import ValidationError

from elastic.config.job import JobConfig
from elastic.config.objects import RECORD
from elastic.config.secrets import OPTIONS_FIELD, is_secret_key, is_shown_option, redact


def format_validation_error(e: ValidationError, overrides: dict[str, str] | None = None) -> str:
    """One line per bad field (below a header line when there are several): where, what is wrong,
    what was given. `overrides` ({dotted key: the command-line override as given}): a line whose
    field one of them set (or lies under, or above) names it, so a user sees which of the file and
    the command line to fix."""
    lines = []
    for err in e.errors():
        path = ".".join(str(p) for p in err["loc"])
        loc = path or "(job)"
        msg = err["msg"].removeprefix("Value error, ")
        # What was given, unless it is a whole mapping or may be a credential (under storage_options).
        shown = (err["type"] != "value_error" and "input" in err and not isinstance(err["input"], dict)
                 and not any(p == "storage_options" or is_secret_key(p) for p in err["loc"]))
        line = f"  {loc}: {msg}" + (f" (got {redact(err['input'])!r})" if shown else "")
        sources = [redact_override(text) for key, text in (overrides or {}).items()
                   if not path or _within(key, path) or _within(path, key)]
        lines.append(line + (f" (from {', '.join(sources)})" if sources else ""))
    if len(lines) == 1:  # one bad field: one line, as every other user error
        return "invalid job config:" + lines[0][1:]
    return "invalid job config:\n" + "\n".join(lines)


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer + ".")


_OPTION_MAPPINGS = ("client_kwargs", "config_kwargs", "retries", "s3")  # a whole mapping may hold anything


def redact_override(text: str) -> str:
    """An override that sets a credential (`...storage_options.secret=...`), any storage option
    off the allow-list (`...storage_options.headers.x-api-bearer=...`), or a whole mapping of
    storage options, shown without its value."""
    flag, _, assignment = text.partition(" ")
    key = assignment.partition("=")[0]
    parts = key.split(".")
    below = parts[parts.index(OPTIONS_FIELD) + 1:] if OPTIONS_FIELD in parts else None
    if any(is_secret_key(p) for p in parts) or (below is not None and (
            not below or not all(is_shown_option(p) for p in below) or below[-1] in _OPTION_MAPPINGS)):
        return f"{flag} {key}=***"
    return text



class ConfigError(ValueError):
    """A user setting is wrong; the message names the field and what to do."""


def read_job_file(path: str) -> dict:
    """The job file as YAML gives it (a mapping), before validation."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"job file {path!r} not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"job file {path!r} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"job file {path!r}: expected a mapping at the top level")
    return raw


def load_job(path: str, overrides: list[str] = ()) -> JobConfig:
    """The job file, with command-line `overrides` (`KEY=VALUE`, elastic/config/overrides.py) on top."""
    from elastic.config.overrides import apply_overrides
    raw, given = apply_overrides(read_job_file(path), list(overrides))
    return parse_job(raw, given)


def parse_job(raw: dict, overrides: dict[str, str] | None = None) -> JobConfig:
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, overrides)) from None


def dump_job(job: JobConfig) -> str:
    """The resolved job as YAML, every default filled in and credentials redacted: what
    `elastic config show` and `--dry-run` print, and what each run writes as its config.yaml. An
    object given from Python in place of 'module:function' shows as `<object module.name>`."""
    return yaml.safe_dump(redact(job.model_dump(mode="json", context={RECORD: True})), sort_keys=False,
                          default_flow_style=False)
