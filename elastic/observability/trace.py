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
    swapped, slow, dropped) as instants.
Times are microseconds since the log's first event. Pure: the events in, a JSON-able dict out."""
from __future__ import annotations

import json
import math

from elastic.observability.timeline import rank_marks, rank_spans

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


def to_trace(events: list[dict], title: str = "") -> dict:
    """The trace-event JSON object of a run's event log."""
    if not events:
        raise ValueError("no events to trace")
    t0 = events[0]["t"]
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
        out += [{"name": s.state, "cat": "rank", "ph": "X", "ts": _us(s.start_s), "dur": _us(s.end_s - s.start_s),
                 "pid": RANKS_PID, "tid": rank} for s in row]
    out += [{"name": m.kind, "cat": "rank", "ph": "i", "s": "t", "ts": _us(m.t_s), "pid": RANKS_PID, "tid": m.rank,
             "args": {"detail": m.label}} for m in rank_marks(events) if m.rank in spans]
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"source": "elastic event log", "first_event_t": t0, "run": title}}


def _controller_states(events: list[dict], t0: float) -> list[dict]:
    states = [e for e in events if e.get("kind") == "state"]
    if not states:
        return []
    states = [{"t": t0, "new": states[0].get("old")}] + states  # the first state runs from the log's start
    out = []
    for a, b in zip(states, states[1:] + [events[-1]]):
        if a.get("new") is None or b["t"] < a["t"]:
            continue
        out.append({"name": a["new"], "cat": "controller", "ph": "X", "ts": _us(a["t"] - t0),
                    "dur": _us(b["t"] - a["t"]), "pid": CONTROLLER_PID, "tid": STATE_TID})
    return out


def write_trace(events: list[dict], path: str, title: str = "") -> None:
    """Write the trace (strict JSON: no NaN) to a path or URI, whole or not at all (Storage)."""
    from elastic.storage import Storage, normalize_uri
    uri = normalize_uri(path)
    Storage(uri.rsplit("/", 1)[0]).write_bytes(uri, json.dumps(to_trace(events, title), allow_nan=False).encode())
