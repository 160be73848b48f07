"""Human-readable views of a run: one line per event, and the end-of-run summary."""
from __future__ import annotations

from elastic.observability.events import event_log_uri


def _moved(ev: dict) -> str:
    """Where the restore moved state rank to rank: when it was in place, how much, how fast."""
    if ev.get("state_in_place_s") is None:
        return ""
    rate = ev.get("moved_gb_per_s")
    moved = (f", {ev['moved_bytes'] / 1e9:.2f} GB moved" + (f" at {rate} GB/s" if rate else "")
             if ev.get("moved_bytes") is not None else "")
    return f"; state in place after {ev['state_in_place_s']:.2f}s{moved}"


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
    if k == "resize_completed":
        return (f"RESIZED {ev['old_world_size']} -> {ev['new_world_size']} ranks via {ev['path']}: first step "
                f"{ev['resize_s']:.2f}s after the decision{_moved(ev)}")
    if k == "recovered":
        return (f"RECOVERED in {ev['recover_s']:.2f}s: resumed at step {ev['resumed_step']}, "
                f"{ev['lost_steps']} step(s) redone, world size {ev['world_size']}{_moved(ev)}")
    if k == "checkpoint_skipped":
        return f"SKIP checkpoint {ev['uri']}: {ev['reason']}"
    if k == "hang_detected":
        return f"HANG ranks {ev['ranks']}: {ev['reason']}"
    if k == "silence_detected":
        return f"SILENT ranks {ev['ranks']}: {ev['reason']}"
    if k == "silence_excused":
        return (f"BUSY rank {ev['rank']}: no poll answered for {ev['unanswered_s']:.1f}s, but its node's heartbeat "
                f"says the process runs (state {ev['state']}): kept")
    if k == "checkpoint_deferred":
        return f"CHECKPOINT step {ev['step']} deferred: {ev['reason']}"
    if k == "checkpoint_retry":
        return f"CHECKPOINT step {ev['step']} saved again: {ev['reason']}"
    if k == "workers_replaced":
        return f"REPLACED ranks {ev['ranks']} in {ev['start_s']:.2f}s"
    if k == "persist_abandoned":
        return f"CHECKPOINT step {ev['step']} abandoned on rank {ev['rank']}: {ev['reason']}"
    if k == "storage_unanswered":
        return f"STORAGE no answer in {ev['waited_s']:.1f}s to '{ev['op']}'; going on with {ev['using']}"
    if k == "generations_continued":
        return f"FENCE an earlier submission reached generation {ev['after']}; this run's groups start at {ev['after'] + 1}"
    if k == "fence_not_written":
        return f"FENCE generation {ev['generation']} not written yet: {ev['error']}"
    if k == "final_checkpoint_retry":
        return (f"FINAL CHECKPOINT step {ev['step']} not committed: saving it again (try {ev['attempt']}, "
                f"{ev['left_s']:.0f}s left; newest committed: {ev['newest'] or 'none'})")
    if k == "final_checkpoint_committed":
        return f"FINAL CHECKPOINT step {ev['step']} committed after {ev['attempts']} more save(s), {ev['waited_s']:.1f}s"
    if k == "final_checkpoint_missing":
        return (f"FINAL CHECKPOINT step {ev['step']} never committed ({ev['attempts']} more save(s), "
                f"{ev['waited_s']:.0f}s); newest committed: {ev['newest'] or 'none'}")
    if k == "checkpoint_failed":
        return f"CHECKPOINT step {ev['step']} not committed: {ev['error']}"
    if k == "logger_failed":
        return f"LOGGER {ev['logger']} ({ev['where']}) failed: {ev['error']}; {ev['then']}"
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
    losses = [(c["step"], c["loss"]) for c in commits if c.get("loss") is not None]
    if len(losses) >= 2:
        picks = losses[:: max(1, len(losses) // 5)]
        if picks[-1] != losses[-1]:
            picks.append(losses[-1])
        lines.append("  loss by checkpoint: " + ", ".join(f"step {s} {x:.3f}" for s, x in picks))
    # Walk the log in order: injected faults, failures elastic detected on its own (a pod deleted
    # from outside, a real crash), the decision taken for each, and how the recovery went.
    incidents = 0
    for e in ev:
        k = e["kind"]
        if k == "fault_injected":
            incidents += 1
            lines.append(f"  fault: {e['action']} on rank {e['rank']} after step {e['step']} (injected)")
        elif k == "failure_detected" and (not incidents or lines[-1].startswith("    ")):
            incidents += 1
            lost = ", ".join(f"rank {x['rank']} {x['cause']}" for x in e["lost"]) or "collective error"
            lines.append(f"  failure: {lost} at step {e['step']}")
        elif k == "decision":
            lines.append(f"    decided: {e['decision']} ({e['reason']})")
        elif k == "workers_replaced":
            how = ", ".join(f"rank {r} by a {h}" for r, h in e["how"].items())
            lines.append(f"    replaced {how} in {_f(e['start_s'], 2)}s")
        elif k == "restored" and incidents and e["source"] != "init":
            src = (f"the memory of {e['source']} (no storage read)" if e["source"].startswith("peer")
                   else e["uri"] or e["source"])
            lines.append(f"    state from {src}, at step {e['step']}")
        elif k == "resized":
            lines.append(f"  resized: {e['old_world_size']} -> {e['new_world_size']} ranks ({e['reason'][:120]}), "
                         f"state from {e['path']}")
        elif k == "resize_completed":
            lines.append(f"    first step at {e['new_world_size']} ranks {_f(e['resize_s'], 2)}s after the decision "
                         f"(state via {e['path']}: {e.get('source') or '-'}, restore {_f(e.get('restore_s'), 2)}s)")
        elif k == "reshard_failed":
            lines.append(f"    re-shard in memory failed, state from storage instead: {e['error'][:120]}")
        elif k == "swapped":
            lines.append(f"    swapped rank {e['rank']} for a {e['how']} in {_f(e['swap_s'], 2)}s")
        elif k == "final_checkpoint_committed":
            lines.append(f"  final checkpoint: not committed at first (storage), committed after "
                         f"{e['attempts']} more save(s), {_f(e['waited_s'], 1)}s")
        elif k == "final_checkpoint_missing":
            lines.append(f"  final checkpoint: NEVER committed ({e['attempts']} more save(s), "
                         f"{_f(e['waited_s'], 0)}s); newest committed: {e['newest'] or 'none'}")
        elif k == "recovered":
            since = e.get("measured_from", "fault")
            lines.append(f"    detected in {_f(e['detect_s'], 2)}s, recovered in {_f(e['recover_s'], 2)}s "
                         f"({since} -> first step done), resumed at step {e['resumed_step']}, "
                         f"{e['lost_steps']} step(s) redone")
    if not incidents:
        lines.append("  faults: none")
    final = [e for e in ev if e["kind"] == "final_state"]
    if final:
        strategy = result.metrics.get("strategy")
        what = "gathered (unsharded) final state" if strategy == "fsdp" else "final state"
        who = "replicas of every stage" if strategy == "pipeline" else "all ranks"
        lines.append(f"  {who} hold identical {what}: {final[-1]['replicas_identical']}")
    lines.append(f"  event log: {event_log_uri(result.run_dir)}")
    lines.append("=" * 64)
    return "\n".join(lines)


def _f(x, nd: int = 4) -> str:
    return "-" if x is None else f"{x:.{nd}f}"
