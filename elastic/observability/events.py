"""Events (JSON lines in the run directory) and progress snapshots.

Each event is one JSON object with `t` (wall-clock seconds), `kind` and its
own fields; faults, decisions (with their reason), recoveries and checkpoints
are all events, so the log alone is enough to draw the run's timeline.

Writing the log never blocks the controller or training: one background thread
writes whatever is new, so a storage outage delays the log (and is retried) but
never detection or recovery. Each write costs only the new events:
  * on local disk the log is `<run>/events.jsonl`, appended to in place;
  * object stores cannot append, so each write is a new numbered segment,
    `<run>/events/000000002-000001.jsonl`, `000000002-000002.jsonl`, ...: the
    writer's lease number, then its own count, so two drivers (one that lost the
    run while frozen, and the one that took it over) can never write the same
    segment name, and a reader orders them by lease, then count.
A resumed run (same name, same storage) goes on with the log it left: it
appends to the file, or numbers its segments after its lease's last one. `read_events`
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
(`may_write`: the lease is fresh, elastic/checkpoint/lease.py): a driver whose
lease went stale keeps its events in memory and writes them once a renewal
lands; one whose lease was taken over never writes them.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Iterable

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
    def __init__(self, storage: Storage | None, run_dir: str | None, echo=None, secrets: Iterable[str] = (),
                 may_write: Callable[[], tuple[bool, str]] | None = None,
                 writer_id: Callable[[], int | None] | None = None):
        """`may_write()` -> (ok, why not) is asked before every write (the controller: its lease
        is fresh); `writer_id()` numbers this writer's segments on an object store (its lease)."""
        self.storage, self.run_dir = storage, run_dir
        self._may_write, self._writer_id = may_write, writer_id
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
            if self._may_write is not None and not self._may_write()[0]:
                # Kept in memory: written once the lease is fresh again, never if it was lost.
                self._dirty.set()
                return
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
        writer = (self._writer_id() if self._writer_id else None) or 0
        if self._next_segment is None:
            mine = [seq for w, seq in map(_segment_key, self.storage.list_dir(folder) or []) if w == writer]
            self._next_segment = max(mine, default=0) + 1
        # A failed write is retried under the same number with everything pending since, so a
        # segment that did land after all is replaced by a superset, never duplicated.
        self.storage.write_bytes(join(folder, _segment_name(writer, self._next_segment)), body)
        self._next_segment += 1

    def of_kind(self, kind: str) -> list[dict]:
        with self._lock:
            return [e for e in self.events if e["kind"] == kind]


def _segment_name(writer: int, seq: int) -> str:
    return f"{writer:09d}-{seq:06d}{_SEGMENT_SUFFIX}" if writer else f"{seq:06d}{_SEGMENT_SUFFIX}"


def _segment_key(name: str) -> tuple[int, int] | tuple[None, None]:
    """(writer's lease, its count) of a segment's name; (0, count) for a writer without one
    (and for logs written before segments carried the lease); (None, None) for other names."""
    stem = name[:-len(_SEGMENT_SUFFIX)] if name.endswith(_SEGMENT_SUFFIX) else ""
    writer, _, seq = stem.rpartition("-")
    if seq.isdigit() and (writer.isdigit() or not writer):
        return int(writer or 0), int(seq)
    return None, None


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
    numbered = sorted((key, name) for name in storage.list_dir(folder) if (key := _segment_key(name))[0] is not None)
    for _, name in numbered:
        uri = join(folder, name)
        out += parse_lines(storage.read_bytes(uri).decode(), uri)
    return out
