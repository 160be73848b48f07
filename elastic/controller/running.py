"""Running: start every rank's run(), then one observe -> decide iteration per call.

Each iteration collects the run() results and one round of polls, folds the reports in, and
decides: go on, finish, roll back, stop for a planned change, or recover. Silence, hangs and
failed collectives all end in `Recovering`, with the lost ranks and why."""
from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.checkpoint.layout import abandon_after, committed_checkpoints
from elastic.controller import finish, lifecycle, regroup, reports, resize, stragglers
from elastic.controller.states import Errored, Recovering, Restoring, Running, RunWatch, State
from elastic.group.worker_group import cause_of
from elastic.policies.buddies import choose_buddies, has_copies
from elastic.policies.failure import (REFUSED_GRACE_S, LostRank, decide_after_peers_failed, decide_refused,
                                     decide_silence, detect_hang, excused_by_heartbeat)
from elastic.policies.restore import FromStorage, rollback_target
from elastic.protocol import LostCause, RankStatus, RunStatus
from elastic.runtime.heartbeat import PING_INTERVAL_S, refused_ranks

if TYPE_CHECKING:
    from elastic.controller.controller import Controller

POLL_INTERVAL_S = 0.2
# The loop's wait while a failure is being settled: the verdicts there wait on the heartbeat's
# snapshot, which is one iteration old, so a shorter iteration is a faster verdict. One poll per
# node stays in flight whatever the iteration, so this adds no polls.
SETTLE_POLL_S = 0.05
# How long a rank and its node's heartbeat must both be silent, once its peers' collectives have
# failed, for it to count as lost before ping_timeout_s: two rounds of pings unanswered, where a
# live sidecar answers in milliseconds.
PEERS_FAILED_GRACE_S = 2 * PING_INTERVAL_S
# An iteration of the run loop takes POLL_INTERVAL_S and a few non-blocking calls. One that took
# longer than this (a frozen controller, a host that did not schedule it) saw nothing of the run
# meanwhile: every rank's silence and the idle time grew by the stall, not by the ranks.
STALL_FLOOR_S = 3.0


def on_running(ctl: Controller, st: Running) -> State:
    """The state machine steps through a run one poll at a time (and tests can drive it that way)."""
    if st.watch is None:
        with ctl.fault_lock:  # those that fire as a group restores are handed out by restoring.py
            faults = [f for f in ctl.pending_faults if not f.get("during_restore")]
        ctl.run_refs = ctl.group.run(ctl.job.run.num_steps, faults, sorted(ctl.run_log.skip_steps), buddies(ctl),
                                     max(ctl.run_log.evaluations, default=0))
        ctl.training.reports = {}
        ctl.training.last_progress_at = ctl.now()
        return Running(RunWatch(dict(ctl.run_refs)))
    return tick(ctl, st.watch) or st


def buddies(ctl: Controller) -> dict[int, int]:
    """Who keeps whose in-memory copy in this group (state held once: FSDP, a pipeline with one
    replica, HSDP at one replica group; checkpoint.memory_every_steps), said in a `buddies` event; {} where the state is
    replicated (a replica is the copy)."""
    lay = ctl.layout
    if not has_copies(ctl.job.checkpoint.memory_every_steps, ctl.shape.sharded, lay.pp, lay.dp, lay.tp, lay.shards):
        return {}
    pairs, alone = choose_buddies({r: m.node_id for r, m in ctl.group.members.items()})
    ctl.events.emit("buddies", generation=ctl.generation, buddies=pairs, alone=alone,
                    every_steps=ctl.job.checkpoint.memory_every_steps,
                    reason="each rank's copy on another node" if not alone else
                    f"ranks {alone} share their node with every other rank: no copy of theirs survives its loss")
    return pairs


def tick(ctl: Controller, w: RunWatch) -> State | None:
    """One iteration of the run loop: collect run() results and polls, then decide. None: go on."""
    cfg = ctl.job.failure
    tr = ctl.training
    note_lease(ctl)
    results, died = ctl.group.collect_runs(w.refs, POLL_INTERVAL_S if w.failing_since is None else SETTLE_POLL_S)
    for rank, (cause, detail) in died.items():
        w.lost[rank] = LostRank(rank, cause, detail)
    for rank, out in results.items():
        if out.status == RunStatus.DONE:
            w.done[rank] = out
        elif out.status == RunStatus.STOPPED:
            w.stopped.add(rank)
            tr.max_step_seen = max(tr.max_step_seen, out.step)  # where a planned stop left training
        elif out.status == RunStatus.ROLLBACK:
            w.rollback[rank] = out
        elif out.status == RunStatus.BAD_STEP:
            # Every rank agreed on it in the step's one all-reduce: a verdict on the data or the
            # numerics that train.bad_step asked to stop on, not a crash of the user's code.
            reason = f"{out.error}; last committed checkpoint: {ctl.last_committed or 'none'}"
            ctl.events.emit("decision", decision="Raise", ranks=[], step=out.step, reason=reason)
            return Errored(reason)
        elif out.status == RunStatus.USER_ERROR:
            ctl.events.emit("user_error", rank=rank, step=out.step, error=out.error, traceback=out.traceback)
            return Recovering((), ctl.wall(), user_error=f"rank {rank} at step {out.step}: {out.error}")
        else:
            w.aborted.add(rank)
            ctl.events.emit("collective_failed", rank=rank, step=out.step, error=out.error[:300])
    answers, silent = ctl.group.poll_nowait(cfg.ping_timeout_s)
    reports.absorb(ctl, answers)
    lifecycle.tend(ctl)
    if stalled(ctl, w):
        return None
    for r, why in silent.items():
        if why != LostCause.UNRESPONSIVE and r not in w.lost:  # Ray says it is dead: no need to wait
            w.lost[r] = LostRank(r, cause_of(why), why)
    beats: dict = {}
    if w.failing_since is None:
        unanswered = ctl.group.unanswered_s()
        beats = ctl.house.beats = ctl.group.beats() if cfg.heartbeat else {}
        idle = ctl.now() - tr.last_progress_at
        refused = refused_ranks(beats)  # none but while a node refuses: no per-rank work otherwise
        decision = None
        if refused:
            waiting = set(ctl.group.members) - set(w.done) - w.stopped
            decision = decide_refused(waiting, refused, unanswered, REFUSED_GRACE_S)
        decision = decision or decide_silence(silent, unanswered, idle, cfg, list(tr.step_times), beats)
        note_excused(ctl, silent, unanswered, idle, beats)
        if decision is not None:
            # Silence while the others wait (a stopped or cut-off machine), or a node that refuses
            # the heartbeat (its processes gone). Its peers may be blocked on it and never see an
            # error of their own; the recovery aborts their collectives.
            quiet, why = decision
            ctl.events.emit("silence_detected", ranks=list(quiet), reason=why,
                            unanswered_s={r: round(unanswered[r], 2) for r in quiet},
                            heartbeat={r: (beat_record(beats[r]) if r in beats else None) for r in quiet})
            for r in quiet:
                w.lost[r] = LostRank(r, LostCause.UNRESPONSIVE, why)
            return Recovering(tuple(w.lost[r] for r in sorted(w.lost)), ctl.wall())
    members = set(ctl.group.members)
    # A stop is agreed in one all-reduce, so either every rank stopped or none did.
    if w.stopped and w.stopped == members and w.failing_since is None:
        if w.planned is not None:
            reports.collect(ctl)
            return w.planned
        # A stop nobody planned any more (the request reached only some ranks, and the plan
        # was dropped): carry on training.
        ctl.events.emit("stop_without_plan", step=ctl.step)
        return Running()
    if members and set(w.done) == members:
        return finish.finish(ctl, w.done)
    if members and set(w.rollback) == members and w.failing_since is None:
        return rollback(ctl, list(next(iter(w.rollback.values())).bad_steps))
    if (w.lost or w.aborted) and w.failing_since is None:
        w.failing_since = ctl.now()
        # Start a replacement now, while we settle exactly who is lost: the slow part of a new
        # worker (process start, imports, model build) overlaps with detection. A pre-started one
        # on the node of a rank whose process died takes the slot that death frees.
        near = tuple(ctl.group.members[r].node_id for r, lost in sorted(w.lost.items())
                     if r in ctl.group.members and lost.cause == LostCause.PROCESS_DIED)
        ctl.group.add_spares(max(len(w.lost), 1) - ctl.group.num_spares(), on_demand=True, near=near)
    if w.failing_since is not None:
        for r, why in silent.items():
            w.lost.setdefault(r, LostRank(r, cause_of(why), why))
        unaccounted = members - w.aborted - w.stopped - set(w.done) - set(w.lost)
        if unaccounted and cfg.heartbeat:
            # A node that refuses the heartbeat lost its processes: no need for a failed collective.
            now_beats, waits = ctl.group.beats(), ctl.group.unanswered_s()
            refused = decide_refused(unaccounted, refused_ranks(now_beats), waits, REFUSED_GRACE_S)
            for r in refused[0] if refused else ():
                w.lost[r] = LostRank(r, LostCause.UNRESPONSIVE, refused[1])
                unaccounted.discard(r)
        if unaccounted and w.aborted and cfg.heartbeat:
            # A death closes sockets: its peers' collectives fail at once, and its node's
            # heartbeat says at once whether it is gone. No need to wait out ping_timeout_s.
            gone = decide_after_peers_failed(unaccounted, waits, now_beats, PEERS_FAILED_GRACE_S,
                                             cfg.ping_timeout_s)
            for r, (cause, why) in gone.items():
                w.lost[r] = LostRank(r, cause, why)
            unaccounted -= gone.keys()
        # Settled: every rank has failed its collective, finished, or is lost. Or the bound
        # passed: a rank that still answers pings but never aborts is dealt with as stuck.
        if not unaccounted or ctl.now() - w.failing_since > cfg.ping_timeout_s + 1.0:
            return Recovering(tuple(w.lost[r] for r in sorted(w.lost)), ctl.wall())
        return None
    if w.planned is None and ctl.job.stragglers.enabled:
        w.planned = stragglers.check(ctl)
    if w.planned is None:
        w.planned = resize.check_growth(ctl)
    if w.planned is None:
        w.planned = regroup.check(ctl)
    # Ranks that are done are waiting for nobody: at the last step DDP's rank 0 commits alone,
    # after the others' part of the persist ended and they returned.
    waiting = members - set(w.done)
    if waiting and all(r in tr.reports and tr.reports[r].status == RankStatus.STORAGE_WAIT for r in waiting):
        # Every rank waits for a persist (storage slow or down): not a hang. Persists retry with
        # backoff and then fail, reported; training never pays for storage with a step.
        if not w.storage_wait_logged:
            w.storage_wait_logged = True
            ctl.events.emit("storage_wait", step=ctl.step,
                            reason="every rank waits for a checkpoint persist; not counted as a hang")
        if w.storage_wait_since is None:
            w.storage_wait_since = ctl.now()
        verdict = storage_wait_verdict(ctl, ctl.now() - w.storage_wait_since, sorted(waiting))
        if verdict is not None:
            return verdict
        tr.last_progress_at = ctl.now()
    else:
        w.storage_wait_since = None
    hung, reason = detect_hang(tr.last_progress_at, list(tr.step_times), cfg, ctl.now())
    if hung:
        culprits = silent or {r: "no progress" for r in members}
        ctl.events.emit("hang_detected", reason=reason, ranks=sorted(culprits),
                        heartbeat={r: {"age_s": round(b.age_s, 2), "state": b.state, "cpu_ticks": b.cpu_ticks}
                                   for r, b in sorted(beats.items()) if r in culprits})
        return Recovering(tuple(LostRank(r, LostCause.HANG, reason) for r in culprits), ctl.wall())
    return None


def stalled(ctl: Controller, w: RunWatch) -> bool:
    """Whether this iteration judges nobody because the controller itself stalled since the
    last one: it asks for its lease at once (a driver frozen past its lease may have been
    taken over, and must not form, restore or replace anything: the next iteration ends it)
    and judges at the next iteration, from polls taken after the stall. Never two iterations in
    a row, so a loop that is merely slow every time still judges every other iteration."""
    now, last = ctl.now(), w.last_tick_t
    w.last_tick_t = now
    bound = max(STALL_FLOOR_S, 2 * ctl.job.failure.ping_timeout_s)
    if last is None or now - last <= bound or w.stall_excused:
        w.stall_excused = False
        return False
    w.stall_excused = True
    ctl.check_lease(force=True)
    ctl.events.emit("controller_stalled", stalled_s=round(now - last, 2), step=ctl.step,
                    lease_lost=ctl.lease.lost is not None,
                    reason=f"{now - last:.1f} s between two iterations of the run loop (bound {bound:g} s): "
                           f"no rank is judged on silence or progress measured across the stall")
    return True


def storage_wait_verdict(ctl: Controller, waited_s: float, ranks: list[int]) -> Errored | None:
    """A wait for storage is progress only within a bound: checkpoint.persist_timeout_s, after
    which each rank gives its persist up by itself and goes on (worker `_wait_persist`), plus
    the grace for that to show in a poll (3 x ping_timeout_s). A wait past it means the ranks
    could not give the persist up (a storage call that cannot be cut short holds them): the run
    fails, naming storage and the bound, rather than wait on it without end."""
    bound_s = ctl.job.checkpoint.persist_timeout_s + ctl.grace_s
    if waited_s <= bound_s:
        return None
    reason = (f"storage {ctl.storage.uri} held every rank in a checkpoint persist for {waited_s:.0f} s, "
              f"past its bound of {bound_s:g} s (checkpoint.persist_timeout_s="
              f"{ctl.job.checkpoint.persist_timeout_s:g} + 3 x failure.ping_timeout_s), and the ranks did "
              f"not give it up themselves; last committed checkpoint: {ctl.last_committed or 'none'}: "
              f"resume from it once storage answers")
    ctl.events.emit("storage_timeout", step=ctl.step, ranks=ranks, waited_s=round(waited_s, 1),
                    bound_s=round(bound_s, 1), reason=reason)
    return Errored(reason)


def beat_record(beat) -> dict:
    """What an event says of a rank's heartbeat."""
    return {"age_s": round(beat.age_s, 2), "state": beat.state, **({"refused": True} if beat.refused else {})}


def note_excused(ctl: Controller, silent: dict[int, str], unanswered: dict[int, float], idle: float,
                 beats: dict) -> None:
    """Once per silent spell: a rank the poll-only rule would have called lost, kept because its
    heartbeat says the process runs (its Python is held, its machine is up)."""
    house = ctl.house
    house.excused &= {r for r, why in silent.items() if why == LostCause.UNRESPONSIVE}
    excused = excused_by_heartbeat(silent, unanswered, idle, ctl.job.failure, list(ctl.training.step_times), beats)
    for r, state in sorted(excused.items()):
        if r not in house.excused:
            house.excused.add(r)
            ctl.events.emit("silence_excused", rank=r, step=ctl.step, unanswered_s=round(unanswered[r], 2),
                            idle_s=round(idle, 2), state=state, heartbeat_age_s=round(beats[r].age_s, 2))


def rollback(ctl: Controller, bad_steps: list[int]) -> State:
    """train.bad_step=rollback: bad_step_limit steps in a row made no update. Every rank stopped
    at the same step; back to the newest checkpoint that holds the last good step's weights, and
    skip the bad batches on the way (policies.restore.rollback_target). The checkpoints of an
    abandoned timeline are un-committed."""
    reports.collect(ctl)
    first, last = min(bad_steps), max(bad_steps)
    committed = [c.step for c in committed_checkpoints(ctl.storage, ctl.root)]
    to_step, skip, why = rollback_target(committed, bad_steps)
    # Un-committing writes into the run's checkpoints: only while this controller still holds the
    # run (the fence shows its generation), or one that lost it would erase the new holder's commits.
    held, not_held = ctl.fence.holds()
    if not held:
        return Errored(f"rollback to step {to_step} not done: this controller no longer holds the run "
                       f"({not_held}); no checkpoint was un-committed")
    abandoned = abandon_after(ctl.storage, ctl.root, to_step)
    ctl.checkpoints.committed_steps = {st for st in ctl.checkpoints.committed_steps if st <= to_step}
    ctl.run_log.skip_steps |= skip
    ctl.events.emit("rolled_back", to_step=to_step, bad_steps=bad_steps, skip_from=max(first, to_step + 1),
                    skip_to=last, abandoned=abandoned,
                    reason=f"{why} (train.bad_step_limit={ctl.job.train.bad_step_limit})")
    ctl.restore_plan = FromStorage(max_step=to_step)
    ctl.run_refs = {}
    return Restoring()


def note_lease(ctl: Controller) -> None:
    """Say when the lease lapses (no renewal landed for run.lease_ttl_s: storage out or cut off)
    and when a renewal lands again: the run trains on either way (see Lease.start_renewing)."""
    lapsed = ctl.lease.lapsed_s()
    if lapsed is not None and not ctl.house.lease_lapsed:
        ctl.house.lease_lapsed = True
        ctl.events.emit("lease_lapsed", lease=ctl.lease.number, since_s=round(lapsed, 1), error=ctl.lease.last_error,
                        then="training goes on; a driver that takes the run over fences this one's "
                             "workers off, and this one stops when a renewal finds the newer lease")
    elif lapsed is None and ctl.house.lease_lapsed:
        ctl.house.lease_lapsed = False
        ctl.events.emit("lease_renewed", lease=ctl.lease.number)

