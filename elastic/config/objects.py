"""Python objects in a job: a callable (the model factory, the loss, ...) or a dataset given to
`Trainer` in place of a 'module:function' string.

A `UserObject` travels with the job as Ray ships a remote function: pickled by `ray.cloudpickle`,
which pickles by value what cannot be imported on the other side (a function or class of
`__main__`, a notebook's cell) and by reference what can. In the job's JSON (what the controller
and every worker are started with) it is `{"object": name, "module": module, "cloudpickle":
base64}`; it is unpickled only where it is called (`get()`, on the workers and the driver), never
in the controller, which imports no torch. In the records a run writes (config.yaml, `elastic
config show`) it is `<object module.qualname>`: a name to read, not a value to load.
"""
from __future__ import annotations

import base64
import logging
from typing import Annotated, Any, Union

from pydantic import PlainSerializer, PlainValidator
from pydantic_core import core_schema

log = logging.getLogger(__name__)

RECORD = "record"  # serialization context key: write `<object name>` instead of the pickle
_LARGE_BYTES = 16 << 20  # a pickle this large is sent with every worker's start: say so


def qualified_name(obj: Any) -> str:
    """`module.qualname` of a function or class; `partial(...)` of a functools.partial's function;
    `module.Type instance` of anything else."""
    if hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', None) or '?'}.{obj.__qualname__}"
    func = getattr(obj, "func", None)
    if func is not None and hasattr(func, "__qualname__"):  # functools.partial
        return f"partial({qualified_name(func)})"
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__} instance"


class UserObject:
    """A user's object, held as itself (on the driver) and/or as its cloudpickle (shipped)."""

    __slots__ = ("name", "module", "_obj", "_blob")
    _MISSING = object()

    def __init__(self, name: str, module: str, obj: Any = _MISSING, blob: bytes | None = None):
        self.name, self.module, self._obj, self._blob = name, module, obj, blob

    @classmethod
    def of(cls, obj: Any) -> "UserObject":
        mod = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", "?")
        return cls(qualified_name(obj), mod, obj=obj)

    @property
    def local(self) -> bool:
        """Whether the object itself is here (given on this process), not only its pickle."""
        return self._obj is not UserObject._MISSING

    def get(self) -> Any:
        """The object: itself where it was given, else unpickled (once per process)."""
        if not self.local:
            from ray import cloudpickle
            self._obj = cloudpickle.loads(self._blob)
        return self._obj

    def blob(self) -> bytes:
        if self._blob is None:
            from ray import cloudpickle
            self._blob = cloudpickle.dumps(self._obj)
            if len(self._blob) > _LARGE_BYTES:
                log.warning("%s pickles to %.0f MiB, sent with the job to the controller and "
                            "every worker: give a function that loads the data on the worker "
                            "instead of an object that holds it", self, len(self._blob) / 2 ** 20)
        return self._blob

    def __repr__(self) -> str:
        return f"<object {self.name}>"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UserObject):
            return NotImplemented
        if self.local and self._obj is other._obj:
            return True
        return self.blob() == other.blob()

    def __hash__(self) -> int:
        return hash(self.name)

    # ---------------------------------------------------------------- pydantic
    doc_type = "Python object"  # its name in docs/configuration.md

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(_to_ref)


EXPECTED = "expected 'module:function' or a Python object (Trainer only)"


def _to_ref(value: Any) -> "str | UserObject":
    """A job's callable as given: a 'module:function' string (checked where it is imported), a
    `UserObject` (already one, or shipped in the job's JSON), or the user's object, pickled once
    here so that one which cannot travel to the workers fails before anything starts."""
    if isinstance(value, (str, UserObject)):
        return value
    if isinstance(value, dict):
        if set(value) == {"object", "module", "cloudpickle"}:  # shipped in the job's JSON
            return UserObject(value["object"], value["module"],
                              blob=base64.b64decode(value["cloudpickle"]))
        raise ValueError(f"{EXPECTED}, got a mapping")
    if value is None or isinstance(value, (bool, int, float, list, tuple, bytes)):
        raise ValueError(f"{EXPECTED}, got {type(value).__name__} {value!r}")
    obj = UserObject.of(value)
    try:
        obj.blob()
    except Exception as e:  # noqa: BLE001 - whatever cloudpickle raises, the user's to fix
        raise ValueError(f"{obj} cannot be sent to the workers: cloudpickle raised "
                         f"{type(e).__name__}: {e}; define it at module level, or capture no "
                         f"lock, file or socket in it") from None
    return obj


def _ref_json(value: "str | UserObject", info: Any) -> Any:
    if isinstance(value, str):
        return value
    if (info.context or {}).get(RECORD):
        return repr(value)
    return {"object": value.name, "module": value.module,
            "cloudpickle": base64.b64encode(value.blob()).decode()}


# A job's callable: 'module:function' (YAML or Python), or a Python object (Python only).
Ref = Annotated[Union[str, UserObject], PlainValidator(_to_ref, json_schema_input_type=str),
                PlainSerializer(_ref_json, when_used="json")]

