"""The event log: each write costs only the new events, a resumed run goes on with the log it
left, a storage error delays events but never loses or repeats one, on local disk (one appended
file) and on object stores (numbered segments)."""
import json
import os
import time
import uuid

import pytest

from elastic.cli import main
from tests.support.flaky_fs import flaky_memory_fs
from elastic.storage import Storage, join
from elastic.observability.events import EventLog, read_events


FlakyMemoryFS = flaky_memory_fs("flakylog")


@pytest.fixture(params=["file", "memory"])
def run(request, tmp_path):
    root = f"file://{tmp_path}" if request.param == "file" else f"memory://log-{uuid.uuid4().hex}"
    storage = Storage(root)
    return storage, join(storage.uri, "run")


def emit_and_flush(events, kinds, **fields):
    for kind in kinds:
        events.emit(kind, **fields)
        events.flush()


def test_a_resumed_run_goes_on_with_the_log_it_left(run):
    storage, run_dir = run
    emit_and_flush(EventLog(storage, run_dir), ["run_started", "state", "run_failed"], attempt=1)
    emit_and_flush(EventLog(storage, run_dir), ["run_started", "run_finished"], attempt=2)
    got = [(e["kind"], e["attempt"]) for e in read_events(storage, run_dir)]
    assert got == [("run_started", 1), ("state", 1), ("run_failed", 1), ("run_started", 2), ("run_finished", 2)]


def test_on_local_disk_the_log_is_appended_in_place(tmp_path):
    storage = Storage(f"file://{tmp_path}")
    path = tmp_path / "run" / "events.jsonl"
    path.parent.mkdir()
    previous = b'{"t": 1.0, "kind": "run_started"}\n{"t": 2.0, "kind": "run_failed"}\n'
    path.write_bytes(previous)
    inode = path.stat().st_ino
    events = EventLog(storage, join(storage.uri, "run"))
    for i in range(5):
        emit_and_flush(events, ["checkpoint_committed"], i=i)
        # Appended to the same file: never rewritten (a rewrite costs the whole log every time).
        assert path.stat().st_ino == inode and path.read_bytes().startswith(previous)
    lines = path.read_text().splitlines()
    assert len(lines) == 7 and [json.loads(x).get("i") for x in lines[2:]] == [0, 1, 2, 3, 4]
    assert main(["timeline", str(path), "--out", str(tmp_path / "t.png")]) == 0


def test_on_an_object_store_each_write_holds_only_the_new_events(monkeypatch):
    storage = Storage(f"memory://log-{uuid.uuid4().hex}")
    run_dir = join(storage.uri, "run")
    written = []
    real = storage.write_bytes
    monkeypatch.setattr(storage, "write_bytes", lambda uri, data: (written.append((uri, data)), real(uri, data)))
    events = EventLog(storage, run_dir)
    for i in range(4):
        emit_and_flush(events, ["step"], i=i)
    assert [len(data.splitlines()) for _, data in written] == [1, 1, 1, 1]
    assert [uri.rsplit("/", 1)[1] for uri, _ in written] == [f"00000{n}.jsonl" for n in (1, 2, 3, 4)]
    assert [e["i"] for e in read_events(storage, run_dir)] == [0, 1, 2, 3]


def test_an_object_store_outage_delays_events_but_loses_none():
    storage = Storage(f"flakylog://log-{uuid.uuid4().hex}")
    run_dir = join(storage.uri, "run")
    events = EventLog(storage, run_dir)
    emit_and_flush(events, ["a"])
    FlakyMemoryFS.failures = 2
    emit_and_flush(events, ["b", "c"])  # both writes fail
    emit_and_flush(events, ["d"])
    assert FlakyMemoryFS.failures == 0
    assert [e["kind"] for e in read_events(storage, run_dir)] == ["a", "b", "c", "d"]


def test_a_local_write_error_neither_loses_nor_repeats_an_event(tmp_path, monkeypatch):
    storage = Storage(f"file://{tmp_path}")
    run_dir = join(storage.uri, "run")
    events = EventLog(storage, run_dir)
    emit_and_flush(events, ["a"])
    real_fsync, fails = os.fsync, [1]

    def fsync(fd):  # the disk fails once, after the bytes went to the file
        if fails[0]:
            fails[0] -= 1
            raise OSError(5, "Input/output error (injected)")
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    emit_and_flush(events, ["b"])
    emit_and_flush(events, ["c"])
    assert fails == [0]
    assert [e["kind"] for e in read_events(storage, run_dir)] == ["a", "b", "c"]


def test_a_line_cut_short_by_a_killed_writer_costs_no_later_event(tmp_path):
    storage = Storage(f"file://{tmp_path}")
    run_dir = join(storage.uri, "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").write_text('{"t": 1.0, "kind": "run_started"}\n{"t": 2.0, "ki')
    emit_and_flush(EventLog(storage, run_dir), ["run_started"], resumed=True)
    got = read_events(storage, run_dir)
    assert [e["kind"] for e in got] == ["run_started", "run_started"] and got[1]["resumed"]


def test_a_log_rewritten_whole_by_an_older_version_is_read_before_its_segments():
    storage = Storage(f"memory://log-{uuid.uuid4().hex}")
    run_dir = join(storage.uri, "run")
    storage.write_bytes(join(run_dir, "events.jsonl"), b'{"t": 1.0, "kind": "run_started", "old": true}\n')
    emit_and_flush(EventLog(storage, run_dir), ["run_started"])
    assert [e.get("old", False) for e in read_events(storage, run_dir)] == [True, False]


def test_the_timeline_of_an_object_store_run_reads_its_segments(tmp_path):
    storage = Storage(f"memory://log-{uuid.uuid4().hex}")
    run_dir = join(storage.uri, "run")
    events = EventLog(storage, run_dir)
    emit_and_flush(events, ["run_started"])
    events.emit("state", old="Starting", new="Running")
    emit_and_flush(events, ["checkpoint_committed", "run_finished"], step=10)
    out = tmp_path / "t.png"
    assert main(["timeline", run_dir, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_on_s3_the_log_is_segments_and_a_resumed_run_adds_to_them(s3_server, capsys):
    storage = Storage(f"{s3_server.uri}/log-{uuid.uuid4().hex[:8]}", s3_server.storage_options)
    run_dir = join(storage.uri, "run")
    emit_and_flush(EventLog(storage, run_dir), ["run_started", "run_failed"], attempt=1)
    emit_and_flush(EventLog(storage, run_dir), ["run_started", "run_finished"], attempt=2)
    assert storage.list_dir(join(run_dir, "events")) == [f"00000{n}.jsonl" for n in (1, 2, 3, 4)]
    got = [(e["kind"], e["attempt"]) for e in read_events(storage, run_dir)]
    assert got == [("run_started", 1), ("run_failed", 1), ("run_started", 2), ("run_finished", 2)]
    # `elastic status` reads it with the storage options given on its command line
    opts = [a for k, v in s3_server.storage_options.items() for a in ("--storage-option", f"{k}={json.dumps(v)}")]
    assert main(["status", run_dir, "--json", *opts]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["status"] == "finished" and status["num_starts"] == 2, status


def test_the_writer_thread_outlives_an_unexpected_error_and_reports_it(tmp_path, monkeypatch):
    """Not a storage error (a bug, a library's surprise): the background writer says so, keeps
    the events and writes them on its next try, instead of stopping for the rest of the run."""
    storage = Storage(f"file://{tmp_path}")
    run_dir = join(storage.uri, "run")
    events = EventLog(storage, run_dir)
    real, fails = storage.append_bytes, [1]

    def append_bytes(uri, data):
        if fails[0]:
            fails[0] -= 1
            raise TypeError("unexpected (injected)")
        return real(uri, data)
    monkeypatch.setattr(storage, "append_bytes", append_bytes)
    events.emit("a")  # written by the background thread, which meets the error first
    deadline = time.monotonic() + 20
    while fails[0] or [e["kind"] for e in read_events(storage, run_dir)] != ["a"]:
        assert time.monotonic() < deadline, "the writer thread stopped at the error"
        time.sleep(0.05)
    assert isinstance(events.last_error, TypeError)
    events.emit("b")
    events.flush()
    assert [e["kind"] for e in read_events(storage, run_dir)] == ["a", "b"]
