"""Changes of size and planned replacements: Swapping, Growing, Dropping, Trading, and the shrink
a recovery falls back to. Every change of world size goes through one `apply_resize()`.

A planned change (swap a straggler, grow into new capacity, drop a straggler) stops every rank
at a common step boundary first, so nothing is lost; the state then comes from memory. How the
layout may change is the strategy's `Shape`'s to say (elastic/parallel/shape.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.controller.records import GrowDeferral, ResizeRecord
from elastic.controller.states import Dropping, Forming, Growing, Recovering, State, Swapping, Trading
from elastic.group.worker_group import GroupError, cause_of
from elastic.parallel.topology import Layout
from elastic.policies.failure import LostRank
from elastic.policies.placement import split_groups
from elastic.policies.restore import RestoreSource, path_of, planned_restore, restore_after_shrink
from elastic.protocol import LostCause

if TYPE_CHECKING:
    from elastic.controller.controller import Controller


def apply_resize(ctl: Controller, layout: Layout, plan: RestoreSource, reason: str, t0: float, **extra) -> State:
    """The one way the world changes size: the new layout and restore plan, the resize record
    (opened here unless the decision opened it earlier), and the `resized` event. `reason` is
    the event's; a record opened by the decision keeps the decision's."""
    old = ctl.world_size
    ctl.layout, ctl.world_size = layout, layout.world_size
    ctl.restore_plan = plan
    if ctl.resize is None:
        begin_resize(ctl, ctl.world_size, reason, old_world_size=old)
    ctl.resize.new_world_size = ctl.world_size
    ctl.resize.path = path_of(plan)
    members = sorted(ctl.group.members.items())  # renumbered: where every rank is now
    ctl.events.emit("resized", old_world_size=old, new_world_size=ctl.world_size, path=ctl.resize.path,
                    reason=reason, decide_s=ctl.now() - t0, nodes={r: m.node_id[:12] for r, m in members},
                    pids={r: m.pid for r, m in members}, **extra)
    return Forming()


def begin_resize(ctl: Controller, new_world: int, reason: str, old_world_size: int | None = None) -> None:
    ctl.resize = ResizeRecord(decided_t=ctl.wall(), old_world_size=ctl.world_size if old_world_size is None
                              else old_world_size, new_world_size=new_world, reason=reason)


def shrink(ctl: Controller, why: str, t0: float) -> State:
    """No replacement came: go on with the ranks we have, in the largest layout they fill,
    renumbered. The global batch and the sample order do not change; each rank's share of the
    batch grows. A staged layout drops whole replicas, then re-partitions over fewer stages."""
    sc = ctl.job.scaling
    reason = (f"no replacement within scaling.shrink_after_s={sc.shrink_after_s}s "
              f"({why.splitlines()[0][:200]}); scaling.min_workers={sc.min_size}")
    old = ctl.layout
    newest = max(ctl.survivor_steps.values(), default=None)
    holders = frozenset(r for r, st in ctl.survivor_steps.items() if st == newest)
    new, mapping = ctl.shape.shrink(ctl.top, old, sorted(ctl.group.members), sc.min_size, holders)
    ctl.group.renumber(mapping)
    plan = restore_after_shrink(ctl.shape, ctl.restore_plan, old, mapping, new, ctl.survivor_steps,
                                ctl.job.failure.peer_restore)
    extra = {"old_layout": str(old), "new_layout": str(new)} if ctl.shape.staged else {}
    return apply_resize(ctl, new, plan, reason, t0, **extra)


def check_growth(ctl: Controller) -> Growing | None:
    """Below max_workers, keep workers waiting for capacity; once some are warm, plan a stop
    at a step boundary and grow (never in the middle of a step or of a checkpoint persist)."""
    sc = ctl.job.scaling
    now = ctl.now()
    if ctl.world_size >= sc.max_size or now - ctl.house.grow_checked_at < sc.grow_check_s:
        return None
    ctl.house.grow_checked_at = now
    want = sc.max_size - ctl.world_size
    # Queued until capacity exists. Not calibrated first: a worker wanted to grow the world takes a
    # rank as soon as it is built (calibration cost 4.4 s of a 1 GB grow here); one that stays a
    # spare is calibrated when a straggler decision first weighs it.
    ctl.group.add_spares(sc.num_spares + want - ctl.group.num_spares(), calibrate=False)
    ctl.group.refresh_spares()
    # A warm worker fills a missing rank before it is kept as a spare: a group below full size
    # loses throughput on every step, where a spare only shortens a recovery that may not come
    # (and with min_workers below the size, a fault without a spare costs a shrink, not a stall).
    # The pool refills after the grow.
    ready = len(ctl.group.ready_spares)
    if ready < 1:
        return None
    target = ctl.shape.grow(ctl.top, ctl.layout, min(ready, want))  # staged: whole layouts only
    if target is None:
        return None
    n = target.world_size - ctl.world_size
    if defer_for_persist(ctl, n):
        return None
    if not request_stop(ctl):
        return None
    reason = (f"{n} warm worker(s) available and world size {ctl.world_size} < "
              f"scaling.max_workers={sc.max_size}: grow at the next step boundary")
    ctl.events.emit("decision", decision="Grow", ranks=list(range(ctl.world_size, ctl.world_size + n)), reason=reason)
    begin_resize(ctl, ctl.world_size + n, reason)
    return Growing(n)


def defer_for_persist(ctl: Controller, n: int) -> bool:
    """A planned stop waits for the persist in flight with every rank idle. So while one runs,
    the grow waits instead and training goes on; once that persist is over (committed or
    failed), the stop is requested even if the next one has started, so frequent checkpoints
    cannot put a grow off for more than one persist."""
    reports = ctl.training.reports
    busy = any(r in reports and reports[r].persisting for r in ctl.group.members)
    if ctl.grow_deferred is None:
        if not busy:
            return False
        ctl.grow_deferred = GrowDeferral(ctl.last_committed)
        ctl.events.emit("grow_deferred", ranks=list(range(ctl.world_size, ctl.world_size + n)),
                        reason="a checkpoint persist is in flight: training goes on until it is over, "
                               "then the group stops at a step boundary and grows")
        return True
    if busy and ctl.last_committed == ctl.grow_deferred.last_committed:
        return True
    ctl.grow_deferred = None
    return False


def request_stop(ctl: Controller) -> bool:
    """Ask every rank to stop at a common step boundary. False when a rank cannot be asked:
    it is failing anyway, and the failure path takes over."""
    try:
        ctl.group.request_stop(ctl.generation, ctl.grace_s)
    except GroupError:
        return False
    return True


def leave_for_planned_change(ctl: Controller, leaving: int | None = None) -> Recovering | None:
    """Every rank stopped at the same boundary; a sharded state's parts are offered before the
    ranks drop the group: kept in memory by the ranks the shape names (moved rank to rank at the
    restore), put in the object store by the others (the one `leaving`, a pipeline's ranks whose
    re-partition moves state by name). A rank that cannot turns the planned change into a
    recovery."""
    ctl.run_refs = {}
    ctl.offers = {}
    keep = ctl.shape.offer_keepers(list(ctl.group.members), leaving)
    if keep is not None and ctl.job.failure.peer_restore:
        ctl.offers, late = ctl.group.offer_shards(ctl.job.failure.collective_timeout_s, keep)
        if late:
            return Recovering(tuple(LostRank(r, LostCause.UNRESPONSIVE, "did not offer its shards") for r in late),
                              ctl.wall())
    bad = ctl.group.leave_all(ctl.grace_s)
    if bad:
        return Recovering(tuple(LostRank(r, cause_of(w), w) for r, w in bad.items()), ctl.wall())
    return None


def on_growing(ctl: Controller, st: Growing) -> State:
    t0 = ctl.now()
    failed = leave_for_planned_change(ctl)
    if failed:
        return failed
    old, old_layout = ctl.world_size, ctl.layout
    new_ranks = list(range(old, old + st.num_new))
    try:
        ctl.group.promote(new_ranks, ctl.job.failure.replacement_timeout_s, ctl.job.failure.ping_timeout_s)
    except GroupError:
        if ctl.shape.staged:  # whole layouts only: back to the old one
            for r in new_ranks:
                ctl.group.kill(r)
        else:
            ctl.group.renumber()  # whatever joined keeps consecutive ranks
    layout = ctl.shape.grow(ctl.top, old_layout, len(ctl.group.members) - old) or old_layout
    plan = planned_restore(ctl.shape, ctl.job.failure.peer_restore, ctl.step, ctl.offers, old,
                           old_layout=old_layout, new_layout=layout)
    return apply_resize(ctl, layout, plan, "capacity appeared", t0)


def on_dropping(ctl: Controller, st: Dropping) -> State:
    """A straggler with no spare to take its place, and the world may shrink: stop at a
    step boundary, let it hand over its part of the state, and go on without it."""
    t0 = ctl.now()
    failed = leave_for_planned_change(ctl, leaving=st.rank)
    if failed:
        return failed
    old = ctl.world_size
    node = ctl.group.members[st.rank].node_id[:12]
    ctl.group.kill(st.rank)  # a sharded state's offer outlives the process (object store)
    ctl.group.renumber()
    plan = planned_restore(ctl.shape, ctl.job.failure.peer_restore, ctl.step, ctl.offers, old)
    return apply_resize(ctl, Layout(1, len(ctl.group.members)), plan,
                        f"rank {st.rank} dropped (node {node}): {st.reason}", t0)


def on_swapping(ctl: Controller, st: Swapping) -> State:
    """A planned replacement at a step boundary (a straggler's, or a regroup's: `st.to_node`):
    nothing is lost, the spare gets state from a healthy rank's memory."""
    cfg = ctl.job.failure
    t0 = ctl.now()
    failed = leave_for_planned_change(ctl, leaving=st.rank)
    if failed:
        return failed
    max_calib = ctl.job.stragglers.threshold * ctl.swap_healthy_s
    old = ctl.group.members[st.rank]
    ctl.group.kill(st.rank)
    spare = ctl.group.take_spare_for(st.rank, max_calib, cfg.ping_timeout_s, home=st.to_node)
    how = "warm spare"
    if spare is None:
        ctl.group.promote([st.rank], cfg.replacement_timeout_s, cfg.ping_timeout_s)
        how = "started on demand"
    src = min(r for r in ctl.group.members if r != st.rank)
    ctl.restore_plan = planned_restore(ctl.shape, cfg.peer_restore, ctl.step, ctl.offers, ctl.world_size, src,
                                       old_layout=ctl.layout, new_layout=ctl.layout, swapped=st.rank)
    tp = ctl.job.train.tp.size
    split = split_groups({r: m.node_id for r, m in ctl.group.members.items()}, tp) if tp > 1 else []
    ctl.events.emit("swapped", rank=st.rank, how=how, old_node=old.node_id[:12],
                    new_node=ctl.group.members[st.rank].node_id[:12], swap_s=ctl.now() - t0,
                    spare_calib_s=spare.calib_s if spare else None,
                    **({"tp_split_groups": split, "regroup": st.to_node is not None} if tp > 1 else {}))
    return Forming()


def on_trading(ctl: Controller, st: Trading) -> State:
    """Two ranks of one slot in different replicas exchange their numbers (regroup.py): every
    rank stopped at the same boundary, the group forms again with the two renumbered, and each
    keeps the state it holds (its slot's, which every replica of the slot holds alike): the
    restore copies nothing. Each now trains its new replica's share of the batch."""
    t0 = ctl.now()
    failed = leave_for_planned_change(ctl)
    if failed:
        return failed
    a, b = st.ranks
    ctl.group.renumber({**{r: r for r in ctl.group.members}, a: b, b: a})
    ctl.restore_plan = planned_restore(ctl.shape, True, ctl.step, ctl.offers, ctl.world_size,
                                       old_layout=ctl.layout, new_layout=ctl.layout)
    tp = ctl.job.train.tp.size
    nodes = {r: m.node_id for r, m in ctl.group.members.items()}
    ctl.events.emit("traded", ranks=[a, b], nodes={r: nodes[r][:12] for r in (a, b)}, trade_s=ctl.now() - t0,
                    tp_split_groups=split_groups(nodes, tp), reason=st.reason)
    return Forming()
