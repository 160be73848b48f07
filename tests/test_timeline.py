"""The event log alone is enough to draw the run's timeline: the controller's row, and one row per
rank (its state over time, faults, losses, replacements, swaps, rows that end and begin with resizes)."""
import json
import struct

import pytest

from elastic.cli import main
from elastic.observability.timeline import load, plot, rank_marks, rank_spans
from tests.test_status import T0, Log, a_run, write_run  # the same synthetic runs as `elastic status`


def test_timeline_png_from_an_event_log(tmp_path):
    t = 1000.0
    events = [
        {"t": t, "kind": "run_started"},
        {"t": t + 1, "kind": "state", "old": "Starting", "new": "Forming"},
        {"t": t + 1.2, "kind": "state", "old": "Forming", "new": "Restoring"},
        {"t": t + 1.5, "kind": "state", "old": "Restoring", "new": "Running"},
        {"t": t + 2, "kind": "checkpoint_committed", "step": 10},
        {"t": t + 3, "kind": "fault_injected", "action": "kill_node", "rank": 1, "step": 15},
        {"t": t + 3.5, "kind": "state", "old": "Running", "new": "Recovering"},
        {"t": t + 3.5, "kind": "failure_detected", "lost": [{"rank": 1, "cause": "node_died"}], "step": 15},
        {"t": t + 4, "kind": "state", "old": "Recovering", "new": "Forming"},
        {"t": t + 4.5, "kind": "recovered", "recover_s": 1.5},
        {"t": t + 6, "kind": "state", "old": "Running", "new": "Finished"},
        {"t": t + 6, "kind": "run_finished"},
    ]
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    out = tmp_path / "timeline.png"
    assert main(["timeline", str(log), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


# ------------------------------------------------------------------ one row per rank


def rows(events):
    return {r: [(round(s.start_s, 3), round(s.end_s, 3), s.state) for s in spans]
            for r, spans in rank_spans(events).items()}


def test_rank_rows_follow_faults_swaps_and_resizes():
    # a_run: rank 1's node killed at 12.0 (found at 13.2, a spare in at 13.22), rank 2 swapped at 18.6,
    # rank 2's node killed at 21.0 and no replacement (shrink to 2 at 24.32), growth back to 3 at 30.1
    pauses = [(18.6, 18.7, "paused"), (18.7, 22.3, "running"), (22.3, 24.4, "recovering"), (24.4, 30.1, "running"),
              (30.1, 30.18, "paused"), (30.18, 35.0, "running")]
    assert rows(a_run()) == {
        0: [(0.0, 6.2, "starting"), (6.2, 13.2, "running"), (13.2, 13.3, "recovering"), (13.3, 18.6, "running")]
        + pauses,
        # lost from the fault, not from when the controller found out; a warm spare holds it from 13.22
        1: [(0.0, 6.2, "starting"), (6.2, 12.0, "running"), (12.0, 13.22, "lost"), (13.22, 13.3, "recovering"),
            (13.3, 18.6, "running")] + pauses,
        # its row ends when the world shrinks to 2, and begins again when it grows back to 3
        2: [(0.0, 6.2, "starting"), (6.2, 13.2, "running"), (13.2, 13.3, "recovering"), (13.3, 18.6, "running"),
            (18.6, 18.7, "paused"), (18.7, 21.0, "running"), (21.0, 24.32, "lost"), (30.1, 30.18, "paused"),
            (30.18, 35.0, "running")],
    }


def test_rank_marks_put_faults_losses_replacements_and_swaps_on_their_rows():
    marks = [(round(m.t_s, 3), m.rank, m.kind, m.label) for m in rank_marks(a_run())]
    assert marks == [(12.0, 1, "fault", "kill_node after step 110"), (13.2, 1, "detected", "unresponsive"),
                     (13.22, 1, "replaced", "warm spare"), (17.0, 2, "fault", "slow after step 160"),
                     (18.0, 2, "slow", "x3.1 at step 170"), (18.5, 2, "slow", "x3.1 at step 175"),
                     (18.62, 2, "swapped", "warm spare"), (21.0, 2, "fault", "kill_node after step 205"),
                     (22.3, 2, "detected", "unresponsive")]


def test_rank_rows_of_a_running_and_of_a_resumed_run():
    running = a_run(upto_s=23.0)  # rank 2's node is gone, no replacement yet; the last event is at 22.31
    now = rows(running)
    assert now[2][-1] == (21.0, 22.31, "lost") and now[0][-1] == now[1][-1] == (22.3, 22.31, "recovering")
    log = Log("file:///data/runs/charlm")
    log.start(100.0, restored_step=200)
    log.commit(110.0, 220, 1.75)
    # The driver died; a resubmit resumed from storage. Nothing is known in between: the rows stop
    # at the last event of the first invocation and every rank starts again.
    resumed = rows(running + log.events)
    assert resumed == {r: now[r] + [(100.0, 106.2, "starting"), (106.2, 110.0, "running")] for r in range(3)}


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("where", ["file", "memory"])
def test_timeline_draws_one_row_per_rank_from_a_run_folder(where, tmp_path):
    run = write_run(where, tmp_path, a_run())
    assert load(run) == a_run()
    per_rank, controller = tmp_path / "ranks.png", tmp_path / "controller.png"
    assert main(["timeline", run, "--out", str(per_rank)]) == 0
    assert main(["timeline", run, "--out", str(controller), "--no-per-rank"]) == 0
    (w1, h1), (w2, h2) = png_size(per_rank), png_size(controller)
    assert w1 == w2 and h1 > h2  # three rank rows under the controller's


def test_plot_keeps_its_controller_only_default(tmp_path):
    out = tmp_path / "t.png"
    plot(a_run(), str(out), title="charlm")
    assert png_size(out)[1] == 336  # 2.8 in at 120 dpi: no rank rows unless asked for
    with pytest.raises(ValueError, match="no events"):
        plot([], str(out))


def test_a_log_without_ranks_or_states_still_draws(tmp_path):
    events = [{"t": T0, "kind": "run_started"}, {"t": T0 + 1, "kind": "checkpoint_committed", "i": 0},
              {"t": T0 + 2, "kind": "step", "i": 1}]
    assert rank_spans(events) == {} and rank_marks(events) == []
    out = tmp_path / "t.png"
    assert main(["timeline", str(write_run("file", tmp_path, events)), "--out", str(out)]) == 0
    assert png_size(out)[1] > 0


# ------------------------------------------------------------------ a trace for Perfetto

_PHASES = {"X", "i", "M"}


def check_trace_event_format(trace: dict) -> None:
    """The JSON Object form of the trace-event format (Chrome's "Trace Event Format" document, the
    one Perfetto and chrome://tracing read): a traceEvents list; every event a name, a phase and a
    pid; complete events ("X") a ts and a non-negative dur in microseconds, instants ("i") a ts and
    a scope (g global, p process, t thread), metadata ("M") a name it defines and args."""
    assert set(trace) >= {"traceEvents"} and trace["displayTimeUnit"] in ("ms", "ns")
    for e in trace["traceEvents"]:
        assert isinstance(e["name"], str) and e["ph"] in _PHASES and isinstance(e["pid"], int), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index"), e
            assert isinstance(e["args"], dict) and ("tid" in e) == e["name"].startswith("thread"), e
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        else:
            assert e["s"] in ("g", "p", "t"), e
        assert isinstance(e.get("args", {}), dict)


def test_a_trace_has_the_controllers_states_checkpoints_and_events_and_one_track_per_rank(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    events = a_run()
    run_dir = write_run("file", tmp_path, events)
    out = tmp_path / "run.json"
    assert main(["timeline", run_dir, "--trace", str(out)]) == 0
    assert not (tmp_path / "timeline.png").exists()  # --trace alone writes the trace only
    trace = json.loads(out.read_text())  # strict JSON: json.loads would take NaN, the writer refuses it
    check_trace_event_format(trace)
    ev = trace["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"].endswith("_name")}
    spans = rank_spans(events)
    assert {names[(2, r)] for r in spans} == {f"rank {r}" for r in spans}
    assert [names[(1, t)] for t in (1, 2, 3)] == ["state", "checkpoints", "events"]
    # every event of the log is there, at its time, with its fields
    instants = [e for e in ev if e["ph"] == "i" and e["pid"] == 1]
    assert [e["name"] for e in instants] == [e["kind"] for e in events if e["kind"] != "state"]
    for e, log in zip(instants, [x for x in events if x["kind"] != "state"]):
        assert e["ts"] == pytest.approx((log["t"] - events[0]["t"]) * 1e6, abs=0.1)
        assert e["args"] == {k: v for k, v in log.items() if k not in ("t", "kind")}
    assert {e["name"] for e in instants if e["s"] == "g"} >= {"fault_injected", "recovered"}
    # the controller's states cover the run end to end, in order
    states = [e for e in ev if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == 1]
    assert states[0]["ts"] == 0 and all(a["ts"] + a["dur"] == pytest.approx(b["ts"], abs=0.2)
                                        for a, b in zip(states, states[1:]))
    assert [s["name"] for s in states][:2] == ["Starting", "Forming"] and "Recovering" in [s["name"] for s in states]
    # each committed checkpoint's persist ends at its commit
    commits = [e for e in events if e["kind"] == "checkpoint_committed" and e.get("persist_s") is not None]
    persists = [e for e in ev if e["ph"] == "X" and e["tid"] == 2 and e["pid"] == 1]
    assert len(persists) == len(commits) > 0
    # each rank's spans are its rows in the PNG
    for r, row in spans.items():
        got = [(e["name"], e["ts"], e["dur"]) for e in ev if e["ph"] == "X" and e["pid"] == 2 and e["tid"] == r]
        assert got == [(s.state, round(s.start_s * 1e6, 1), round((s.end_s - s.start_s) * 1e6, 1)) for s in row]
    marks = [e for e in ev if e["ph"] == "i" and e["pid"] == 2]
    assert len(marks) == len([m for m in rank_marks(events) if m.rank in spans]) > 0


def test_a_trace_and_a_png_together_and_a_value_json_cannot_hold(tmp_path):
    events = a_run()
    events[5] = {**events[5], "odd": float("nan")}
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    png, out = tmp_path / "t.png", tmp_path / "t.json"
    assert main(["timeline", str(log), "--trace", str(out), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads(out.read_text())
    check_trace_event_format(trace)
    assert any(e.get("args", {}).get("odd") == "nan" for e in trace["traceEvents"])


def test_a_run_leaves_each_ranks_newest_step_times_and_the_trace_draws_each_steps_compute_and_wait():
    from elastic.observability.trace import load_steps, to_trace
    from tests.test_controller import make
    c, _, _ = make(num_steps=30, report_compute=True)
    assert c.run()["status"] == "finished"
    steps = load_steps(c.run_dir)
    assert steps["fields"] == ["step", "t_end", "step_s", "compute_s"]
    assert {r: [row[0] for row in rows] for r, rows in steps["ranks"].items()} == {
        str(r): list(range(1, 31)) for r in range(3)}
    trace = to_trace(c.events.events, steps=steps)
    check_trace_event_format(trace)
    ev = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    for r in range(3):
        mine = [e for e in ev if e["tid"] == r]
        whole = [e for e in mine if e["name"].startswith("step ")]
        assert [e["args"]["step"] for e in whole] == list(range(1, 31))
        for w in whole:  # compute, then wait, tiling the step
            i = mine.index(w)
            parts = mine[i + 1:i + 3]
            assert [p["name"] for p in parts] == ["compute", "wait"]
            assert parts[0]["ts"] == w["ts"] and parts[0]["dur"] == pytest.approx(w["args"]["compute_s"] * 1e6, abs=0.2)
            assert parts[1]["ts"] + parts[1]["dur"] == pytest.approx(w["ts"] + w["dur"], abs=0.2)
    # a trace without steps.json has no step spans; a run folder without one gives None
    assert not [e for e in to_trace(c.events.events)["traceEvents"] if e.get("cat") == "step"]
    assert load_steps("memory://no-such-run/x") is None


def test_step_times_kept_per_rank_shrink_as_the_world_grows():
    from elastic.controller.records import RunLog
    log = RunLog()
    for s in range(5000):
        log.record_step(0, s, 1.0 + s, 0.1, 0.05, world=3)
    assert len(log.step_times[0]) == 2000 and log.step_times[0][-1][0] == 4999  # the newest
    log.record_step(0, 5000, 5001.0, 0.1, 0.05, world=1000)  # 100,000 records over all ranks
    assert len(log.step_times[0]) == 100 and log.step_times[0][-1][0] == 5000
    log.record_step(1, 1, 1.0, 0.1, 0.05, world=100_000)
    assert log.step_times[1].maxlen == 50  # a floor, so a trace always has some steps
