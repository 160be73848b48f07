"""Command-line overrides: `--set train.precision=bf16 --set scaling.num_workers=8` on top of a job
file, validated like the file itself, and `KEY=VALUE` options (`--storage-option`).

A value is read as YAML, as it would be in the file: `8` is a number, `bf16` a string, `true` a
bool, `null` None, `[1, 2]` a list, `{endpoint_url: http://...}` a mapping. A key is a dotted path
into the job; a number indexes a list (`chaos.0.at_step=30`). An override that cannot apply
(no `=`, an empty key, a path through a value that is not a mapping or list) is a `ConfigError`
that names it; a key the job does not know fails validation, naming the field and the override."""
from __future__ import annotations

import copy
from typing import Any

import yaml

from elastic.config.loading import ConfigError


def split_assignment(text: str, flag: str,
                     example: str = "scaling.num_workers=8") -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value read as YAML); `example` is the flag's own, for the error."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{flag} {text!r}: expected KEY=VALUE (e.g. {flag} {example})")
    try:
        return key, yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{flag} {text!r}: the value is not valid YAML: {str(e).splitlines()[0]}") from None


def apply_overrides(raw: dict, assignments: list[str], flag: str = "--set") -> tuple[dict, dict[str, str]]:
    """`raw` (a job as read from YAML) with each `KEY=VALUE` of `assignments` set, in order; the
    input is not changed. Returns (the new job, {dotted key: the override as given}) for errors
    to name the override a bad field came from."""
    out = copy.deepcopy(raw)
    given = {}
    for text in assignments:
        key, value = split_assignment(text, flag)
        parts = key.split(".")
        if any(not p for p in parts):
            raise ConfigError(f"{flag} {text!r}: {key!r} has an empty part; use dotted names like train.precision")
        node: Any = out
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            where = ".".join(parts[:i]) or "the job"
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"{flag} {text!r}: {where} is a list of {len(node)}; "
                                      f"{part!r} is not an index into it (0..{len(node) - 1})")
                part = int(part)
            elif not isinstance(node, dict):
                raise ConfigError(f"{flag} {text!r}: {where} is {node!r}, not a section: nothing to set inside it")
            if last:
                node[part] = value
            else:
                if isinstance(node, dict) and node.get(part) is None:
                    node[part] = {}
                node = node[part]
        given[key] = f"{flag} {text}"
    return out, given


def parse_options(assignments: list[str], flag: str, example: str) -> dict[str, Any]:
    """`KEY=VALUE` options (storage options): {KEY: value read as YAML}, in order, the last wins.
    `example`: a valid one, which an error shows."""
    return dict(split_assignment(text, flag, example) for text in assignments)
