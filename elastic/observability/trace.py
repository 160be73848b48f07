"""A run's timeline as a Chrome trace (`elastic timeline RUN --trace run.json`), for Perfetto
(ui.perfetto.dev, "Open trace file") and chrome://tracing: the same event log the PNG is drawn
from, in the trace-event format that `ray timeline` writes too.

Tracks:
  * process "controller": a "state" thread with the controller's states as spans (Starting,
    Forming, Restoring, Running, Recovering...), a "checkpoints" thread with each committed
    checkpoint's persist as a span (snapshot handed over -> committed), and an "events" thread
    with every other event of the log as an instant event, its fields as arguments. Faults,
    detections, recoveries, swaps and resizes are also global instants: a line across all tracks.
  * process "ranks": one thread per rank number, its states as spans (starting, running, paused,
    recovering, lost: `timeline.rank_spans`) and its marks (a fault on it, found lost, replaced,
    swapped, slow, dropped) as instants. With the run's steps.json (each rank's newest steps,
    written at the end of the run), every one of those steps is a span inside "running", split
    into "compute" (the rank's own forward, backward and optimizer step: the straggler signal)
    followed by "wait" (the rest: collectives, data, checkpoint snapshots). The split is drawn
    as two spans in that order; in the rank, waiting is spread through the step.
Times are microseconds since the log's first event, or since the first recorded step's start
where a rank's clock runs behind the driver's. Pure: the events in, a JSON-able dict out."""
from __future__ import annotations

import json
import math

from elastic.protocol import STEP_FIELDS
from elastic.observability.timeline import rank_marks, rank_spans, run_folder

CONTROLLER_PID, RANKS_PID = 1, 2
STATE_TID, CHECKPOINT_TID, EVENTS_TID = 1, 2, 3
# Events drawn as a line across every track: the moments a reader looks for first.
GLOBAL = frozenset({"fault_injected", "failure_detected", "silence_detected", "hang_detected", "recovered",
                    "swapped", "resized", "resize_completed", "rolled_back", "run_finished", "run_failed"})
_FIELDS_LEFT_OUT = ("t", "kind")


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


def _jsonable(value):
    """Arguments exactly as the log has them, except numbers JSON cannot hold (NaN, infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _meta(pid: int, tid: int | None, what: str, name: str, sort: int | None = None) -> list[dict]:
    out = [{"name": what, "ph": "M", "pid": pid, **({"tid": tid} if tid is not None else {}), "args": {"name": name}}]
    if sort is not None:
        key = "thread_sort_index" if tid is not None else "process_sort_index"
        out.append({"name": key, "ph": "M", "pid": pid, **({"tid": tid} if tid is not None else {}),
                    "args": {"sort_index": sort}})
    return out


def to_trace(events: list[dict], title: str = "", steps: dict | None = None) -> dict:
    """The trace-event JSON object of a run's event log, and of its steps.json when given."""
    if not events:
        raise ValueError("no events to trace")
    # Zero is the log's first event, or the first recorded step's start if earlier (a rank's clock
    # may run behind the driver's); the timeline's rank spans count from the log's first event.
    t0 = min([events[0]["t"], *(start for _, start, _ in _step_rows(steps))])
    shift = events[0]["t"] - t0
    out: list[dict] = []
    out += _meta(CONTROLLER_PID, None, "process_name", f"controller{f' {title}' if title else ''}", 0)
    out += _meta(CONTROLLER_PID, STATE_TID, "thread_name", "state", 0)
    out += _meta(CONTROLLER_PID, CHECKPOINT_TID, "thread_name", "checkpoints", 1)
    out += _meta(CONTROLLER_PID, EVENTS_TID, "thread_name", "events", 2)
    out += _controller_states(events, t0)
    for e in events:
        t, kind = e["t"] - t0, e.get("kind", "?")
        args = _jsonable({k: v for k, v in e.items() if k not in _FIELDS_LEFT_OUT})
        if kind == "state":
            continue
        if kind == "checkpoint_committed" and isinstance(e.get("persist_s"), (int, float)):
            start = max(0.0, t - e["persist_s"])
            out.append({"name": f"persist step {e.get('step')}", "cat": "checkpoint", "ph": "X", "ts": _us(start),
                        "dur": _us(t - start), "pid": CONTROLLER_PID, "tid": CHECKPOINT_TID, "args": args})
        out.append({"name": kind, "cat": "event", "ph": "i", "s": "g" if kind in GLOBAL else "t", "ts": _us(t),
                    "pid": CONTROLLER_PID, "tid": EVENTS_TID, "args": args})
    spans = rank_spans(events)
    if spans:
        out += _meta(RANKS_PID, None, "process_name", "ranks", 1)
    for rank, row in spans.items():
        out += _meta(RANKS_PID, rank, "thread_name", f"rank {rank}", rank)
        out += [{"name": s.state, "cat": "rank", "ph": "X", "ts": _us(s.start_s + shift), "dur": _us(s.end_s - s.start_s),
                 "pid": RANKS_PID, "tid": rank} for s in row]
    out += [{"name": m.kind, "cat": "rank", "ph": "i", "s": "t", "ts": _us(m.t_s + shift), "pid": RANKS_PID, "tid": m.rank,
             "args": {"detail": m.label}} for m in rank_marks(events) if m.rank in spans]
    out += _step_spans(steps, t0, set(spans))
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"source": "elastic event log", "first_event_t": events[0]["t"], "zero_t": t0,
                          "run": title}}


def _step_spans(steps: dict | None, t0: float, ranks: set[int]) -> list[dict]:
    """Each recorded step as a span on its rank's track, with its compute and its waiting."""
    out: list[dict] = []
    for rank, start, r in _step_rows(steps):
        if rank in ranks:
            start -= t0
            compute = min(max(r["compute_s"], 0.0), r["step_s"])
            common = {"ph": "X", "pid": RANKS_PID, "tid": rank}
            out.append({"name": f"step {r['step']}", "cat": "step", "ts": _us(start), "dur": _us(r["step_s"]),
                        "args": {"step": r["step"], "step_s": r["step_s"], "compute_s": r["compute_s"]}, **common})
            out.append({"name": "compute", "cat": "step", "ts": _us(start), "dur": _us(compute), **common})
            if r["step_s"] > compute:
                out.append({"name": "wait", "cat": "step", "ts": _us(start + compute),
                            "dur": _us(r["step_s"] - compute), **common})
    return out


def _step_rows(steps: dict | None):
    """(rank, wall-clock start, the row as a dict) of every step in a steps.json."""
    if not steps:
        return
    fields = steps.get("fields", STEP_FIELDS)
    for rank, rows in steps.get("ranks", {}).items():
        for row in rows:
            r = dict(zip(fields, row))
            yield int(rank), r["t_end"] - r["step_s"], r


def _controller_states(events: list[dict], t0: float) -> list[dict]:
    states = [e for e in events if e.get("kind") == "state"]
    if not states:
        return []
    states = [{"t": events[0]["t"], "new": states[0].get("old")}] + states  # the first runs from the log's start
    out = []
    for a, b in zip(states, states[1:] + [events[-1]]):
        if a.get("new") is None or b["t"] < a["t"]:
            continue
        out.append({"name": a["new"], "cat": "controller", "ph": "X", "ts": _us(a["t"] - t0),
                    "dur": _us(b["t"] - a["t"]), "pid": CONTROLLER_PID, "tid": STATE_TID})
    return out


def write_trace(events: list[dict], path: str, title: str = "", steps: dict | None = None) -> None:
    """Write the trace (strict JSON: no NaN) to a path or URI, whole or not at all (Storage)."""
    from elastic.storage import Storage, normalize_uri
    uri = normalize_uri(path)
    body = json.dumps(to_trace(events, title, steps), allow_nan=False).encode()
    Storage(uri.rsplit("/", 1)[0]).write_bytes(uri, body)


def load_steps(run: str, storage_options: dict | None = None) -> dict | None:
    """A run folder's steps.json (path or URI; a path to its events.jsonl names the folder too),
    or None where the run has none (a run from before it existed, or one still running)."""
    from elastic.storage import StorageError, join
    storage = run_folder(run, storage_options)
    uri = join(storage.uri, "steps.json")
    try:
        return json.loads(storage.read_bytes(uri)) if storage.exists(uri) else None
    except (StorageError, OSError, ValueError):
        return None
