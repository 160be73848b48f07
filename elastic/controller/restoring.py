"""Restoring: the new group takes its state from where the plan says (a peer's memory, every
old rank's offered shards, or committed checkpoints in storage), then training resumes."""
from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.checkpoint.layout import committed_checkpoints
from elastic.controller.recovery import lost_from
from elastic.controller.states import Errored, Forming, Recovering, Restoring, Running, State
from elastic.group.worker_group import GroupError, cause_of
from elastic.controller.watch import group_watch
from elastic.policies.failure import LostRank, decide_none_loaded
from elastic.policies.restore import FromPeer, FromShards, FromStorage
from elastic.protocol import RestoreResult
from elastic.storage import call_within

if TYPE_CHECKING:
    from elastic.controller.controller import Controller


def on_restoring(ctl: Controller, _: Restoring) -> State:
    plan, ctl.restore_plan = ctl.restore_plan, FromStorage()
    timeout_s = ctl.job.failure.collective_timeout_s
    watch = group_watch(ctl, "restore")
    if isinstance(plan, FromShards):
        try:
            out = ctl.group.restore_from_shards(plan.offers, plan.old_world, timeout_s, plan.old_pp, plan.copies_step,
                                                watch=watch, faults=restore_faults(ctl, set()))
        except GroupError as e:
            return reshard_failed(ctl, e)
        return restored(ctl, out)
    if isinstance(plan, FromPeer):
        try:
            out = ctl.group.restore_from_peer(plan.src_rank, timeout_s, plan.slot_sources, watch=watch,
                                              faults=restore_faults(ctl, {plan.src_rank, *plan.slot_sources}))
        except GroupError as e:
            return lost_from(ctl, e, "restore from peer")
        return restored(ctl, out)
    return restore_from_storage(ctl, plan)


def restore_faults(ctl: Controller, sources: set[int]) -> dict[int, dict]:
    """The chaos faults that fire as this restore starts (`during_restore`, once the run reached
    their at_step), by rank, for ranks that receive state (not its sources). Handed out once."""
    with ctl.fault_lock:
        reached = max(ctl.step, ctl.training.max_step_seen)  # the polls may lag the ranks' own word
        due = {f["rank"]: f for f in ctl.pending_faults if f.get("during_restore") and f["at_step"] <= reached
               and f["rank"] in ctl.group.members and f["rank"] not in sources}
        ctl.pending_faults = [f for f in ctl.pending_faults if f not in due.values()]
    return due


def restore_from_storage(ctl: Controller, plan: FromStorage) -> State:
    """List the committed checkpoints, then every rank loads the newest that loads. Both wait
    for storage, within checkpoint.restore_wait_s; a restore never starts over from step 0
    while committed checkpoints exist (the workers report "none loaded", not a fresh init)."""
    t0, delay, last_reasons = ctl.now(), 1.0, None
    while True:
        skipped: list[tuple[str, str]] = []
        candidates = committed_for_restore(ctl, skipped, t0)
        if isinstance(candidates, str):
            return Errored(candidates)
        if plan.max_step is not None:  # a rollback: nothing from the abandoned timeline
            candidates = [c for c in candidates if c.step <= plan.max_step]
        for uri, why in skipped:
            ctl.events.emit("checkpoint_skipped", uri=uri, reason=why)
        try:
            out = ctl.group.restore([c.uri for c in candidates], ctl.job.failure.collective_timeout_s,
                                    watch=group_watch(ctl, "restore"))
        except GroupError as e:
            return lost_from(ctl, e, "restore")
        failed = out[0].skipped
        for uri, why in failed:
            ctl.events.emit("checkpoint_skipped", uri=uri, reason=f"load failed: {why}")
        if out[0].uri or not candidates:
            break
        reasons = [why for _, why in failed]
        waited = ctl.now() - t0
        verdict = decide_none_loaded(reasons, last_reasons, waited, ctl.job.checkpoint.restore_wait_s)
        if verdict is not None:
            newest = candidates[0].uri
            return Errored(f"none of the {len(candidates)} committed checkpoints loaded ({verdict}); the newest "
                           f"is {newest}, which failed with: {reasons[0][:300] if reasons else 'no reason given'}. "
                           f"The run does not start over from step 0 while they exist: run the job again once "
                           f"they load, or under a new run.name to start afresh")
        last_reasons = reasons
        delay = wait_for_storage(ctl, "load a committed checkpoint", waited, reasons[0] if reasons else None, delay)
    if out[0].uri:
        ctl.checkpoints.last_committed = out[0].uri
        # The batches a rollback skipped before that checkpoint stay skipped: a resubmitted run (or
        # this one after losing its memory of them) trains on what the run that wrote it did.
        loaded = next((c for c in candidates if c.uri == out[0].uri), None)
        if loaded is not None:
            ctl.run_log.skip_steps |= set(loaded.manifest.skip_steps)
    return restored(ctl, out)


def committed_for_restore(ctl: Controller, skipped: list, t0: float) -> list | str:
    """The committed checkpoints a restore from storage may load, newest first. The state
    can come from nowhere else, so a storage outage is waited out (`storage_unanswered`, with
    backoff), until checkpoint.restore_wait_s after `t0`; then why not, for the run's error."""
    limit = ctl.job.checkpoint.restore_wait_s
    delay = 1.0
    while True:
        found: list = []
        left = limit - (ctl.now() - t0)
        answered, out, error = call_within(
            lambda: committed_checkpoints(ctl.storage, ctl.root, on_skip=lambda u, r: found.append((u, r))),
            max(left, ctl.grace_s))
        if answered and error is None:
            skipped.extend(found)
            return out
        waited = ctl.now() - t0
        if waited >= limit:
            return (f"the state must be restored from storage, which did not answer for {waited:.0f} s "
                    f"(checkpoint.restore_wait_s): {str(error)[:300] if error else 'no answer'}; the newest "
                    f"committed checkpoint reported is {ctl.last_committed or 'none'}: run the job again "
                    f"once storage answers, to resume from it")
        delay = wait_for_storage(ctl, "list committed checkpoints to restore from", waited,
                                 str(error) if error else None, delay)


def wait_for_storage(ctl: Controller, op: str, waited: float, error: str | None, delay: float) -> float:
    """One wait of a restore that can only come from storage: said (`storage_unanswered`), then
    slept, within checkpoint.restore_wait_s; returns the next wait (doubled, at most 15 s)."""
    ctl.events.emit("storage_unanswered", op=op, waited_s=round(waited, 1), error=error[:300] if error else None,
                    using=f"nothing: the state can only come from storage; asking again in {delay:.0f} s")
    ctl.sleep(min(delay, max(0.0, ctl.job.checkpoint.restore_wait_s - waited)))
    return min(2 * delay, 15.0)


def reshard_failed(ctl: Controller, e: GroupError) -> State:
    """The in-memory re-shard could not read every part (a holder's node died) or a rank
    failed: dead ranks go through recovery; otherwise re-form and load from storage."""
    ctl.events.emit("reshard_failed", error=str(e)[:500], fallback="storage")
    ctl.offers = {}
    if any(cause_of(w) != "error" for w in e.ranks.values()):
        return lost_from(ctl, e, "re-shard")
    bad = ctl.group.leave_all(ctl.grace_s)
    if bad:
        return Recovering(tuple(LostRank(r, cause_of(w), w) for r, w in bad.items()), ctl.wall())
    if ctl.resize is not None:
        ctl.resize.path = "storage (after a failed re-shard in memory)"
    return Forming()


def restored(ctl: Controller, out: dict[int, RestoreResult]) -> State:
    r0 = out[0]
    assert all(o.step == r0.step for o in out.values()), f"ranks restored different steps: {out}"
    tr = ctl.training
    reached = tr.max_step_seen  # the furthest any rank had trained before this restore
    tr.step = tr.max_step_seen = r0.step
    ctl.run_log.eras.append((r0.step, ctl.layout.data_world))  # the ledger's world for the steps it trains
    ctl.offers = {}
    slowest = max(out.values(), key=lambda o: o.restore_s)
    restore_s = slowest.restore_s
    extra = {"phases": slowest.phases} if slowest.phases is not None else {}  # the slowest rank's, where timed
    extra.update(transfer_stats(out))
    moved = moved_state(out)
    ctl.events.emit("restored", step=r0.step, source=r0.source, uri=r0.uri, restore_s=restore_s,
                    world_size=len(out), **extra, **moved)
    if ctl.resize is not None:
        ctl.resize.restore_s, ctl.resize.source, ctl.resize.resumed_step = restore_s, r0.source, r0.step
        ctl.resize.moved, ctl.resize.restored_t = moved, ctl.wall()
        if ctl.resize.reached_step is None:
            ctl.resize.reached_step = reached
    if ctl.recovery is not None:
        ctl.recovery.resumed_step = r0.step
        ctl.recovery.moved, ctl.recovery.restored_t = moved, ctl.wall()
    ctl.compute_log = {}
    ctl.stragglers.clear()
    ctl.next_straggler_step = r0.step + 1
    # Keep num_spares warm: replace the ones just used, drop extras started on demand, except
    # those that can bring a shrunk world back up (they wait for capacity, then we grow).
    headroom = ctl.job.scaling.max_size - ctl.world_size
    ctl.group.trim_spares(ctl.job.scaling.num_spares + headroom)
    # Refills start beside the training group: at low CPU priority until built; first where one
    # can gather a tp group split over nodes (regroup.py), then a tp group's worth per node.
    refill = ctl.job.scaling.num_spares - ctl.group.num_spares()
    ctl.group.add_spares(refill, background=True, at=ctl.group.spare_homes(refill))
    return Running()


def transfer_stats(out: dict[int, RestoreResult]) -> dict:
    """For the `restored` event of a restore from a peer: the state one rank holds and the rate it
    crossed at. A broadcast: that state over the slowest rank's transfer (every rank of the group
    spends it at once). Point to point: how many holders sent, to how many ranks, and the rate of
    the receiver that took longest; no rate when every rank held the state already. A re-shard
    rank to rank: the bytes of the rank that received the most, over its `assemble` phase."""
    shards = [o for o in out.values() if o.received_bytes and (o.phases or {}).get("assemble")]
    if shards:
        most = max(shards, key=lambda o: o.received_bytes)
        return {"received_bytes": most.received_bytes,
                "transfer_gb_per_s": round(most.received_bytes / most.phases["assemble"] / 1e9, 3)}
    timed = [o for o in out.values() if o.state_bytes and (o.phases or {}).get("transfer")]
    if not timed:
        return {}
    slowest = max(timed, key=lambda o: o.phases["transfer"])
    if slowest.senders is None:
        return {"state_bytes": slowest.state_bytes,
                "transfer_gb_per_s": round(slowest.state_bytes / slowest.phases["transfer"] / 1e9, 3)}
    stats = {"state_bytes": slowest.state_bytes, "senders": max(o.senders or 0 for o in timed),
             "receivers": max(o.receivers or 0 for o in timed)}
    took = [o for o in timed if o.received_bytes]
    if took:
        last = max(took, key=lambda o: o.phases["transfer"])
        stats["transfer_gb_per_s"] = round(last.received_bytes / last.phases["transfer"] / 1e9, 3)
    return stats


def moved_state(out: dict[int, RestoreResult]) -> dict:
    """The state this restore moved rank to rank, the same two fields whatever the path, so a
    recovery, a resize and a swap can be read against the link's raw speed
    (benchmarks/probes/link_speed.py): `moved_bytes`, summed over the ranks that received (a
    broadcast: every rank but its slot's source), and `moved_gb_per_s`, those bytes over the slowest
    rank's seconds in the move (a copy from a peer: `transfer`; a re-shard: `assemble`), which
    every rank of the group spends at once. A restore from storage or the seed moves nothing
    rank to rank: no fields. Parts a re-shard reads through Ray's object store are its `fetch`."""
    phases = [o.phases or {} for o in out.values()]
    spans = [p.get("transfer", p.get("assemble")) for p in phases]
    if not any(s is not None for s in spans):
        return {}
    moved = sum(o.received_bytes or 0 for o in out.values())
    seconds = max(s for s in spans if s is not None)
    return {"moved_bytes": moved,
            "moved_gb_per_s": round(moved / seconds / 1e9, 3) if moved and seconds > 0 else None}
