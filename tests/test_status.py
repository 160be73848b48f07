"""`elastic status`: where a run stands, from its event log alone, for a finished, a running, a
failed and a resumed run, read from a local run folder and from an object store's segments.

The logs are built here the way the controller writes them (docs/events.md, the fields of every
`self.events.emit(` in elastic/controller/controller.py), on a fake clock."""
import json
import uuid

import pytest

from elastic.cli import main
from elastic.observability.status import format_status, summarize
from elastic.storage import Storage, join
from elastic.observability.events import EVENTS_FILE, SEGMENTS_DIR

T0 = 1_800_000_000.0


class Log:
    """An event log on a fake clock: `log(kind, at_s, **fields)`, `at_s` in seconds since T0."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.events: list[dict] = []

    def __call__(self, kind: str, at_s: float, **fields) -> None:
        assert not self.events or T0 + at_s >= self.events[-1]["t"], "events are logged in time order"
        self.events.append({"t": T0 + at_s, "kind": kind, **fields})

    def state(self, at_s: float, old: str, new: str) -> None:
        self("state", at_s, old=old, new=new)

    def ckpt(self, uri_step: int) -> str:
        return f"{self.run_dir}/checkpoints/step_{uri_step:09d}"

    def commit(self, at_s: float, step: int, loss: float) -> None:
        self("checkpoint_committed", at_s, step=step, uri=self.ckpt(step), persist_s=0.15, attempts=1, loss=loss)

    def start(self, at_s: float, num_workers: int = 3, num_steps: int = 300, restored_step: int = 0) -> None:
        self("run_started", at_s, run="charlm", num_workers=num_workers, num_steps=num_steps, run_dir=self.run_dir)
        self("workers_started", at_s + 5.0, ranks=list(range(num_workers)),
             nodes={str(r): f"node{r:08d}" for r in range(num_workers)})
        self.state(at_s + 5.0, "Starting", "Forming")
        self("group_formed", at_s + 5.4, world_size=num_workers, form_s=0.4, generation=1)
        self.state(at_s + 5.4, "Forming", "Restoring")
        uri = self.ckpt(restored_step) if restored_step else None
        self("restored", at_s + 6.2, step=restored_step, source="storage" if uri else "init", uri=uri,
             restore_s=0.8, world_size=num_workers)
        self.state(at_s + 6.2, "Restoring", "Running")

    def reform(self, at_s: float, world_size: int, generation: int, step: int, old: str = "Recovering") -> None:
        self.state(at_s, old, "Forming")
        self("group_formed", at_s + 0.03, world_size=world_size, form_s=0.03, generation=generation)
        self.state(at_s + 0.03, "Forming", "Restoring")
        self("restored", at_s + 0.08, step=step, source="peer rank 0", uri=None, restore_s=0.05,
             world_size=world_size)
        self.state(at_s + 0.08, "Restoring", "Running")


def a_run(run_dir: str = "file:///data/runs/charlm", upto_s: float | None = None) -> list[dict]:
    """A 3-rank run of 300 steps: a node kill (replaced by a warm spare, state from a peer), a
    straggler swapped for a spare, a node kill with no replacement (shrink to 2), a growth back
    to 3, and a clean finish. `upto_s`: the log as it stood that many seconds in (a running run)."""
    log = Log(run_dir)
    log.start(0.0)
    for i, step in enumerate(range(20, 120, 20)):
        log.commit(7.2 + i, step, 3.0 - step / 100)
    # 1. a node killed: found silent, replaced by a warm spare, state from a survivor's memory
    log("fault_injected", 12.0, action="kill_node", rank=1, step=110, fault_t=T0 + 12.0, pid=4242, generation=1,
        thaw_after_s=None)
    log.state(13.2, "Running", "Recovering")
    log("failure_detected", 13.2, lost=[{"rank": 1, "cause": "unresponsive", "detail": "unresponsive"}], step=110,
        detect_s=1.2)
    log("decision", 13.2, decision="Restart", ranks=[1], reason="rank 1 unresponsive; recovery 1/3: replace [1]")
    log("collectives_aborted", 13.21, generation=1, ranks=[0, 2], unanswered={}, suspect_nodes=["node00000001"])
    log("restore_plan", 13.21, source="FromPeer", reason="state from the memory of rank 0 (step 110), no storage read")
    log("workers_replaced", 13.22, ranks=[1], start_s=0.01, how={"1": "warm spare"}, nodes={"1": "node00000003"})
    log.reform(13.22, 3, 2, 110)
    log("recovered", 13.6, recover_s=1.6, detect_s=1.2, resumed_step=110, fault_step=110, lost_steps=0, world_size=3)
    for i, step in enumerate((120, 140, 160)):
        log.commit(14.0 + i, step, 2.0 - step / 1000)
    # 2. a straggler: two slow windows, swapped for a warm spare at a step boundary
    log("fault_injected", 17.0, action="slow", rank=2, step=160, fault_t=T0 + 17.0, pid=4343, generation=2,
        thaw_after_s=None)
    for at_s, step, n in ((18.0, 170, 1), (18.5, 175, 2)):
        log("slow_window", at_s, step=step, ratios={"0": 1.0, "1": 0.98, "2": 3.1}, consecutive={"2": n})
    log("decision", 18.5, decision="Swap", ranks=[2], healthy_compute_s=0.012,
        reason="rank 2 compute time above 1.5x the others' median for 2 consecutive windows of 5 steps; swap it "
               "for a spare (calibrated 0.007s vs healthy median 0.012s)")
    log.state(18.6, "Running", "Swapping")
    log("swapped", 18.62, rank=2, how="warm spare", old_node="node00000002", new_node="node00000004", swap_s=0.02,
        spare_calib_s=0.007)
    log.reform(18.62, 3, 3, 178, old="Swapping")
    log.commit(19.5, 180, 1.82)
    log.commit(20.5, 200, 1.80)
    # 3. another node killed, no worker can be started in time: the world shrinks to 2
    log("fault_injected", 21.0, action="kill_node", rank=2, step=205, fault_t=T0 + 21.0, pid=4444, generation=3,
        thaw_after_s=None)
    silent = "answered no poll for 1s (failure.ping_timeout_s) while the group made no progress for 1.0s"
    log("silence_detected", 22.3, ranks=[2], reason=silent)
    log.state(22.3, "Running", "Recovering")
    log("failure_detected", 22.3, lost=[{"rank": 2, "cause": "unresponsive", "detail": silent}], step=205,
        detect_s=1.3)
    log("decision", 22.3, decision="Restart", ranks=[2], reason=f"rank 2 unresponsive ({silent}); recovery 2/3: "
                                                                f"replace [2]")
    log("restore_plan", 22.31, source="FromPeer", reason="state from the memory of rank 0 (step 205), no storage read")
    shrink = ("no replacement within scaling.shrink_after_s=2.0s (no worker could be started for ranks [2] within "
              "2s; is there a free slot (1.0 CPU) per worker?); scaling.min_workers=2")
    log("resized", 24.32, old_world_size=3, new_world_size=2, path="memory", reason=shrink, decide_s=2.01)
    log.reform(24.32, 2, 4, 205)
    log("recovered", 24.8, recover_s=3.8, detect_s=1.3, resumed_step=205, fault_step=205, lost_steps=0, world_size=2)
    log("resize_completed", 24.8, old_world_size=3, new_world_size=2, path="memory", source="peer rank 0",
        resize_s=0.45, restore_s=0.05, first_step_t=T0 + 24.77, reason=shrink)
    log.commit(26.0, 220, 1.75)
    log.commit(28.0, 240, 1.71)
    # 4. capacity came back: grow to 3 at a step boundary
    grow = "1 warm worker(s) available and world size 2 < scaling.max_workers=3: grow at the next step boundary"
    log("decision", 30.0, decision="Grow", ranks=[2], reason=grow)
    log.state(30.1, "Running", "Growing")
    log("resized", 30.1, old_world_size=2, new_world_size=3, path="memory", reason="capacity appeared",
        decide_s=0.004)
    log.reform(30.1, 3, 5, 250, old="Growing")
    log("resize_completed", 30.6, old_world_size=2, new_world_size=3, path="memory", source="peer rank 0",
        resize_s=0.5, restore_s=0.05, first_step_t=T0 + 30.5, reason=grow)
    for i, step in enumerate((260, 280, 300)):
        log.commit(31.0 + i, step, 1.7 - step / 10000)
    log("final_state", 35.0, step=300, digests={str(r): "ab" * 32 for r in range(3)}, replicas_identical=True)
    log.state(35.0, "Running", "Finished")
    log("run_finished", 35.1, step=300, loss=1.67, error=None, checkpoint=log.ckpt(300))
    return [e for e in log.events if upto_s is None or e["t"] <= T0 + upto_s]


def a_failed_run(run_dir: str = "file:///data/runs/charlm") -> list[dict]:
    """The training code raises on rank 1: the controller stops the run (a retry would fail again)."""
    log = Log(run_dir)
    log.start(0.0, num_steps=40)
    log.commit(7.0, 10, 2.24)
    log("user_error", 8.0, rank=1, step=25, error="TypeError: too many positional arguments",
        traceback="Traceback (most recent call last):\n  ...\nTypeError: too many positional arguments")
    log.state(8.0, "Running", "Recovering")
    log("failure_detected", 8.0, lost=[], step=20, detect_s=None)
    log("decision", 8.0, decision="Raise", ranks=[], reason="user code error: a retry would fail again")
    log.state(8.0, "Recovering", "Errored")
    # The commit of step 20 landed before the failure but was never reported: storage says so.
    log("run_failed", 8.1, step=20, loss=1.94, checkpoint=log.ckpt(20),
        error=f"training code raised: rank 1 at step 25: TypeError: too many positional arguments; last committed "
              f"checkpoint: {log.ckpt(20)}")
    return log.events


# ------------------------------------------------------------------ summarize / format_status


def test_a_finished_run_with_every_kind_of_incident():
    events = a_run()
    s = summarize(events, now=events[-1]["t"] + 30)
    assert (s["status"], s["controller_state"], s["run"], s["num_starts"]) == ("finished", "Finished", "charlm", 1)
    assert (s["step"], s["num_steps"], s["world_size"], s["loss"], s["loss_step"]) == (300, 300, 3, 1.67, 300)
    assert s["checkpoint"] == {"step": 300, "uri": "file:///data/runs/charlm/checkpoints/step_000000300"}
    assert (s["num_checkpoints"], s["num_checkpoint_failures"], s["num_checkpoints_deferred"]) == (15, 0, 0)
    assert s["replicas_identical"] is True and s["error"] is None
    assert s["wall_s"] == pytest.approx(35.1) and s["last_event_age_s"] == pytest.approx(30)
    kill, swap, shrink, grow = s["incidents"]
    assert [i["kind"] for i in s["incidents"]] == ["failure", "straggler", "failure", "growth"]
    assert [i["outcome"] for i in s["incidents"]] == ["recovered", "swapped", "recovered", "resized"]
    assert [i["step"] for i in s["incidents"]] == [110, 160, 205, 240]

    assert kill["faults"] == [{"action": "kill_node", "rank": 1, "step": 110}]
    assert kill["lost"] == [{"rank": 1, "cause": "unresponsive"}]
    assert [d["decision"] for d in kill["decisions"]] == ["Restart"] and kill["decisions"][0]["ranks"] == [1]
    assert kill["replaced"] == {"1": "warm spare"} and kill["resizes"] == [] and kill["swapped"] is None
    assert (kill["restored_from"], kill["restored_step"]) == ("peer rank 0", 110)
    assert (kill["detect_s"], kill["recover_s"], kill["recover_from"]) == (1.2, 1.6, "fault")
    assert (kill["lost_steps"], kill["resumed_step"], kill["world_size"]) == (0, 110, 3)

    assert swap["faults"] == [{"action": "slow", "rank": 2, "step": 160}]
    assert [d["decision"] for d in swap["decisions"]] == ["Swap"] and swap["lost"] == []
    assert swap["swapped"] == {"rank": 2, "how": "warm spare", "swap_s": 0.02, "old_node": "node00000002",
                               "new_node": "node00000004"}
    assert (swap["restored_from"], swap["restored_step"]) == ("peer rank 0", 178)

    assert shrink["lost"] == [{"rank": 2, "cause": "unresponsive"}] and shrink["replaced"] == {}
    assert shrink["resizes"] == [{"old_world_size": 3, "new_world_size": 2, "path": "memory", "resize_s": 0.45,
                                  "source": "peer rank 0"}]
    assert (shrink["detect_s"], shrink["recover_s"], shrink["lost_steps"], shrink["world_size"]) == (1.3, 3.8, 0, 2)

    assert [d["decision"] for d in grow["decisions"]] == ["Grow"] and grow["faults"] == []
    assert grow["resizes"] == [{"old_world_size": 2, "new_world_size": 3, "path": "memory", "resize_s": 0.5,
                                "source": "peer rank 0"}]
    assert (grow["restored_from"], grow["restored_step"]) == ("peer rank 0", 250)
    json.dumps(s)  # --json prints it as it is


def test_format_status_prints_one_line_per_incident():
    events = a_run()
    text = format_status(summarize(events, now=events[-1]["t"] + 30))
    lines = text.splitlines()
    assert lines[0] == "run charlm: finished (controller Finished)"
    assert "  step 300 of 300   world size 3   loss 1.6700 (step 300)" in lines
    assert "  last committed checkpoint: step 300, file:///data/runs/charlm/checkpoints/step_000000300" in lines
    assert "  time: 35.1s from the first event to the last; last event 30s ago" in lines
    assert "  incidents: 4" in lines
    incidents = [x.strip() for x in lines if x.startswith("    #")]
    assert incidents == [
        "#1 +12.0s step 110 failure: kill_node on rank 1 (injected) -> lost rank 1 unresponsive -> Restart [1] -> "
        "replaced rank 1 (warm spare) -> state from peer rank 0 at step 110 -> recovered: detect 1.20s, recover "
        "1.60s, 0 step(s) lost, world size 3",
        "#2 +17.0s step 160 straggler: slow on rank 2 (injected) -> Swap [2] -> rank 2 moved to a warm spare in "
        "0.02s -> state from peer rank 0 at step 178",
        "#3 +21.0s step 205 failure: kill_node on rank 2 (injected) -> lost rank 2 unresponsive -> Restart [2] -> "
        "shrank 3 -> 2 ranks via memory, first step 0.45s after the decision -> state from peer rank 0 at step 205 "
        "-> recovered: detect 1.30s, recover 3.80s, 0 step(s) lost, world size 2",
        "#4 +30.0s step 240 growth: Grow [2] -> grew 2 -> 3 ranks via memory, first step 0.50s after the decision "
        "-> state from peer rank 0 at step 250",
    ]
    assert lines[-1] == "  all ranks hold identical final state: True"


def test_a_regroup_is_its_own_incident_after_the_swap_that_split_the_tp_group():
    log = Log("file:///data/runs/tp")
    log.start(0.0, num_workers=4, num_steps=60)
    log("decision", 15.0, decision="Swap", ranks=[1], healthy_compute_s=0.05, step=8,
        reason="rank 1 compute time above 1.5x the others' median")
    log.state(15.1, "Running", "Swapping")
    log("swapped", 15.12, rank=1, how="warm spare", old_node="nodeA", new_node="nodeC", swap_s=0.02,
        spare_calib_s=0.04, tp_split_groups=[0], regroup=False)
    log.reform(15.12, 4, 2, 10, old="Swapping")
    log("decision", 19.0, decision="Regroup", ranks=[1], step=30,
        reason="tp group 0 spans nodes; a warm spare on node nodeA holds the rest of it: rank 1 moves there")
    log.state(19.1, "Running", "Swapping")
    log("swapped", 19.11, rank=1, how="warm spare", old_node="nodeC", new_node="nodeA", swap_s=0.01,
        spare_calib_s=0.04, tp_split_groups=[], regroup=True)
    log.reform(19.11, 4, 3, 33, old="Swapping")
    swap, regroup = summarize(log.events, now=log.events[-1]["t"])["incidents"]
    assert (swap["kind"], swap["outcome"], swap["swapped"]["new_node"]) == ("straggler", "swapped", "nodeC")
    assert (regroup["kind"], regroup["outcome"]) == ("placement", "swapped"), regroup
    assert [d["decision"] for d in regroup["decisions"]] == ["Regroup"]
    assert (regroup["swapped"]["old_node"], regroup["swapped"]["new_node"]) == ("nodeC", "nodeA")
    assert (regroup["restored_from"], regroup["restored_step"]) == ("peer rank 0", 33)


def test_a_running_run_mid_recovery():
    events = a_run(upto_s=23.0)  # rank 2's node is gone; no replacement yet
    s = summarize(events)
    assert (s["status"], s["controller_state"], s["step"], s["world_size"]) == ("running", "Recovering", 205, 3)
    assert s["checkpoint"]["step"] == 200 and s["loss_step"] == 200 and s["last_event_age_s"] is None
    last = s["incidents"][-1]
    assert (last["outcome"], last["lost"], last["recover_s"]) == ("in progress", [{"rank": 2, "cause": "unresponsive"}],
                                                                   None)
    text = format_status(s)
    assert "step 205 of 300 (the last the log shows)" in text
    assert text.splitlines()[-1].endswith("-> Restart [2] -> in progress")
    assert "last event" not in text


def test_a_failed_run_names_the_error_and_the_checkpoint_storage_reported():
    s = summarize(a_failed_run())
    assert (s["status"], s["controller_state"], s["step"], s["loss"]) == ("failed", "Errored", 20, 1.94)
    assert s["error"].startswith("training code raised: rank 1 at step 25")
    # step 20's commit has no event of its own: the checkpoint comes from run_failed, its step from its folder
    assert s["checkpoint"] == {"step": 20, "uri": "file:///data/runs/charlm/checkpoints/step_000000020"}
    (i,) = s["incidents"]
    assert (i["kind"], i["outcome"], i["lost"]) == ("failure", "run stopped", [])
    assert i["error"] == "rank 1 at step 25: TypeError: too many positional arguments"
    line = format_status(s).splitlines()[-1].strip()
    assert line == ("#1 +8.0s step 25 failure: training code raised on rank 1 at step 25: TypeError: too many "
                    "positional arguments -> Raise (user code error: a retry would fail again) -> run stopped")


def test_a_failure_with_no_injected_fault_is_timed_from_detection():
    log = Log("file:///data/runs/charlm")
    log.start(0.0)
    log.state(20.0, "Running", "Recovering")
    died = "The actor died unexpectedly before finishing this task."
    log("failure_detected", 20.0, step=50, detect_s=None, lost=[{"rank": 0, "cause": "process_died", "detail": died}])
    log("decision", 20.0, decision="Restart", ranks=[0], reason="rank 0 process_died; recovery 1/3: replace [0]")
    log("restore_plan", 20.0, source="FromPeer", reason="state from the memory of rank 1 (step 50), no storage read")
    log("workers_replaced", 24.9, ranks=[0], start_s=4.9, how={"0": "started on demand"}, nodes={"0": "node9"})
    log.reform(24.9, 3, 2, 50)
    # the controller knows no fault time: it measures from detection, and detect_s is 0
    log("recovered", 25.1, recover_s=5.1, detect_s=0.0, resumed_step=50, fault_step=50, lost_steps=0, world_size=3)
    (i,) = summarize(log.events)["incidents"]
    assert (i["detect_s"], i["recover_s"], i["recover_from"]) == (None, 5.1, "detection")
    assert i["replaced"] == {"0": "started on demand"}
    assert format_status(summarize(log.events)).splitlines()[-1].endswith(
        "-> recovered: recover 5.10s from detection (no fault time known), 0 step(s) lost, world size 3")


def test_a_resumed_run_goes_on_in_the_same_log():
    # The first invocation's driver died mid-recovery (no end event); a resubmit resumed from storage.
    first = a_run(upto_s=23.0)
    log = Log("file:///data/runs/charlm")
    log.start(100.0, restored_step=200)
    log.commit(110.0, 220, 1.75)
    s = summarize(first + log.events)
    assert (s["status"], s["num_starts"], s["step"], s["controller_state"]) == ("running", 2, 220, "Running")
    assert s["checkpoint"] == {"step": 220, "uri": "file:///data/runs/charlm/checkpoints/step_000000220"}
    assert s["incidents"][-1]["outcome"] == "interrupted: the run was started again"
    assert s["incidents"][-1]["restored_from"] is None  # the new invocation's restore is not the incident's
    assert "started 2 times (resumed)" in format_status(s).splitlines()[0]


def test_straggler_reported_and_dropped():
    log = Log("file:///data/runs/charlm")
    log.start(0.0)
    log("decision", 10.0, decision="Report", ranks=[1],
        reason="rank 1 slow for 2 consecutive windows; no spare, and the world may not shrink "
               "(scaling.min_workers): report only")
    drop = ("rank 2 slow for 2 consecutive windows; no spare: drop it and go on with one rank fewer (above "
            "scaling.min_workers)")
    log("decision", 12.0, decision="Drop", ranks=[2], reason=drop, healthy_compute_s=0.01)
    log.state(12.1, "Running", "Dropping")
    log("resized", 12.2, old_world_size=3, new_world_size=2, path="memory", decide_s=0.1,
        reason=f"rank 2 dropped (node node00000002): {drop}")
    log.reform(12.2, 2, 2, 60, old="Dropping")
    log("resize_completed", 12.6, old_world_size=3, new_world_size=2, path="memory", source="peer rank 0",
        resize_s=0.6, restore_s=0.05, first_step_t=T0 + 12.5, reason=drop)
    report, dropped = summarize(log.events)["incidents"]
    assert (report["kind"], report["outcome"], dropped["kind"], dropped["outcome"]) == (
        "straggler", "reported", "straggler", "resized")
    assert dropped["resizes"][0]["new_world_size"] == 2 and summarize(log.events)["world_size"] == 2
    assert "Report [1] (rank 1 slow for 2 consecutive windows; no spare" in format_status(summarize(log.events))


def test_summarize_needs_events():
    with pytest.raises(ValueError, match="no events"):
        summarize([])


# ------------------------------------------------------------------ the command


def write_run(where: str, tmp_path, events: list[dict]) -> str:
    """The run folder as the event log leaves it: one appended file on local disk, numbered
    segments on an object store."""
    if where == "file":
        run = tmp_path / "charlm"
        run.mkdir()
        (run / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
        return str(run)
    storage = Storage(f"memory://status-{uuid.uuid4().hex}")
    run = join(storage.uri, "charlm")
    cut = [0, 7, 30, len(events)]  # three segments, read back in numeric order
    for n, (a, b) in enumerate(zip(cut, cut[1:]), 1):
        body = "".join(json.dumps(e) + "\n" for e in events[a:b]).encode()
        storage.write_bytes(join(run, SEGMENTS_DIR, f"{n:06d}.jsonl"), body)
    return run


@pytest.mark.parametrize("where", ["file", "memory"])
def test_cli_status_reads_the_run_folder(where, tmp_path, capsys, monkeypatch):
    events = a_run()
    run = write_run(where, tmp_path, events)
    monkeypatch.setattr("elastic.observability.status.time.time", lambda: events[-1]["t"] + 30)
    assert main(["status", run]) == 0
    assert capsys.readouterr().out == format_status(summarize(events, now=events[-1]["t"] + 30)) + "\n"
    assert main(["status", run, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == summarize(events, now=events[-1]["t"] + 30)


def test_cli_status_takes_an_events_file_too(tmp_path, capsys):
    run = write_run("file", tmp_path, a_failed_run())
    assert main(["status", f"{run}/{EVENTS_FILE}"]) == 0
    assert capsys.readouterr().out.startswith("run charlm: failed (controller Errored)\n")


@pytest.mark.parametrize("where", ["file", "memory"])
def test_cli_status_of_a_folder_with_no_events_names_it(where, tmp_path, capsys):
    run = str(tmp_path / "empty") if where == "file" else f"memory://status-{uuid.uuid4().hex}/nothing"
    assert main(["status", run]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"elastic: no events in {run}:") and "events.jsonl" in err
