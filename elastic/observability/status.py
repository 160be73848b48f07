"""`elastic status RUN`: where a run stands, from its event log alone (so it works for a run
that is still going, one that finished, and one whose driver is gone).

`summarize(events)` folds the log into a plain dict: the run's state and the controller's,
step, world size, loss, the last committed checkpoint, and one record per incident (a failure
and its recovery, a straggler swapped, dropped or reported, a growth, a regroup or trade). `format_status` prints
it, one line per incident. It reads the fields docs/events.md lists, plus two the controller
also writes: `loss` (and the loss function's own `metrics`) on `checkpoint_committed` and
`run_dir` on `run_started`.
"""
from __future__ import annotations

import json
import sys
import time

# Events whose `step` is a step the run reached (a `restored` event sets it back: steps redone).
_STEP_KINDS = ("checkpoint_committed", "checkpoint_deferred", "checkpoint_retry", "slow_window", "fault_injected",
               "failure_detected", "storage_wait", "stop_without_plan", "final_state", "run_finished", "run_failed")
_WORLD_SIZE = {"group_formed": "world_size", "restored": "world_size", "recovered": "world_size",
               "resized": "new_world_size", "resize_completed": "new_world_size"}
# What the controller finds before it settles who is lost (`failure_detected`): all open a failure.
_DETECTIONS = ("user_error", "silence_detected", "hang_detected", "failure_detected")
_IN_PROGRESS = "in progress"


def summarize(events: list[dict], now: float | None = None) -> dict:
    """The run as its log tells it. `now` (wall-clock seconds) only adds how long ago the last event was."""
    if not events:
        raise ValueError("no events: nothing to summarize")
    t0 = events[0]["t"]
    s = {"run": None, "run_dir": None, "status": "running", "controller_state": None, "error": None,
         "num_starts": 0, "step": None, "num_steps": None, "world_size": None, "loss": None, "loss_step": None,
         "checkpoint": None, "num_checkpoints": 0, "num_checkpoint_failures": 0, "num_checkpoints_deferred": 0,
         "replicas_identical": None, "first_event_t": t0, "last_event_t": events[-1]["t"],
         "wall_s": events[-1]["t"] - t0, "last_event_age_s": None if now is None else now - events[-1]["t"],
         "num_events": len(events), "incidents": [], "metrics": None, "metrics_step": None}
    incidents: list[dict] = s["incidents"]
    cur: dict | None = None  # the incident later events belong to
    ckpt_steps: dict[str, int] = {}

    def open_incident(e: dict, kind: str | None) -> dict:
        nonlocal cur
        step = e.get("step") if e.get("step") is not None else s["step"]
        cur = {"n": len(incidents) + 1, "t_s": round(e["t"] - t0, 3), "step": step, "kind": kind, "faults": [],
               "error": None, "lost": [], "decisions": [], "replaced": {}, "resizes": [], "swapped": None, "traded": None,
               "restored_from": None, "restored_step": None, "detect_s": None, "recover_s": None,
               "recover_from": None, "lost_steps": None, "resumed_step": None, "world_size": None,
               "outcome": _IN_PROGRESS}
        incidents.append(cur)
        return cur

    def open_now(kind: str | None = None) -> bool:
        """The current incident is still going and of this kind, or has only faults so far (kind None)."""
        return cur is not None and cur["outcome"] == _IN_PROGRESS and cur["kind"] in (None, kind)

    def last(pred) -> dict | None:
        return next((i for i in reversed(incidents) if pred(i)), None)

    def end_open(outcome: str) -> None:
        for i in incidents:
            if i["outcome"] == _IN_PROGRESS:
                i["outcome"] = outcome

    for e in events:
        k = e.get("kind")
        if k in _STEP_KINDS and e.get("step") is not None:
            s["step"] = max(s["step"] or 0, e["step"])
        if k in _WORLD_SIZE and e.get(_WORLD_SIZE[k]) is not None:
            s["world_size"] = e[_WORLD_SIZE[k]]

        if k == "run_started":  # a resumed run goes on with the same log
            end_open("interrupted: the run was started again")
            cur = None
            s.update(status="running", error=None, run=e.get("run", s["run"]), run_dir=e.get("run_dir", s["run_dir"]),
                     num_steps=e.get("num_steps", s["num_steps"]), world_size=e.get("num_workers", s["world_size"]),
                     num_starts=s["num_starts"] + 1, replicas_identical=None)
        elif k in ("run_finished", "run_failed"):
            s["status"] = "finished" if k == "run_finished" else "failed"
            s["error"] = e.get("error")
            if e.get("loss") is not None:
                s["loss"], s["loss_step"] = e["loss"], e.get("step")
            uri = e.get("checkpoint")
            if uri and (s["checkpoint"] or {}).get("uri") != uri:  # storage said so, even without an event here
                s["checkpoint"] = {"step": ckpt_steps.get(uri, _folder_step(uri)), "uri": uri}
            end_open("run stopped" if k == "run_failed" else "run finished first")
        elif k == "state":
            s["controller_state"] = e.get("new")
        elif k == "restored":
            s["step"] = e.get("step", s["step"])
            if e.get("uri"):
                ckpt_steps[e["uri"]] = e.get("step")
                s["checkpoint"] = {"step": e.get("step"), "uri": e["uri"]}
            if cur is not None and e.get("source") != "init" and (
                    cur["outcome"] == _IN_PROGRESS or (cur["outcome"] in ("swapped", "traded") and not cur["restored_from"])):
                src = e.get("source")
                if src == "storage" and e.get("uri"):
                    src = f"storage ({e['uri'].rstrip('/').rsplit('/', 1)[-1]})"
                cur["restored_from"], cur["restored_step"] = src, e.get("step")
        elif k == "checkpoint_committed":
            s["num_checkpoints"] += 1
            if e.get("uri"):
                ckpt_steps[e["uri"]] = e.get("step")
                s["checkpoint"] = {"step": e.get("step"), "uri": e["uri"]}
            if e.get("loss") is not None:
                s["loss"], s["loss_step"] = e["loss"], e.get("step")
            if e.get("metrics"):
                s["metrics"], s["metrics_step"] = e["metrics"], e.get("step")
        elif k == "checkpoint_failed":
            s["num_checkpoint_failures"] += 1
        elif k == "evaluated":  # train.eval_dataset: the newest evaluation
            s["evaluation"] = {"step": e.get("step"), "metrics": e.get("metrics") or {}}
        elif k == "checkpoint_deferred":
            s["num_checkpoints_deferred"] += 1
        elif k == "final_state":
            s["replicas_identical"] = e.get("replicas_identical")

        # Incidents: a fault opens one, unless it joins one that has not decided yet or is still
        # recovering (the controller measures a failure during a recovery from the first fault).
        elif k == "fault_injected":
            i = cur if open_now("failure") else open_incident(e, None)
            i["faults"].append({"action": e.get("action"), "rank": e.get("rank"), "step": e.get("step")})
        elif k in _DETECTIONS:
            i = cur if open_now("failure") else open_incident(e, "failure")
            i["kind"] = "failure"
            if k == "user_error":
                i["error"] = f"rank {e.get('rank')} at step {e.get('step')}: {e.get('error')}"
            elif k == "failure_detected":
                i["lost"] += [{"rank": x.get("rank"), "cause": x.get("cause")} for x in e.get("lost", [])]
                if i["detect_s"] is None:
                    i["detect_s"] = e.get("detect_s")
                if i["step"] is None:
                    i["step"] = e.get("step")
        elif k == "decision":
            name = e.get("decision")
            kind = ("growth" if name == "Grow" else "placement" if name in ("Regroup", "Trade")
                    else "straggler" if name in ("Swap", "Drop", "Report") else "failure")
            if kind == "failure":
                i = cur if open_now("failure") else open_incident(e, "failure")
            else:
                i = cur if open_now() else open_incident(e, kind)
            i["kind"] = kind
            i["decisions"].append({"decision": name, "ranks": e.get("ranks", []), "reason": e.get("reason")})
            if name == "Raise":
                i["outcome"] = "run stopped"
            elif name == "Report":
                i["outcome"] = "reported"
        elif k == "workers_replaced":
            i = last(lambda x: x["outcome"] == _IN_PROGRESS)
            if i is not None:
                i["replaced"].update({str(r): h for r, h in (e.get("how") or {}).items()})
        elif k == "resized":
            i = cur if cur is not None and cur["outcome"] == _IN_PROGRESS else open_incident(e, "resize")
            i["resizes"].append({"old_world_size": e.get("old_world_size"), "new_world_size": e.get("new_world_size"),
                                 "path": e.get("path"), "resize_s": None, "source": None})
        elif k == "resize_completed":
            i = last(lambda x: any(r["resize_s"] is None for r in x["resizes"]))
            if i is not None:
                rz = next(r for r in i["resizes"] if r["resize_s"] is None)
                rz.update(resize_s=e.get("resize_s"), source=e.get("source"))
                if i["kind"] != "failure" and i["outcome"] == _IN_PROGRESS:
                    i["outcome"] = "resized"
        elif k == "swapped":
            i = last(lambda x: x["swapped"] is None
                     and any(d["decision"] in ("Swap", "Regroup") for d in x["decisions"]))
            if i is not None:
                i["swapped"] = {"rank": e.get("rank"), "how": e.get("how"), "swap_s": e.get("swap_s"),
                                "old_node": e.get("old_node"), "new_node": e.get("new_node")}
                if i["outcome"] == _IN_PROGRESS:
                    i["outcome"] = "swapped"
        elif k == "traded":
            i = last(lambda x: x["traded"] is None and any(d["decision"] == "Trade" for d in x["decisions"]))
            if i is not None:
                i["traded"] = {"ranks": e.get("ranks"), "trade_s": e.get("trade_s")}
                if i["outcome"] == _IN_PROGRESS:
                    i["outcome"] = "traded"
        elif k == "recovered":
            i = last(lambda x: x["kind"] == "failure" and x["outcome"] == _IN_PROGRESS)
            if i is not None:
                # Without an injected fault the controller knows no fault time: it measures from detection.
                from_fault = bool(i["faults"])
                if i["detect_s"] is None and from_fault:
                    i["detect_s"] = e.get("detect_s")
                i.update(recover_s=e.get("recover_s"), recover_from="fault" if from_fault else "detection",
                         lost_steps=e.get("lost_steps"), resumed_step=e.get("resumed_step"),
                         world_size=e.get("world_size"), outcome="recovered")
    return s


def format_status(s: dict) -> str:
    head = f"run {s['run'] or '?'}: {s['status']}"
    if s["controller_state"]:
        head += f" (controller {s['controller_state']})"
    if s["num_starts"] > 1:
        head += f", started {s['num_starts']} times (resumed)"
    lines = [head]
    if s["run_dir"]:
        lines.append(f"  run folder: {s['run_dir']}")
    if s["error"]:
        lines.append(f"  error: {s['error']}")
    step = f"step {_v(s['step'])} of {_v(s['num_steps'])}"
    if s["status"] == "running":
        step += " (the last the log shows)"
    loss = f"{_loss(s['loss'])} (step {s['loss_step']})" if s["loss"] is not None else "-"
    lines.append(f"  {step}   world size {_v(s['world_size'])}   loss {loss}")
    if s.get("metrics"):
        shown = ", ".join(f"{k} {_loss(v)}" for k, v in sorted(s["metrics"].items()))
        lines.append(f"  metrics (step {s['metrics_step']}): {shown}")
    if s.get("evaluation"):
        ev = s["evaluation"]
        shown = ", ".join(f"{k} {_loss(v)}" for k, v in sorted(ev["metrics"].items()))
        lines.append(f"  evaluation (step {ev['step']}): {shown or '-'}")
    c = s["checkpoint"]
    lines.append("  last committed checkpoint: "
                 + (f"step {_v(c['step'])}, {c['uri']}" if c else "none"))
    lines.append(f"  checkpoints: {s['num_checkpoints']} committed, {s['num_checkpoint_failures']} failed, "
                 f"{s['num_checkpoints_deferred']} deferred")
    when = f"  time: {s['wall_s']:.1f}s from the first event to the last"
    if s["last_event_age_s"] is not None:
        when += f"; last event {_ago(max(0.0, s['last_event_age_s']))} ago"  # clocks of two machines may disagree
    lines.append(when)
    lines.append(f"  incidents: {len(s['incidents']) or 'none'}")
    lines += ["    " + incident_line(i) for i in s["incidents"]]
    if s["replicas_identical"] is not None:
        lines.append(f"  all ranks hold identical final state: {s['replicas_identical']}")
    return "\n".join(lines)


def incident_line(i: dict) -> str:
    parts = []
    if i["faults"]:
        parts.append(", ".join(f"{f['action']} on rank {f['rank']}" for f in i["faults"]) + " (injected)")
    if i["error"]:
        parts.append(f"training code raised on {i['error']}")
    if i["lost"]:
        parts.append("lost " + ", ".join(f"rank {x['rank']} {x['cause']}" for x in i["lost"]))
    for d in i["decisions"]:
        text = d["decision"] + (f" {d['ranks']}" if d["ranks"] else "")
        if d["decision"] in ("Raise", "Report", "Drop"):  # the reason is the story: why it stopped or did not act
            text += f" ({d['reason']})"
        parts.append(text)
    if i["replaced"]:
        parts.append("replaced " + ", ".join(f"rank {r} ({h})" for r, h in i["replaced"].items()))
    if i["swapped"]:
        sw = i["swapped"]
        parts.append(f"rank {sw['rank']} moved to a {sw['how']} in {_v(sw['swap_s'])}s")
    if i["traded"]:
        a, b = i["traded"]["ranks"]
        parts.append(f"ranks {a} and {b} exchanged numbers in {_v(i['traded']['trade_s'])}s")
    for rz in i["resizes"]:
        verb = "shrank" if (rz["new_world_size"] or 0) < (rz["old_world_size"] or 0) else "grew"
        text = f"{verb} {rz['old_world_size']} -> {rz['new_world_size']} ranks via {rz['path']}"
        if rz["resize_s"] is not None:
            text += f", first step {rz['resize_s']:.2f}s after the decision"
        parts.append(text)
    if i["restored_from"]:
        parts.append(f"state from {i['restored_from']} at step {i['restored_step']}")
    if i["outcome"] == "recovered":
        text = "recovered: "
        if i["detect_s"] is not None:
            text += f"detect {i['detect_s']:.2f}s, "
        text += f"recover {_v(i['recover_s'])}s"
        if i["recover_from"] == "detection":
            text += " from detection (no fault time known)"
        parts.append(text + f", {i['lost_steps']} step(s) lost, world size {i['world_size']}")
    elif i["outcome"] not in ("swapped", "traded", "resized", "reported"):
        parts.append(i["outcome"])
    return f"#{i['n']} +{i['t_s']:.1f}s step {_v(i['step'])} {i['kind'] or 'fault'}: " + " -> ".join(parts)


def run_status(run: str, as_json: bool = False, now: float | None = None, storage_options: dict | None = None) -> int:
    """The `elastic status` command: print the summary (or its JSON); 2 when there is no log to read.
    `storage_options`: fsspec options for the run's folder (`--storage-option`)."""
    from elastic.config.secrets import redact
    from elastic.observability.timeline import UnreadableLog, load_log
    try:
        events = load_log(run, storage_options)
    except UnreadableLog as e:
        print(f"elastic: {e}", file=sys.stderr)
        return 2
    # A log written before events were scrubbed (or by another tool) may quote a credential by
    # key or in a URI: the summary shows neither (elastic/config/secrets.py).
    summary = redact(summarize(events, now=time.time() if now is None else now))
    print(json.dumps(summary, indent=2) if as_json else format_status(summary))
    return 0


def _folder_step(uri: str) -> int | None:
    """The step of a checkpoint folder named as elastic.checkpoint.layout.step_dir names it (step_000000020);
    parsed here so that a status needs no torch import."""
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    digits = name.removeprefix("step_")
    return int(digits) if name.startswith("step_") and digits.isdigit() else None


def _v(x) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def _loss(x: float) -> str:
    return f"{x:.4f}" if x == 0 or abs(x) >= 1e-3 else f"{x:.3e}"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
