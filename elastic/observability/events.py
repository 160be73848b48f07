"""Events (JSON lines in the run directory) and progress snapshots.

Each event is one JSON object with `t` (wall-clock seconds), `kind` and its
own fields; faults, decisions (with their reason), recoveries and checkpoints
are all events, so the log alone is enough to draw the run's timeline.

Writing the log never blocks the controller or training: one background thread
writes whatever is new, so a storage outage delays the log (and is retried) but
never detection or recovery. Each write costs only the new events:
  * on local disk the log is `<run>/events.jsonl`, appended to in place;
  * object stores cannot append, so each write is a new numbered segment,
    `<run>/events/000001.jsonl`, `000002.jsonl`, ...
A resumed run (same name, same storage) goes on with the log it left: it
appends to the file, or numbers its segments after the last one. `read_events`
reads either layout (both, in order: a file first, then its segments).

No event holds a credential: `emit` scrubs the job's secrets (its storage options'
credential values, a URI's password) from every field, whatever code path put
them in an error message (elastic/config/secrets.py).

Unlike the controller's other writes (a rollback's un-commits, metrics.json,
ledger.json), the log is not fenced (elastic/checkpoint/fencing.py): it is the
record of what happened, including how a generation was fenced off, so a fence
that cannot be read must not silence it; nothing restores from it or decides by
it, and it only adds (a line appended on local disk, a new segment on an object
store). Whether a driver writes it at all is the run's lease's to say
(`Controller.holds_run`). Two writers at once, which the lease prevents, could
number the same segment, the later replacing the other.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Iterable

from elastic.config.secrets import scrub
from elastic.storage import Storage, StorageError, call_within, join

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
SEGMENTS_DIR = "events"
_SEGMENT_SUFFIX = ".jsonl"


def event_log_uri(run_dir: str) -> str:
    """Where a run's log is, as a reader would look for it: the file on local disk (file://),
    the folder of segments on an object store."""
    return join(run_dir, EVENTS_FILE if run_dir.startswith("file://") else SEGMENTS_DIR)


class EventLog:
    def __init__(self, storage: Storage | None, run_dir: str | None, echo=None, secrets: Iterable[str] = ()):
        self.storage, self.run_dir = storage, run_dir
        self._secrets = frozenset(secrets)  # credential values never to write (config.secrets.job_secrets)
        self.uri = event_log_uri(run_dir) if storage is not None and run_dir else None
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._echo = echo
        self._flushed = 0
        self._dirty = threading.Event()
        self._write_lock = threading.Lock()  # one writer at a time, so events land in order
        self._closed = False
        self._writer: threading.Thread | None = None
        self.last_error: BaseException | None = None  # the writer's last unexpected error, if any
        self._next_segment: int | None = None  # object stores: found by listing at the first write
        # Object stores pay a request per segment (and a reader one per segment): fewer, larger ones.
        self._coalesce_s = 0.2 if storage is None or storage.can_append else 1.0

    def emit(self, kind: str, **fields: Any) -> dict:
        # Round-trip through JSON so in-memory events equal what the log file holds (str keys).
        ev = scrub(json.loads(json.dumps({"t": time.time(), "kind": kind, **fields}, default=str)), self._secrets)
        with self._lock:
            self.events.append(ev)
        if self._echo:
            self._echo(ev)
        if self.uri is not None:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="event-log", daemon=True)
                self._writer.start()
            self._dirty.set()
        return ev

    def _write_loop(self) -> None:
        while not self._closed:
            self._dirty.wait()
            self._dirty.clear()
            try:
                self._write()
            except Exception as e:  # noqa: BLE001 - the writer must outlive any error, or the log stops silently
                # Not a StorageError (those are retried in _write): a bug or an unexpected library
                # error. Said each time, kept for flush() to report, and retried: the events wait.
                self.last_error = e
                log.error("event log write failed (will retry): %s: %s", type(e).__name__, e)
                time.sleep(1.0)
                self._dirty.set()
            time.sleep(self._coalesce_s)  # coalesce bursts of events into one write

    def flush(self, timeout_s: float = 30.0) -> None:
        """Write everything now (end of run); gives up after timeout_s if storage does not answer."""
        if self.uri is None:
            return
        _, _, error = call_within(self._write, timeout_s)
        if error is not None:
            log.warning("event log not flushed: %s", error)

    def _write(self) -> None:
        with self._write_lock:
            with self._lock:
                if self._flushed == len(self.events):
                    return
                new = self.events[self._flushed:]
            body = "".join(json.dumps(e, default=str) + "\n" for e in new).encode()
            try:
                if self.storage.can_append:
                    self._append(body)
                else:
                    self._write_segment(body)
                self._flushed += len(new)
            except StorageError as e:
                log.warning("event log not written yet (will retry): %s", e)
                time.sleep(1.0)
                self._dirty.set()

    def _append(self, body: bytes) -> None:
        uri = join(self.run_dir, EVENTS_FILE)
        if self._flushed == 0 and self.storage.exists(uri) and self.storage.read_tail(uri, 1) not in (b"", b"\n"):
            # The previous run died in the middle of a line: end it, so our first event stays whole.
            body = b"\n" + body
        self.storage.append_bytes(uri, body)

    def _write_segment(self, body: bytes) -> None:
        folder = join(self.run_dir, SEGMENTS_DIR)
        if self._next_segment is None:
            numbers = [n for n in map(_segment_number, self.storage.list_dir(folder)) if n is not None]
            self._next_segment = max(numbers, default=0) + 1
        # A failed write is retried under the same number with everything pending since, so a
        # segment that did land after all is replaced by a superset, never duplicated.
        self.storage.write_bytes(join(folder, f"{self._next_segment:06d}{_SEGMENT_SUFFIX}"), body)
        self._next_segment += 1

    def of_kind(self, kind: str) -> list[dict]:
        with self._lock:
            return [e for e in self.events if e["kind"] == kind]


def _segment_number(name: str) -> int | None:
    stem = name[:-len(_SEGMENT_SUFFIX)] if name.endswith(_SEGMENT_SUFFIX) else ""
    return int(stem) if stem.isdigit() else None


def parse_lines(data: str, where: str) -> list[dict]:
    """Events from JSON lines. A line cut short (a writer killed mid-write) is skipped with a warning."""
    out = []
    for i, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s line %d is not a whole event; skipped", where, i)
    return out


def read_events(storage: Storage, run_dir: str) -> list[dict]:
    """Every event of a run, in order, from either layout (empty if the run has none)."""
    out: list[dict] = []
    path = join(run_dir, EVENTS_FILE)
    if storage.exists(path):
        out += parse_lines(storage.read_bytes(path).decode(), path)
    folder = join(run_dir, SEGMENTS_DIR)
    numbered = sorted((n, name) for name in storage.list_dir(folder) if (n := _segment_number(name)) is not None)
    for _, name in numbered:
        uri = join(folder, name)
        out += parse_lines(storage.read_bytes(uri).decode(), uri)
    return out
