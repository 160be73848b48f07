"""The resize benchmark's pure parts (the runs themselves need a cluster: `python -m benchmarks resize`)."""
from benchmarks.resize import grow_timeline


def test_grow_timeline_counts_from_the_grow_decision_and_leaves_polls_out():
    events = [{"t": 100.0, "kind": "run_started"}, {"t": 101.0, "kind": "poll"},
              {"t": 110.0, "kind": "decision", "decision": "Restart"},
              {"t": 120.0, "kind": "decision", "decision": "Grow", "ranks": [2]},
              {"t": 134.5, "kind": "resize_completed", "resize_s": 14.5}]
    out = grow_timeline(events)
    assert [(e["t_from_grow_decision_s"], e["kind"]) for e in out] == [
        (-20.0, "run_started"), (-10.0, "decision"), (0.0, "decision"), (14.5, "resize_completed")]
    assert "t" not in out[0] and out[2]["ranks"] == [2]
    # A run that never grew counts from its start.
    assert grow_timeline(events[:2])[0]["t_from_grow_decision_s"] == 0.0
