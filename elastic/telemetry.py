"""Events (JSON lines in the run directory) and progress snapshots.

Each event is one JSON object with `t` (wall-clock seconds), `kind` and its
own fields; faults, decisions (with their reason), recoveries and checkpoints
are all events, so the log alone is enough to draw the run's timeline.
Writing the log never blocks or fails training: a storage error is retried on
the next event.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from elastic.storage import Storage, StorageError, join

log = logging.getLogger(__name__)


class EventLog:
    def __init__(self, storage: Storage | None, run_dir: str | None, echo=None):
        self.storage, self.uri = storage, (join(run_dir, "events.jsonl") if run_dir else None)
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._echo = echo
        self._flushed = 0
        # A resumed run (same name, same storage) appends to the log it left, never replaces it.
        self._prefix = b""
        if storage is not None and self.uri is not None:
            try:
                if storage.exists(self.uri):
                    self._prefix = storage.read_bytes(self.uri)
            except StorageError as e:
                log.warning("previous event log not read: %s", e)

    def emit(self, kind: str, **fields: Any) -> dict:
        # Round-trip through JSON so in-memory events equal what the log file holds (str keys).
        ev = json.loads(json.dumps({"t": time.time(), "kind": kind, **fields}, default=str))
        with self._lock:
            self.events.append(ev)
        if self._echo:
            self._echo(ev)
        self.flush()
        return ev

    def flush(self) -> None:
        if self.storage is None or self.uri is None:
            return
        with self._lock:
            if self._flushed == len(self.events):
                return
            body = self._prefix + "".join(json.dumps(e, default=str) + "\n" for e in self.events).encode()
            n = len(self.events)
        try:
            # Rewritten whole: object stores cannot append, and the log is small.
            self.storage.write_bytes(self.uri, body)
            self._flushed = n
        except StorageError as e:
            log.warning("event log not written yet: %s", e)

    def of_kind(self, kind: str) -> list[dict]:
        with self._lock:
            return [e for e in self.events if e["kind"] == kind]


def read_events(storage: Storage, run_dir: str) -> list[dict]:
    data = storage.read_bytes(join(run_dir, "events.jsonl")).decode()
    return [json.loads(line) for line in data.splitlines() if line.strip()]
