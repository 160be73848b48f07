"""The event log alone is enough to draw the run's timeline."""
import json

from elastic.cli import main


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
