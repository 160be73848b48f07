"""The configuration reference, docs/configuration.md, generated from the models' field descriptions.

    python -m elastic.config.reference > docs/configuration.md

The page is the models, printed: every section, field, type, default, allowed range and description
comes from `JobConfig` and the models under it, so a setting documented here is a setting the code
accepts. tests/test_docs.py fails when the committed page differs from what this prints.
"""
from __future__ import annotations

import enum
import types
import typing
from typing import Any, Iterator, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from elastic.config.job import JobConfig

COMMAND = "python -m elastic.config.reference > docs/configuration.md"

INTRO = f"""\
<!-- Generated from the pydantic models in elastic/config/ by `{COMMAND}`. Do not edit by hand. -->

# Configuration reference

A job is one mapping, given as YAML (`elastic train job.yaml`) or as a dict (`Trainer({{...}})`).
Every section below is optional except `train`. Unknown keys are errors that name the key, and
every error names the field and what is allowed. Settings that depend on each other (the global
batch against every world size the run may take, pipeline layouts, chaos ranks and steps) are
checked when the job is loaded, before any worker starts. Fields ending in `_s` are seconds.
[examples/job.yaml](../examples/job.yaml) is a complete job; [getting-started.md](getting-started.md)
walks through one.
"""


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds: `M`, `M | None`, `list[M]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is Any:
        return "any"
    return getattr(annotation, "doc_type", None) or getattr(annotation, "__name__", str(annotation))


def _value(v: Any) -> str:
    if v is None:
        return "`null`"
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    if isinstance(v, enum.Enum):
        v = v.value
    if isinstance(v, BaseModel):
        return "(section)"
    if isinstance(v, (dict, list)) and not v:
        return "`{}`" if isinstance(v, dict) else "`[]`"
    return f"`{v}`"


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return _value(field.default_factory())
    if field.default is PydanticUndefined:
        return "required"
    return _value(field.default)


def _allowed(field: FieldInfo) -> str:
    bounds = []
    for m in field.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                bounds.append(f"{sign} {getattr(m, attr)}")
        pattern = getattr(m, "pattern", None)
        if pattern:
            bounds.append(f"matches `{pattern}`")
    return ", ".join(bounds)


def _cell(text: str) -> str:
    # Table cells: a bare | ends the cell, <name> reads as an HTML tag, * as emphasis.
    text = " ".join(text.split()).replace("|", "\\|").replace("*", "\\*")
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _sections(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, type[BaseModel], str]]:
    """(dotted name, model, description) of every section, depth first, in field order."""
    for name, field in model.model_fields.items():
        for sub in _models(field.annotation):
            path = f"{prefix}{name}" + ("[]" if typing.get_origin(field.annotation) is list else "")
            yield path, sub, field.description or ""
            yield from _sections(sub, path.removesuffix("[]") + ".")


def _anchor(path: str) -> str:
    """GitHub's anchor for a heading `path`: lower case, punctuation dropped."""
    return "".join(c for c in path.lower() if c.isalnum() or c in "-_")


REQUIRED = "<required>"


def defaults(model: type[BaseModel] = JobConfig) -> dict:
    """Every field with its default, as a job file would give it (`elastic config defaults`): a
    section as a mapping of its own fields, a field without a default as "<required>"."""
    out: dict = {}
    for name, field in model.model_fields.items():
        subs = _models(field.annotation)
        has_default = field.default_factory is not None or field.default is not PydanticUndefined
        default = field.default_factory() if field.default_factory is not None else field.default
        if len(subs) == 1 and typing.get_origin(field.annotation) is not list and (
                not has_default or isinstance(default, BaseModel)):
            out[name] = defaults(subs[0])
        elif not has_default:
            out[name] = REQUIRED
        else:
            out[name] = to_jsonable_python(default)
    return out


def render() -> str:
    sections = list(_sections(JobConfig, ""))
    out = [INTRO, "| section | what |", "|---|---|"]
    out += [f"| [`{path}`](#{_anchor(path)}) | {_cell(desc)} |" for path, _, desc in sections]
    for path, model, desc in sections:
        out += ["", f"## {path}", ""]
        doc = " ".join((model.__doc__ or "").split())
        if doc and not doc.startswith(model.__name__ + "("):  # pydantic's default docstring is the signature
            out += [_cell(doc), ""]
        out += ["| field | type | default | allowed | description |", "|---|---|---|---|---|"]
        for name, field in model.model_fields.items():
            kind = _type(field.annotation)
            if _models(field.annotation):
                sub = path.removesuffix("[]") + "." + name
                kind = f"[{kind}](#{_anchor(sub + ('[]' if typing.get_origin(field.annotation) is list else ''))})"
            out.append(f"| `{name}` | {kind} | {_default(field)} | {_allowed(field)} | "
                       f"{_cell(field.description or '')} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
