"""What a checkpoint's manifest.json holds, and how strictly a reader takes it: every field's type
checked (`Manifest.from_json`), since a manifest comes from storage, which bit rot, a hand edit
or another tool can change. Where the folder it sits in and its COMMITTED marker are checked
against it is layout.py's.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Callable


@dataclass(frozen=True)
class Manifest:
    step: int
    cursor: int
    world_size: int
    strategy: str
    files: dict[str, int]
    created_at: float
    metrics: dict[str, float] = field(default_factory=dict)
    # What the global sample order depends on (see elastic.data.order): global_batch_size, seed,
    # num_samples; and what the samples are: dataset_fingerprint (elastic.data.fingerprint). A
    # resume with other values would train on another order or other data. Empty in manifests
    # written before it was recorded (and no fingerprint before that was): those keys are not checked.
    data_order: dict[str, int | str] = field(default_factory=dict)
    # name -> "crc32:xxxxxxxx" of every file in `files`, computed by the rank that wrote it from its
    # local copy right after DCP wrote it. Empty in manifests written before digests were recorded:
    # their files are checked by size only, and a file without a digest is never reported corrupt.
    digests: dict[str, str] = field(default_factory=dict)
    # Steps up to this one whose batches a rollback skipped (train.bad_step=rollback): a run
    # resumed from this checkpoint skips them too, as the run that wrote it did.
    skip_steps: list[int] = field(default_factory=list)
    # name -> {item_key(offset, length): digest} of every item DCP wrote into the file (a tensor's
    # shard, a pickled object), from the same local copy as `digests`: a load checks each item it
    # reads (loading.load_shards). Empty in manifests written before they were recorded.
    item_digests: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        """Parsed strictly: ValueError naming the first field that is missing or of another type.
        A manifest comes from storage (bit rot, a hand edit, another tool): a value of the wrong
        type must fail here, where the caller skips the folder, not later in whoever uses it."""
        try:
            raw = json.loads(data)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
            raise ValueError(f"manifest is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("manifest is not a JSON object")
        for f in fields(cls):
            if f.name not in raw:
                if f.default is MISSING and f.default_factory is MISSING:
                    raise ValueError(f"manifest has no {f.name!r}")
                continue
            ok, what = _FIELDS[f.name]
            if not ok(raw[f.name]):
                shown = json.dumps(raw[f.name], default=str)
                raise ValueError(f"manifest field {f.name!r} is {shown[:80]}: expected {what}")
        # Fields a newer version added are ignored rather than fatal: the checkpoint still loads.
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


def _count(minimum: int = 0) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and v >= minimum  # bool is an int, but not a count


def _number(v: Any) -> bool:
    return type(v) in (int, float)


def _map(value_ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, dict) and all(isinstance(k, str) and value_ok(x)
                                                  for k, x in v.items())


# Manifest's field: (check, what it must be)
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step": (_count(), "a step (an integer >= 0)"),
    "cursor": (_count(), "a data cursor (an integer >= 0)"),
    "world_size": (_count(1), "a number of ranks (an integer >= 1)"),
    "strategy": (lambda v: isinstance(v, str) and v != "", "a strategy's name"),
    "files": (_map(_count()), "a map of file name to size in bytes"),
    "created_at": (_number, "a time in seconds"),
    "metrics": (_map(lambda v: v is None or _number(v)), "a map of metric name to number"),
    "data_order": (_map(lambda v: isinstance(v, str) or type(v) is int),
                   "a map of name to integer or string"),
    "digests": (_map(lambda v: isinstance(v, str)), "a map of file name to digest"),
    "skip_steps": (lambda v: isinstance(v, list) and all(map(_count(), v)), "a list of steps"),
    "item_digests": (_map(_map(lambda v: isinstance(v, str))),
                     "a map of file name to item digests"),
}


def item_key(offset: int, length: int) -> str:
    """How `Manifest.item_digests` names the item DCP wrote at `offset`, `length` bytes long."""
    return f"{offset}+{length}"
