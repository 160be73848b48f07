"""Draw a run's timeline from its event log alone: controller states as spans, faults,
decisions and recoveries as markers, committed checkpoints as ticks; below the controller,
one row per rank (`rank_spans`, `rank_marks`): what each rank was doing, where faults hit it,
when it was lost, replaced or swapped, and rows that appear or end as the world size changes."""
from __future__ import annotations

import os
from typing import NamedTuple

from elastic.config.loading import ConfigError
from elastic.observability.events import EVENTS_FILE, parse_lines, read_events

STATE_COLORS = {"Starting": "#cccccc", "Forming": "#9ecae1", "Restoring": "#6baed6", "Running": "#74c476",
                "Recovering": "#fd8d3c", "Swapping": "#fdd0a2", "Growing": "#c6dbef", "Dropping": "#dadaeb",
                "Trading": "#e5f5e0", "Finished": "#ffffff", "Errored": "#de2d26"}
MARKERS = {"fault_injected": ("x", "#de2d26", "fault"), "failure_detected": ("v", "#e6550d", "detected"),
           "recovered": ("^", "#31a354", "recovered"), "swapped": ("s", "#756bb1", "swapped"),
           "slow_window": (".", "#9e9ac8", "slow window"), "resized": ("D", "#3182bd", "resized")}
# paused: stopped at a step boundary for a planned change (a swap, a drop, a growth, a trade); recovering: after a failure
RANK_COLORS = {"starting": "#cccccc", "running": "#74c476", "paused": "#c6dbef", "recovering": "#fd8d3c",
               "lost": "#de2d26"}
_PLANNED = ("Swapping", "Dropping", "Growing", "Trading")
# (matplotlib marker, color, legend label) for each kind of per-rank mark
RANK_MARKERS = {"fault": ("x", "#67000d", "fault on a rank"), "detected": ("v", "#e6550d", "rank found lost"),
                "replaced": ("o", "#31a354", "rank replaced"), "swapped": ("s", "#756bb1", "rank swapped"),
                "slow": (".", "#54278f", "rank slow"), "dropped": ("D", "#3182bd", "rank dropped"),
                "error": ("*", "#000000", "training code raised")}


class Span(NamedTuple):
    """One rank in one state, in seconds since the first event of the log."""
    start_s: float
    end_s: float
    state: str  # a key of RANK_COLORS


class Mark(NamedTuple):
    t_s: float
    rank: int
    kind: str  # a key of RANK_MARKERS
    label: str


class UnreadableLog(ConfigError):
    """No event log where the user pointed: a run folder that does not exist, one that cannot be
    read, or a file that is not an event log. One line naming the place and what to give."""


class MissingExtra(ConfigError, ImportError):
    """A command needs an optional extra that is not installed; the message names what to
    install."""


GIVE = ("give a run folder (a path, file://, s3://...) holding events.jsonl or events/*.jsonl "
        "segments, or an events.jsonl file")


def load_log(path: str, storage_options: dict | None = None) -> list[dict]:
    """`load` for the commands: the events, or UnreadableLog (credentials redacted) where there
    are none to read, or where what is read is not elastic's events."""
    from elastic.config.secrets import redact_uri
    from elastic.storage import StorageError
    where = redact_uri(path)
    try:
        events = load(path, storage_options)
    except (StorageError, OSError, UnicodeDecodeError) as e:
        cause = redact_uri(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        raise UnreadableLog(f"cannot read the event log of {where}: {cause}; check the path or "
                            f"URI, --storage-option and credentials") from None
    if not events:
        raise UnreadableLog(f"no events in {where}: {GIVE}")
    bad = next((i for i, e in enumerate(events)
                if not (isinstance(e, dict) and "t" in e and "kind" in e)), None)
    if bad is not None:
        raise UnreadableLog(f"{where} is not an elastic event log (its event {bad + 1} has no "
                            f"'t' or 'kind'): {GIVE}")
    return events


def load(path: str, storage_options: dict | None = None) -> list[dict]:
    """Events from a local run's events.jsonl, or from a run folder given as a path or URI (an
    object store's run keeps its log as numbered segments; credentials from `storage_options` or
    the environment). A folder that does not exist has no events."""
    if "://" in path or not os.path.isfile(path):
        storage = run_folder(path, storage_options)
        return read_events(storage, storage.uri)
    with open(path) as f:
        return parse_lines(f.read(), path)


def run_folder(path: str, storage_options: dict | None = None):
    """The Storage of a run folder given as a path or URI, or as the path of its events.jsonl."""
    from elastic.storage import Storage
    return Storage(path.rstrip("/").removesuffix("/" + EVENTS_FILE), storage_options)


def rank_spans(events: list[dict]) -> dict[int, list[Span]]:
    """rank -> its states over time, from the event log alone. A row is a rank number, not a
    process: a replaced rank's row goes on with its new process, and after a shrink the ranks
    are renumbered 0..n-1, so the highest rows end."""
    return _walk(events)[0]


def rank_marks(events: list[dict]) -> list[Mark]:
    """Faults, losses, replacements, swaps, slow windows and drops, each on its rank's row."""
    return _walk(events)[1]


class _Rows:
    def __init__(self) -> None:
        self.open: dict[int, tuple[float, str]] = {}
        self.done: dict[int, list[Span]] = {}

    def set(self, rank: int, state: str, t: float) -> None:
        cur = self.open.get(rank)
        if cur is not None and cur[1] == state:
            return
        self.end(rank, t)
        self.open[rank] = (t, state)

    def end(self, rank: int, t: float) -> None:
        cur = self.open.pop(rank, None)
        if cur is not None:
            self.done.setdefault(rank, []).append(Span(cur[0], t, cur[1]))

    def lost_since(self, rank: int, since: float, t: float) -> None:
        """The rank was lost from `since` (its fault), found out only at `t`: rewrite its row from then."""
        self.end(rank, t)
        kept = []
        for s in self.done.get(rank, []):
            if s.start_s < since:
                kept.append(s._replace(end_s=min(s.end_s, since)))
        self.done[rank] = kept
        self.open[rank] = (since, "lost")

    def result(self, t_end: float) -> dict[int, list[Span]]:
        for rank in list(self.open):
            self.end(rank, t_end)
        out = {}
        for rank, spans in sorted(self.done.items()):
            merged: list[Span] = []
            for s in spans:
                if s.end_s <= s.start_s:
                    continue
                if merged and merged[-1].state == s.state and merged[-1].end_s >= s.start_s:
                    merged[-1] = merged[-1]._replace(end_s=max(merged[-1].end_s, s.end_s))
                else:
                    merged.append(s)
            if merged:
                out[rank] = merged
        return out


def _walk(events: list[dict]) -> tuple[dict[int, list[Span]], list[Mark]]:
    if not events:
        return {}, []
    t0 = events[0]["t"]
    rows, marks = _Rows(), []
    ctl = None            # the controller's state, from the last `state` event
    ran = False           # Running reached since the (re)start: later stops are pauses or recoveries
    stop = "recovering"   # what the ranks are doing while the controller is out of Running
    members: set[int] = set()
    lost: set[int] = set()
    fault_t: dict[int, float] = {}  # rank -> when a fault hit it, until the controller finds it lost
    prev_t = 0.0

    def rank_state(r: int) -> str:
        if r in lost:
            return "lost"
        if ctl == "Running":
            return "running"
        return stop if ran else "starting"

    def end_all(t: float) -> None:
        for r in members:
            rows.end(r, t)
        members.clear()
        lost.clear()

    for e in events:
        t, k = e["t"] - t0, e.get("kind")
        if k == "run_started":  # also a resumed run going on with the same log
            end_all(prev_t)  # what happened after the last event of a run whose driver died is unknown
            members.update(range(int(e.get("num_workers") or 0)))
            ctl, ran = "Starting", False
            fault_t.clear()
        elif k == "workers_started":
            members.update(int(r) for r in e.get("ranks", []))
        elif k == "state":
            ctl = e.get("new")
            ran = ran or ctl == "Running"
            if ctl == "Recovering" or ctl in _PLANNED:  # a failure during a planned change makes it a recovery
                stop = "paused" if ctl in _PLANNED and e.get("old") == "Running" else "recovering"
            if ctl in ("Finished", "Errored"):
                end_all(t)
        elif k in ("run_finished", "run_failed"):
            end_all(t)
        elif k == "fault_injected" and e.get("rank") is not None:
            r = int(e["rank"])
            marks.append(Mark(t, r, "fault", f"{e.get('action')} after step {e.get('step')}"))
            if e.get("action") not in ("slow", "hold_gil"):  # a slowed or held rank keeps training
                fault_t[r] = t
        elif k == "failure_detected":
            for x in e.get("lost", []):
                r = int(x["rank"])
                marks.append(Mark(t, r, "detected", str(x.get("cause"))))
                if r in members:
                    lost.add(r)
                    rows.lost_since(r, fault_t.pop(r, t), t)
        elif k == "user_error" and e.get("rank") is not None:
            marks.append(Mark(t, int(e["rank"]), "error", str(e.get("error", ""))[:80]))
        elif k == "workers_replaced":
            how = e.get("how") or {}
            for r in map(int, e.get("ranks", [])):
                lost.discard(r)
                fault_t.pop(r, None)
                members.add(r)
                marks.append(Mark(t, r, "replaced", str(how.get(str(r), ""))))
        elif k == "worker_replaced" and e.get("rank") is not None:
            marks.append(Mark(t, int(e["rank"]), "replaced", str(e.get("reason", ""))[:80]))
        elif k == "swapped" and e.get("rank") is not None:
            marks.append(Mark(t, int(e["rank"]), "swapped", str(e.get("how", ""))))
        elif k == "slow_window":
            for r in map(int, (e.get("slow_steps") or e.get("consecutive") or {})):
                marks.append(Mark(t, r, "slow", f"x{(e.get('ratios') or {}).get(str(r))} at step {e.get('step')}"))
        elif k == "decision" and e.get("decision") == "Drop":
            for r in map(int, e.get("ranks", [])):
                marks.append(Mark(t, r, "dropped", str(e.get("reason", ""))[:80]))
        elif k in ("resized", "group_formed"):
            if k == "group_formed":
                fault_t.clear()  # a fault that was never found (a freeze that thawed) is over
            n = e.get("new_world_size" if k == "resized" else "world_size")
            if n is not None and set(range(int(n))) != members:
                # Ranks are renumbered 0..n-1: the highest rows end (a shrink) or new ones begin (a growth).
                for r in members - set(range(int(n))):
                    rows.end(r, t)
                members.clear()
                members.update(range(int(n)))
                if k == "resized" and int(n) < int(e.get("old_world_size") or 0):
                    lost.clear()  # the lost ranks are gone; their numbers now belong to survivors
                lost.intersection_update(members)
        if ctl is not None:
            for r in members:
                rows.set(r, rank_state(r), t)
        prev_t = t
    return rows.result(events[-1]["t"] - t0), marks


def plot(events: list[dict], out_png: str, title: str = "", per_rank: bool = False) -> None:
    """The controller's row; with `per_rank`, one row per rank below it (rank 0 on top)."""
    if not events:
        raise ValueError("no events to draw")
    try:
        import matplotlib
    except ImportError as e:  # an optional extra: the core install trains without it
        raise MissingExtra("drawing a timeline as a PNG needs matplotlib: pip install "
                           "'elastic-trainer[plot]' (or write a trace alone, --trace JSON, which "
                           "needs nothing more)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = rank_spans(events) if per_rank else {}
    num_rows = max(spans, default=-1) + 1
    seen: set = set()
    if not num_rows:
        height_in = 2.8
        fig, ax = plt.subplots(figsize=(10, height_in))
        axes = [ax]
        _plot_controller(ax, events, seen)
    else:
        rows_in = min(0.3 * num_rows + 0.3, 20.0)  # big worlds get thinner rows, not an endless image
        height_in = 3.0 + rows_in
        fig, axes = plt.subplots(2, 1, sharex=True, figsize=(10, height_in),
                                 gridspec_kw={"height_ratios": [1.2, rows_in]})
        _plot_controller(axes[0], events, seen)
        axes[0].set_yticks([1], ["controller"], fontsize=8)
        _plot_ranks(axes[1], spans, rank_marks(events), num_rows, seen)
    axes[0].set_title(title or "run timeline")
    axes[-1].set_xlabel("seconds since run start")
    handles, labels = [], []
    for a in axes:
        h, lab = a.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=8, frameon=False)
    legend_in = 0.15 + 0.19 * -(-len(labels) // 6)  # rows of six entries at the bottom
    fig.tight_layout(rect=(0, legend_in / height_in, 1, 1))
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def _plot_controller(ax, events: list[dict], seen: set) -> None:
    t0 = events[0]["t"]
    states = [e for e in events if e["kind"] == "state"]
    if states:  # the state before the first transition runs from the start of the log
        states = [{"t": t0, "new": states[0]["old"]}] + states
    for a, b in zip(states, states[1:] + [events[-1]]):
        ax.barh(1, b["t"] - a["t"], left=a["t"] - t0, color=STATE_COLORS.get(a["new"], "#dddddd"),
                edgecolor="none", height=0.5)
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


def _plot_ranks(ax, spans: dict[int, list[Span]], marks: list[Mark], num_rows: int, seen: set) -> None:
    for rank, row in spans.items():
        for s in row:
            ax.barh(rank, s.end_s - s.start_s, left=s.start_s, color=RANK_COLORS[s.state], edgecolor="none",
                    height=0.6)
    for m in marks:
        if m.rank >= num_rows:
            continue
        shape, color, label = RANK_MARKERS[m.kind]
        ax.scatter(m.t_s, m.rank, marker=shape, color=color, s=40, zorder=4,
                   label=None if label in seen else label)
        seen.add(label)
    for name, color in RANK_COLORS.items():
        if any(s.state == name for row in spans.values() for s in row):
            ax.barh(-5, 0, color=color, label=f"rank {name}")  # legend entry only
    ax.set_ylim(num_rows - 0.5, -0.5)  # rank 0 on top, just under the controller
    labelled = range(0, num_rows, max(1, num_rows // 48))
    ax.set_yticks(list(labelled), [f"rank {r}" for r in labelled], fontsize=8)
