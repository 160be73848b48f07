"""Events (JSON lines in the run directory) and progress snapshots.

Each event is one JSON object with `t` (wall-clock seconds), `kind` and its
own fields; faults, decisions (with their reason), recoveries and checkpoints
are all events, so the log alone is enough to draw the run's timeline.
Writing the log never blocks the controller or training: one background thread
rewrites the file whenever there is something new, so a storage outage delays
the log (and is retried) but never detection or recovery.
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
        self._dirty = threading.Event()
        self._write_lock = threading.Lock()  # one writer at a time, so an older body never lands last
        self._closed = False
        self._writer: threading.Thread | None = None
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
        if self.storage is not None and self.uri is not None:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="event-log", daemon=True)
                self._writer.start()
            self._dirty.set()
        return ev

    def _write_loop(self) -> None:
        while not self._closed:
            self._dirty.wait()
            self._dirty.clear()
            self._write()
            time.sleep(0.2)  # coalesce bursts of events into one write

    def flush(self, timeout_s: float = 30.0) -> None:
        """Write everything now (end of run); gives up after timeout_s if storage does not answer."""
        if self.storage is None or self.uri is None:
            return
        done = threading.Thread(target=self._write, daemon=True)
        done.start()
        done.join(timeout_s)

    def _write(self) -> None:
        with self._write_lock:
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
                log.warning("event log not written yet (will retry): %s", e)
                time.sleep(1.0)
                self._dirty.set()

    def of_kind(self, kind: str) -> list[dict]:
        with self._lock:
            return [e for e in self.events if e["kind"] == kind]


def read_events(storage: Storage, run_dir: str) -> list[dict]:
    data = storage.read_bytes(join(run_dir, "events.jsonl")).decode()
    return [json.loads(line) for line in data.splitlines() if line.strip()]
