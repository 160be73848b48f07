"""Where a churn run's steps went: each rank's step and compute times, before the faults and in
every interval between a recovery and the next fault, from the `churn-steps-SYSTEM-seedN.json`
that `python -m benchmarks churn --out DIR` writes.

    python -m benchmarks.probes.churn_steps DIR/churn-steps-elastic-seed1.json[.gz] [WORKERS_CPU.jsonl[.gz]]

Per interval: steps, steps/s, and medians over its steps of the group's step time (the slowest
rank's), each rank's compute time (forward and backward, its own work) and the rest of the step
(step - compute: waiting for peers in the all-reduce, and everything else around the compute).
With the output of `benchmarks/probes/sched_watch.py` taken during the run, also per 6 s window:
the ranks' median compute time, and the CPU the ranks' processes and the other workers (those at
SCHED_IDLE: pre-started workers and spares starting) used. For a group that shrank: its steps
below full size, and the window's steps counted as a cluster would make them. And the churn
window in 10 s slices, classed by what happened in each (a fault, a replacement node joining,
nothing), with the median steps/s of each class; and how long each growth back to full size paused
the steps.
"""
from __future__ import annotations

import collections
import gzip
import json
import statistics
import sys


def _open(path: str):
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def intervals(trace: dict) -> list[tuple[str, float, float]]:
    """(label, start, end) in wall-clock time: the fault-free window, then each stretch from a
    `recovered` to the next `failure_detected` (or the end of the churn window)."""
    t0, t1 = trace["t_churn"], trace["t_end"]
    ev = sorted(trace["events"], key=lambda e: e["t"])
    detected = [e["t"] for e in ev if e["kind"] == "failure_detected" and t0 <= e["t"] <= t1]
    out = [("before the faults", t0 - 30.0, min([t0, *detected]))]
    for e in ev:
        if e["kind"] == "recovered" and t0 <= e["t"] <= t1:
            nxt = min([d for d in detected if d > e["t"]] + [t1])
            out.append((f"after recovery at +{e['t'] - t0:.0f}s", e["t"], nxt))
    return out


def describe(trace: dict) -> list[dict]:
    steps = {int(r): rows for r, rows in trace["steps"].items()}
    rows = []
    for label, a, b in intervals(trace):
        by_step: dict[int, dict[int, tuple[float, float]]] = {}
        for r, recs in steps.items():
            for step, end, step_s, compute_s in recs:
                if a < end <= b:
                    by_step.setdefault(step, {})[r] = (step_s, compute_s)
        full = {s: v for s, v in by_step.items() if len(v) == len(steps)}
        if len(full) < 5 or b - a < 2.0:
            continue
        group = [max(st for st, _ in v.values()) for v in full.values()]
        row = {"interval": label, "seconds": round(b - a, 1), "steps": len(full),
               "steps_per_s": round(len(full) / (b - a), 1), "step_ms": round(statistics.median(group) * 1e3, 1)}
        for r in sorted(steps):
            comp = [v[r][1] for v in full.values()]
            rest = [v[r][0] - v[r][1] for v in full.values()]
            row[f"rank{r}_compute_ms"] = round(statistics.median(comp) * 1e3, 1)
            row[f"rank{r}_rest_ms"] = round(statistics.median(rest) * 1e3, 1)
        rows.append(row)
    return rows


def by_window(trace: dict, workers_cpu: list[dict], window_s: float = 6.0) -> list[dict]:
    """Per window of the run: the ranks' median compute time and the CPU (in cores) used by the
    processes that held ranks and by workers at SCHED_IDLE (policy 5)."""
    t0 = trace["t_churn"]
    ranks = {p for e in trace["events"] if e["kind"] in ("workers_started", "workers_replaced")
             for p in (e.get("pids") or {}).values()}
    samples = collections.defaultdict(list)
    for row in workers_cpu:
        samples[row["pid"]].append(row)
    cpu = collections.defaultdict(lambda: collections.Counter())
    for pid, rows in samples.items():
        for a, b in zip(rows, rows[1:]):
            k = int((b["t"] - t0) // window_s)
            idle = bool(a["policies"].get("5"))
            cpu[k]["idle" if idle else "ranks" if pid in ranks else "other"] += (b["ticks"] - a["ticks"]) / 100
    compute = collections.defaultdict(list)
    for recs in trace["steps"].values():
        for _, end, _, compute_s in recs:
            compute[int((end - t0) // window_s)].append(compute_s)
    return [{"t_s": k * window_s, "compute_ms": round(statistics.median(compute[k]) * 1e3, 1),
             "ranks_cores": round(cpu[k]["ranks"] / window_s, 2), "idle_workers_cores": round(cpu[k]["idle"] / window_s, 2)}
            for k in sorted(compute) if len(compute[k]) >= 10 and k * window_s >= -30]


def _rank0_rows(trace: dict) -> list[list]:
    """Rank 0's step records (its key is "0" once the trace went through JSON)."""
    return trace["steps"].get("0") or trace["steps"].get(0) or []


def below_full(trace: dict) -> dict | None:
    """Steps of the churn window run below full size, their rate, and the window's steps counted
    as a cluster would make them (`benchmarks.churn.below_full_figures`); None without rank 0's records."""
    from benchmarks.churn import NUM_WORKERS, below_full_figures
    rows0 = _rank0_rows(trace)
    window = [r for r in rows0 if trace["t_churn"] < r[1] <= trace["t_end"]]
    if not window:
        return None
    formed = [(e["t"], e["world_size"]) for e in trace["events"] if e["kind"] == "group_formed"]
    first, last = min(r[0] for r in window) - 1, max(r[0] for r in window)
    return {"steps": last - first, **below_full_figures(rows0, formed, first, last, NUM_WORKERS)}


def by_phase(trace: dict, window_s: float = 10.0, replace_after_s: float = 10.0) -> list[dict]:
    """The churn window cut into `window_s` slices, each classed by what happened in it: a fault
    fired; else a replacement node joined (`replace_after_s` after a node was lost: its daemons
    start on this machine's shared cores); else nothing in it or the slice before ("calm").
    Per class: slices, and the median of their steps/s (rank 0's steps ended in the slice)."""
    t0, t1 = trace["t_churn"], trace["t_end"]
    fired = [f["fired_s"] for f in trace.get("faults", []) if "fired_s" in f]
    joins = [f["fired_s"] + replace_after_s for f in trace.get("faults", [])
             if "fired_s" in f and f["action"] in ("kill_node", "freeze_node")]
    rows0 = _rank0_rows(trace)
    n = int((t1 - t0) // window_s)
    per = [0] * n
    for step, end, *_ in rows0:
        k = int((end - t0) // window_s)
        if 0 <= k < n:
            per[k] += 1
    classes: dict[str, list[float]] = collections.defaultdict(list)
    for k in range(n):
        a, b = k * window_s, (k + 1) * window_s
        if any(a <= f < b for f in fired):
            c = "a fault fired"
        elif any(a <= j < b for j in joins):
            c = "a replacement node joined"
        elif any(a - window_s <= f < a for f in fired):
            c = "after a fault"
        else:
            c = "calm"
        classes[c].append(per[k] / window_s)
    return [{"slices": c, "count": len(v), "median_steps_per_s": round(statistics.median(v), 1)}
            for c, v in classes.items()]


def grow_pauses(trace: dict) -> list[float]:
    """For each growth back to full size: rank 0's last step before the Grow decision to its
    first step after the larger group formed (the planned stop, formation and restore)."""
    ev = sorted(trace["events"], key=lambda e: e["t"])
    ends = sorted(r[1] for r in _rank0_rows(trace))
    out = []
    for i, e in enumerate(ev):
        if e["kind"] == "decision" and e.get("decision") == "Grow":
            formed = next((x["t"] for x in ev[i:] if x["kind"] == "group_formed"), None)
            before = max((t for t in ends if t <= e["t"]), default=None)
            after = min((t for t in ends if formed is not None and t >= formed), default=None)
            if before is not None and after is not None:
                out.append(after - before)
    return out


def table(rows: list[dict]) -> None:
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "")) for k in keys) + " |")


def main(path: str, workers_cpu: str | None = None) -> int:
    with _open(path) as f:
        trace = json.load(f)
    rows = describe(trace)
    if not rows:
        print("no interval with step records", file=sys.stderr)
        return 1
    table(rows)
    print()
    table(by_phase(trace))
    small = below_full(trace)
    if small and small["steps_below_full"]:
        print(f"\nchurn window: {small['steps']} steps, {small['steps_below_full']} below full size "
              f"({small['steps_per_s_below_full'] or 0:.1f} steps/s over {small['seconds_below_full']} s); "
              f"counted as a cluster makes them (a step at w of n ranks counts w/n): {small['rank_bound_steps']:.0f}")
    pauses = grow_pauses(trace)
    if pauses:
        print(f"grew back {len(pauses)} times; steps paused {statistics.median(pauses):.2f} s median "
              f"(max {max(pauses):.2f}), {sum(pauses):.2f} s in all")
    if workers_cpu:
        with _open(workers_cpu) as f:
            print()
            table(by_window(trace, [json.loads(line) for line in f]))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
