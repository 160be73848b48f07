"""Recovering: settle who is lost, ask the failure policy, keep the survivors' state, replace.

A survivor blocked in a collective on a silent peer is aborted (it keeps its state), one that
does not come back is replaced; the restore plan follows from the survivors' steps; missing
ranks are taken by spares or new workers, or the world shrinks (resize.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.checkpoint.layout import latest_committed, step_of_uri
from elastic.controller import regroup, reports
from elastic.controller.records import RecoveryRecord
from elastic.controller.states import Errored, Forming, Recovering, State
from elastic.controller.watch import group_watch
from elastic.group.member import SurvivorsLost
from elastic.group.worker_group import GroupError, cause_of
from elastic.policies.failure import (FORMATION_SILENCE, FailureObservation, LostRank, Raise, decide_failure,
                                     formation_silent, node_says_running)
from elastic.policies.buddies import choose_copies, has_copies
from elastic.policies.placement import split_groups
from elastic.policies.restore import FromShards, FromStorage, choose_restore
from elastic.protocol import LostCause
from elastic.storage import call_within

if TYPE_CHECKING:
    from elastic.controller.controller import Controller


def on_recovering(ctl: Controller, st: Recovering) -> State:
    from elastic.controller.resize import shrink  # resize.py returns to this state: imported late

    cfg = ctl.job.failure
    ctl.resize = None  # a planned resize cut short by a failure: the recovery decides the size
    fault = ctl.last_fault
    # Storage, not what polls happened to report before the fault, says what is committed,
    # when it answers: an outage at the same time must not hold up a recovery that may not
    # need storage at all (from the survivors' memory). Else the last commit reported stands.
    answered, latest, error = call_within(lambda: latest_committed(ctl.storage, ctl.root), ctl.grace_s)
    if answered and error is None:
        ctl.checkpoints.last_committed = latest.uri if latest else None
    else:
        ctl.events.emit("storage_unanswered", op="list committed checkpoints", waited_s=ctl.grace_s,
                        error=str(error)[:300] if error else None,
                        using=f"the last commit reported: {ctl.last_committed or 'none'}")
    obs = FailureObservation(st.lost, len(ctl.group.members), ctl.failures, st.user_error, ctl.last_committed)
    decision, reason = decide_failure(obs, cfg, ctl.wall())
    ctl.events.emit("failure_detected", lost=[x.__dict__ for x in st.lost], step=ctl.step,
                    detect_s=(st.detected_at - fault["t"]) if fault else None)
    ctl.events.emit("decision", decision=type(decision).__name__, ranks=list(getattr(decision, "ranks", ())),
                    reason=reason)
    if isinstance(decision, Raise):
        return Errored(decision.error)
    ctl.failures += 1
    if ctl.recovery is None:  # a failure during a recovery keeps the original fault
        fault_step = fault["step"] if fault else ctl.training.max_step_seen
        ctl.recovery = RecoveryRecord(fault_t=fault["t"] if fault else None, detected_t=st.detected_at,
                                      fault_step=fault_step)
    ctl.last_fault = None
    t0 = ctl.now()
    group = ctl.group
    causes = {x.rank: x.cause for x in st.lost}
    for x in decision.ranks:
        m = group.members.get(x)
        if m is not None and causes.get(x) != LostCause.PROCESS_DIED:
            # Its machine may be stopped or cut off while Ray still lists it as alive: place
            # nothing new there until it answers again.
            group.suspect(m.node_id)
        group.kill(x)
    # A survivor blocked in a collective on a silent peer never sees an error of its own: abort
    # its collectives (a stale abort is ignored), so run() returns with the state of its last
    # completed step. One that still does not return cannot safely join a new group: replace it.
    grace_s = ctl.grace_s
    unanswered = group.abort_all(ctl.generation, grace_s)
    # Which of the two a survivor missed goes into the event: they fail for different reasons.
    late, where = slow_returns(ctl, group.wait_runs(ctl.run_refs, grace_s), unanswered, grace_s)
    stuck = {r: (why, f"its run() did not return after the abort within {2 * grace_s:g} s (in {where[r]})"
                      if where.get(r) else f"its run() did not return after the abort within {grace_s:g} s")
             for r, why in late.items()}
    for r, why in group.leave_all(grace_s).items():
        stuck.setdefault(r, (why, f"it did not leave its group within {grace_s:g} s"))
    ctl.run_refs = {}
    if group.suspect_nodes or unanswered:
        ctl.events.emit("collectives_aborted", generation=ctl.generation,
                        ranks=sorted(r for r in group.members if r not in unanswered),
                        unanswered=unanswered, suspect_nodes=sorted(n[:12] for n in group.suspect_nodes))
    for rank, (why, what) in stuck.items():
        ctl.events.emit("worker_replaced", rank=rank, reason=f"{what}: {why}")
        if cause_of(why) != LostCause.PROCESS_DIED and rank in group.members:
            group.suspect(group.members[rank].node_id)
        group.kill(rank)
    answers, silent = reports.collect(ctl, cfg.ping_timeout_s, progress=False)
    answers, silent, waited = poll_busy_again(ctl, answers, silent)
    beats = group.beats() if silent and cfg.heartbeat else {}
    for rank, why in silent.items():
        ctl.events.emit("worker_replaced", rank=rank, reason=f"it answered no poll within {waited:g} s during the "
                        f"recovery (its node's heartbeat: {beat_said(beats.get(rank))}): {why}")
        group.kill(rank)
    # Only a member that holds state is a source: a replacement that never restored (its group
    # failed to form) reports step 0, and taking it would start the run over.
    ctl.survivor_steps = {r: a.step for r, a in answers.items() if a.holds_state}
    ctl.restore_plan, why = choose_restore(ctl.survivor_steps, cfg, ctl.shape.sharded, ctl.layout,
                                             ctl.shape.private)
    lay = ctl.layout
    if (isinstance(ctl.restore_plan, FromStorage) and cfg.peer_restore
            and has_copies(ctl.job.checkpoint.memory_every_steps, ctl.shape.sharded, lay.pp, lay.dp, lay.tp,
                           lay.shards)):
        ctl.restore_plan, why = from_copies(ctl, answers, why)
    ctl.events.emit("restore_plan", source=type(ctl.restore_plan).__name__, reason=why)
    sc = ctl.job.scaling
    missing = [r for r in range(ctl.world_size) if r not in group.members]
    may_shrink = sc.min_size <= len(group.members) < ctl.world_size
    try:
        how = group.promote(missing, sc.shrink_after_s if may_shrink else cfg.replacement_timeout_s,
                            cfg.ping_timeout_s, watch=group_watch(ctl, "promote"))
    except SurvivorsLost as e:  # a second fault while the replacements started: take it in now
        ctl.events.emit("faults_merged", lost=sorted(e.ranks), reason="lost while the replacements started: "
                        "replaced in this recovery, before the group forms",
                        causes={r: str(w)[:200] for r, w in sorted(e.ranks.items())})
        return Recovering(tuple(LostRank(r, cause_of(w), w) for r, w in e.ranks.items()), ctl.wall())
    except GroupError as e:
        if len(group.members) < sc.min_size:
            return Errored(f"{e}; scaling.min_workers={sc.min_size}; "
                           f"last committed checkpoint: {ctl.last_committed or 'none'}")
        return shrink(ctl, str(e), t0)
    tp = ctl.job.train.tp.size
    split = split_groups({r: m.node_id for r, m in group.members.items()}, tp) if tp > 1 else []
    ctl.events.emit("workers_replaced", ranks=missing, start_s=ctl.now() - t0, how=how,
                    nodes={r: group.members[r].node_id[:12] for r in missing},
                    pids={r: group.members[r].pid for r in missing},
                    **({"tp_split_groups": split} if tp > 1 else {}))
    regroup.name_splits(ctl, missing)  # a split is a last resort: each one named, with why
    return merge_overlapping(ctl)


def poll_busy_again(ctl: Controller, answers: dict, silent: dict[int, str]
                    ) -> tuple[dict, dict[int, str], float]:
    """Survivors that answered no poll within ping_timeout_s while their node's heartbeat says
    their process runs (a loaded machine, a survivor still tearing its group down) are polled
    again, up to FORMATION_SILENCE x ping_timeout_s in all, before they are replaced: replacing a
    healthy survivor costs a worker start, and below min_workers the shrink its state allowed.
    One whose node is silent too, refuses the pings or says it is stopped is not waited for.
    Returns the answers with the late ones, those still silent, and how long the polls waited."""
    cfg = ctl.job.failure
    waited, late = cfg.ping_timeout_s, []
    while cfg.heartbeat and silent and waited < FORMATION_SILENCE * cfg.ping_timeout_s:
        beats = ctl.group.beats(fresh_within_s=cfg.ping_timeout_s)  # not as of before the polls
        busy = [r for r, why in silent.items() if cause_of(why) == LostCause.UNRESPONSIVE and r in beats
                and not beats[r].refused and node_says_running(beats[r], cfg.ping_timeout_s)]
        if not busy:
            break
        more, again = reports.collect(ctl, cfg.ping_timeout_s, progress=False)
        waited += cfg.ping_timeout_s
        late += [r for r in silent if r in more]
        answers = {**answers, **more}
        silent = {**{r: why for r, why in silent.items() if r not in more}, **again}
    if late:
        ctl.events.emit("slow_poll", ranks=sorted(late), waited_s=waited, replaced=sorted(silent))
    return answers, silent, waited


def beat_said(beat) -> str:
    """What a rank's node's heartbeat (`Beat`, None without one) says of it, for an event."""
    if beat is None:
        return "none"
    return f"age {beat.age_s:.2f} s, state {beat.state}" + (", refused" if beat.refused else "")


def slow_returns(ctl: Controller, late: dict[int, str], unanswered: dict[int, str], grace_s: float
                 ) -> tuple[dict[int, str], dict[int, str | None]]:
    """Survivors whose run() had not returned `grace_s` after the abort, though they answered it
    (their actor is alive and their collectives are cut): on a loaded machine the teardown and the
    reply can take longer than that, and replacing a healthy survivor costs a worker start. Each
    gets `grace_s` more; where its run() is (innermost frames) goes into the event either way, so
    one that still does not return is replaced with the place it was stuck in. Returns those still
    late, and where the slow ones were."""
    slow = [r for r, why in late.items() if r not in unanswered and cause_of(why) == LostCause.UNRESPONSIVE]
    if not slow:
        return late, {}
    t0 = ctl.now()
    where = ctl.group.where(slow, ctl.job.failure.ping_timeout_s)
    still = ctl.group.wait_runs({r: ctl.run_refs[r] for r in slow}, grace_s)
    ctl.events.emit("slow_return", ranks=slow, returned=[r for r in slow if r not in still],
                    waited_s=grace_s + ctl.now() - t0, where={r: where.get(r) for r in slow})
    return {r: why for r, why in late.items() if r not in slow or r in still}, where


def from_copies(ctl: Controller, answers: dict, storage_why: str):
    """State held once (FSDP's shards, HSDP's at one group, a one-replica pipeline's stages): the newest step every old
    rank's part has an in-memory copy of, in a survivor's memory (its own, or its buddy's copy),
    re-sharded (or re-partitioned, by name) into the new group from there. Storage when no such
    step exists (a rank lost with its buddy), said in the reason and counted."""
    holders = {r: a for r, a in answers.items() if a.holds_state}
    found, why, lost = choose_copies(ctl.world_size, {r: a.memory_steps for r, a in holders.items()},
                               {r: a.copies_held for r, a in holders.items()}, step_of_uri(ctl.last_committed))
    if found is None:
        ctl.copies_fallbacks += lost
        count = f" (fallback {ctl.copies_fallbacks} of the run)" if lost else ""
        return FromStorage(), f"{why}: restore from the latest committed checkpoint{count}"
    step, sources = found
    if ctl.shape.sharded or ctl.shape.shards > 1:  # FSDP's (HSDP's at one group) rows: rank to rank
        ctl.group.keep_copies(sources)
        return FromShards({}, ctl.world_size, step, copies_step=step), why
    # A one-replica pipeline's stages: by name, through the object store (strategy.assemble).
    return FromShards(ctl.group.memory_parts(sources, step), ctl.world_size, step, ctl.layout.pp), why


def merge_overlapping(ctl: Controller) -> State:
    """Faults that overlap: a member lost while the replacements started (a second node lost
    seconds after the first) is taken into this recovery now, not found by a formation that cannot
    complete. Deaths Ray reports count, and so does what the heartbeat says of a member that
    answered no poll, by the formation's own rule (`formation_silent`: its node refuses the
    pings, says its process is stopped, or is silent too): a busy survivor, whose node says it
    runs, is never taken for a lost one."""
    cfg = ctl.job.failure
    t0 = ctl.now()
    answers, silent = reports.collect(ctl, cfg.ping_timeout_s, progress=False)
    # A silent rank answered neither the polls drained nor the fresh one: its wait is at least
    # the collect's. (Its blocking poll is not in `unanswered_s`: judged by a default of
    # ping_timeout_s, a stopped machine never passed `formation_silent` here, and was found by
    # the formation after: churn seed 2, a freeze found 9.3 s after it.)
    polled_s = ctl.now() - t0
    gone = {r: (cause_of(w), w) for r, w in silent.items()
            if cause_of(w) in (LostCause.PROCESS_DIED, LostCause.NODE_DIED, LostCause.UNREACHABLE)}
    quiet = [r for r, w in silent.items() if r not in gone and cause_of(w) == LostCause.UNRESPONSIVE]
    if quiet and cfg.heartbeat:
        # A fresh snapshot: the last one was asked before the collect's polls (seconds on a
        # loaded machine) and shows a node stopped since as alive (churn seed 2: 5.95 s).
        beats, waits = ctl.group.beats(fresh_within_s=cfg.ping_timeout_s), ctl.group.unanswered_s()
        for r in quiet:
            beat = beats.get(r)
            if formation_silent(max(waits.get(r, 0.0), polled_s), beat, cfg.ping_timeout_s):
                gone[r] = (LostCause.UNRESPONSIVE, f"it answered no poll while the replacements started, and "
                                                   f"its node's heartbeat says {beat_said(beat)}")
    if not gone:
        return Forming()
    ctl.events.emit("faults_merged", lost=sorted(gone), reason="lost while the replacements started: "
                    "replaced in this recovery, before the group forms",
                    causes={r: f"{c.value}: {w}"[:200] for r, (c, w) in sorted(gone.items())})
    return Recovering(tuple(LostRank(r, c, w) for r, (c, w) in gone.items()), ctl.wall())


def lost_from(ctl: Controller, e: GroupError, during: str) -> State:
    """Only ranks that are gone or silent are lost. A rank whose join or restore raised because
    a peer failed is a survivor: it keeps its state, which may be the newest there is."""
    gone = {r: w for r, w in e.ranks.items() if cause_of(w) != LostCause.ERROR}
    survivors = sorted(r for r in e.ranks if r not in gone)
    ctl.events.emit("group_error", during=during, error=str(e)[:500], lost=sorted(gone), survivors=survivors)
    return Recovering(tuple(LostRank(r, cause_of(w), _last_line(w)) for r, w in gone.items()), ctl.wall())


def _last_line(text: str) -> str:
    lines = [x for x in str(text).strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else ""
