"""Draw a run's timeline from its event log alone: controller states as spans, faults,
decisions and recoveries as markers, committed checkpoints as ticks."""
from __future__ import annotations

import os

from elastic.telemetry import EVENTS_FILE, parse_lines, read_events

STATE_COLORS = {"Starting": "#cccccc", "Forming": "#9ecae1", "Restoring": "#6baed6", "Running": "#74c476",
                "Recovering": "#fd8d3c", "Swapping": "#fdd0a2", "Growing": "#c6dbef", "Finished": "#ffffff", "Errored": "#de2d26"}
MARKERS = {"fault_injected": ("x", "#de2d26", "fault"), "failure_detected": ("v", "#e6550d", "detected"),
           "recovered": ("^", "#31a354", "recovered"), "swapped": ("s", "#756bb1", "swapped"),
           "slow_window": (".", "#9e9ac8", "slow window"), "resized": ("D", "#3182bd", "resized")}


def load(path: str) -> list[dict]:
    """Events from a local run's events.jsonl, or from a run folder given as a path or URI (an
    object store's run keeps its log as numbered segments; credentials come from the environment)."""
    if "://" in path or os.path.isdir(path):
        from elastic.storage import Storage
        storage = Storage(path.removesuffix("/" + EVENTS_FILE))
        return read_events(storage, storage.uri)
    with open(path) as f:
        return parse_lines(f.read(), path)


def plot(events: list[dict], out_png: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = events[0]["t"]
    fig, ax = plt.subplots(figsize=(10, 2.8))
    states = [e for e in events if e["kind"] == "state"]
    if states:  # the state before the first transition runs from the start of the log
        states = [{"t": t0, "new": states[0]["old"]}] + states
    for a, b in zip(states, states[1:] + [events[-1]]):
        ax.barh(1, b["t"] - a["t"], left=a["t"] - t0, color=STATE_COLORS.get(a["new"], "#dddddd"),
                edgecolor="none", height=0.5)
    seen = set()
    for e in events:
        if e["kind"] in MARKERS:
            m, c, label = MARKERS[e["kind"]]
            ax.scatter(e["t"] - t0, 0.4, marker=m, color=c, s=60, zorder=3,
                       label=None if label in seen else label)
            seen.add(label)
        elif e["kind"] == "checkpoint_committed":
            ax.vlines(e["t"] - t0, 0.1, 0.25, color="#555555", lw=1,
                      label=None if "checkpoint" in seen else "checkpoint committed")
            seen.add("checkpoint")
    for name, color in STATE_COLORS.items():
        if any(s["new"] == name for s in states) and name != "Finished":
            ax.barh(-5, 0, color=color, label=name)  # legend entry only
    ax.set_ylim(0, 1.4)
    ax.set_yticks([])
    ax.set_xlabel("seconds since run start")
    ax.set_title(title or "run timeline")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
