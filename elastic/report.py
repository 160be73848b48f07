"""Human-readable views of a run: one line per event, and the end-of-run summary."""
from __future__ import annotations


def describe_event(ev: dict) -> str:
    k = ev["kind"]
    if k == "fault_injected":
        return f"FAULT  {ev['action']} on rank {ev['rank']} after step {ev['step']}"
    if k == "failure_detected":
        lost = ", ".join(f"rank {x['rank']} {x['cause']}" for x in ev["lost"]) or "no rank lost"
        d = f" in {ev['detect_s']:.2f}s" if ev.get("detect_s") is not None else ""
        return f"DETECT {lost}{d}"
    if k == "decision":
        return f"DECIDE {ev['decision']}: {ev['reason']}"
    if k == "recovered":
        return (f"RECOVERED in {ev['recover_s']:.2f}s: resumed at step {ev['resumed_step']}, "
                f"{ev['lost_steps']} step(s) redone, world size {ev['world_size']}")
    if k == "checkpoint_skipped":
        return f"SKIP checkpoint {ev['uri']}: {ev['reason']}"
    if k == "hang_detected":
        return f"HANG ranks {ev['ranks']}: {ev['reason']}"
    if k == "workers_replaced":
        return f"REPLACED ranks {ev['ranks']} in {ev['start_s']:.2f}s"
    if k == "checkpoint_failed":
        return f"CHECKPOINT step {ev['step']} not committed: {ev['error']}"
    if k == "user_error":
        return f"ERROR in training code on rank {ev['rank']} at step {ev['step']}: {ev['error']}"
    return f"{k} " + " ".join(f"{a}={b}" for a, b in ev.items() if a not in ("t", "kind"))


def summarize(result) -> str:
    ev = result.events
    t0 = ev[0]["t"] if ev else 0.0
    t1 = ev[-1]["t"] if ev else 0.0
    commits = [e for e in ev if e["kind"] == "checkpoint_committed"]
    lines = [
        "=" * 64,
        f"run {result.run_dir}",
        f"  steps: {result.metrics.get('step')}   final loss: {_f(result.metrics.get('loss'))}   "
        f"wall time: {t1 - t0:.1f}s",
        f"  checkpoints committed: {len(commits)}   last: {result.checkpoint or 'none'}",
    ]
    faults = [e for e in ev if e["kind"] == "fault_injected"]
    recoveries = [e for e in ev if e["kind"] == "recovered"]
    decisions = [e for e in ev if e["kind"] == "decision"]
    if not faults and not recoveries:
        lines.append("  faults: none")
    for i, f in enumerate(faults):
        lines.append(f"  fault {i + 1}: {f['action']} on rank {f['rank']} after step {f['step']}")
        if i < len(decisions):
            lines.append(f"    decided: {decisions[i]['decision']} ({decisions[i]['reason']})")
        if i < len(recoveries):
            r = recoveries[i]
            lines.append(f"    detected in {_f(r['detect_s'], 2)}s, recovered in {_f(r['recover_s'], 2)}s "
                         f"(fault -> first step done), resumed at step {r['resumed_step']}, "
                         f"{r['lost_steps']} step(s) redone")
    final = [e for e in ev if e["kind"] == "final_state"]
    if final:
        lines.append(f"  all ranks hold identical final state: {final[-1]['replicas_identical']}")
    lines.append(f"  event log: {result.run_dir}/events.jsonl")
    lines.append("=" * 64)
    return "\n".join(lines)


def _f(x, nd: int = 4) -> str:
    return "-" if x is None else f"{x:.{nd}f}"
