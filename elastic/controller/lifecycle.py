"""Starting and Forming, the run's lease, the fence and its generations, and the background care
of spares."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from elastic.checkpoint.fencing import current_generation
from elastic.checkpoint.lease import LeaseHeld
from elastic.controller.recovery import lost_from
from elastic.controller.states import Errored, Forming, Restoring, Starting, State
from elastic.group.worker_group import GroupError
from elastic.config.loading import dump_job
from elastic.storage import Storage, call_within, join

if TYPE_CHECKING:
    from elastic.controller.controller import Controller


def on_starting(ctl: Controller, _: Starting) -> State:
    refused = take_lease(ctl)
    if refused:
        return Errored(refused)
    ctl.events.emit("run_started", run=ctl.job.run.name, num_workers=ctl.job.scaling.num_workers,
                    num_steps=ctl.job.run.num_steps, run_dir=ctl.run_dir, lease=ctl.lease.number)
    ctl.lease.start_renewing()
    write_config(ctl)
    continue_generations(ctl)
    n = ctl.job.scaling.num_workers
    try:
        ctl.group.start(list(range(n)), ctl.job.failure.replacement_timeout_s)
    except GroupError as e:
        return Errored(str(e))
    ctl.events.emit("workers_started", ranks=list(range(n)),
                    nodes={r: m.node_id[:12] for r, m in ctl.group.members.items()},
                    pids={r: m.pid for r, m in ctl.group.members.items()})
    tp = ctl.job.train.tp.size
    if tp > 1:  # where each tp group landed (placement asks for one node; Ray has the last word)
        split = [g for g in range(0, n, tp) if len({ctl.group.members[r].node_id for r in range(g, g + tp)}) > 1]
        planned = ctl.group.placement.reason(tp) if ctl.group.placement else ""
        ctl.events.emit("placement", tp=tp, split_groups=split, planned=planned,
                        reason=(f"every tp group of {tp} ranks on one node" if not split else
                                f"tp groups starting at ranks {split} span nodes: their tensor-parallel "
                                f"collectives cross nodes (no node had room for a whole group)"))
    # With tp, a tp group's worth of spares per node: a node kill that takes a whole group finds
    # its replacements together (policies/placement.py spare_homes).
    ctl.group.add_spares(ctl.job.scaling.num_spares, at=ctl.group.spare_homes(ctl.job.scaling.num_spares))
    if ctl.job.scaling.wait_for_spares and ctl.job.scaling.num_spares:
        t0 = ctl.now()
        ok = ctl.group.wait_spares_ready(ctl.job.failure.replacement_timeout_s)
        ctl.events.emit("spares_ready" if ok else "spares_not_ready", num_ready=len(ctl.group.ready_spares),
                        wait_s=ctl.now() - t0)
    if ctl.job.scaling.wait_for_spares and ctl.job.scaling.prestarted_per_node:
        t0 = ctl.now()
        ok = ctl.group.wait_prestarted_ready(ctl.job.failure.replacement_timeout_s)
        ctl.events.emit("prestarted_ready_all" if ok else "prestarted_not_ready",
                        num_ready=ctl.group.prestarted_news()[0], wait_s=ctl.now() - t0)
    return Forming()


CONFIG_FILE = "config.yaml"


def write_config(ctl: Controller) -> None:
    """The job this start runs, resolved (every default) and with credentials redacted, into the run
    folder as config.yaml, once the run's lease is ours. A resumed run whose job changed keeps the
    one before as config.<start>.yaml (the lease number that wrote it): no record is overwritten.
    Storage that does not answer is reported and does not hold the run up."""
    from elastic import __version__
    text = (f"# elastic {__version__}: the job of start {ctl.lease.number} of run {ctl.job.run.name!r}, "
            f"every default filled in, credentials redacted\n" + dump_job(ctl.job))
    answered, _, error = call_within(lambda: save_config(ctl.storage, ctl.run_dir, text), ctl.grace_s)
    if not answered or error is not None:
        ctl.events.emit("config_not_written", uri=join(ctl.run_dir, CONFIG_FILE),
                        error=str(error)[:300] if error else f"storage did not answer within {ctl.grace_s:g} s")


def save_config(storage: Storage, run_dir: str, text: str) -> None:
    uri = join(run_dir, CONFIG_FILE)
    old = storage.read_bytes(uri).decode() if storage.exists(uri) else None
    if old is not None and old.partition("\n")[2] != text.partition("\n")[2]:  # a changed job: keep the one before
        found = re.search(r"the job of start (\d+) ", old.partition("\n")[0])
        storage.write_bytes(join(run_dir, f"config.{found.group(1) if found else 'previous'}.yaml"), old.encode())
    storage.write_bytes(uri, text.encode())


def on_forming(ctl: Controller, _: Forming) -> State:
    t0 = ctl.now()
    cfg = ctl.job.failure
    ctl.generation += 1
    write_fence(ctl)
    try:
        slowest_ping_s = ctl.group.form(ctl.generation, cfg.rendezvous_timeout_s, cfg.ping_timeout_s, ctl.layout.pp)
    except GroupError as e:
        return lost_from(ctl, e, "group formation")
    extra = {"stages": ctl.layout.pp, "replicas": ctl.layout.dp} if ctl.shape.staged else {}
    if ctl.layout.shards > 1:
        extra["shards"] = ctl.layout.shards  # HSDP: ranks per replica group
    ctl.events.emit("group_formed", world_size=len(ctl.group.members), form_s=ctl.now() - t0,
                    generation=ctl.generation, slowest_ping_s=slowest_ping_s, **extra)
    return Restoring()


def take_lease(ctl: Controller) -> str | None:
    """One live run per run folder (elastic/checkpoint/lease.py): before anything starts or is
    written, the run's lease. Returns why not: another driver holds it, or storage did not answer
    within checkpoint.restore_wait_s (without the lease nothing may write: it fails closed). A
    holder that has missed its renewals (a driver that is likely gone: the whole cluster was lost
    and KubeRay's retry started this one) is waited out, up to run.lease_ttl_s, and taken over;
    a renewal seen meanwhile refuses this driver at once."""
    t0, delay, waited_out = ctl.now(), 1.0, False
    while True:
        answered, _, error = call_within(ctl.lease.take, ctl.grace_s)
        if answered and error is None:
            return None
        if isinstance(error, LeaseHeld) and (error.wait_s is None or waited_out):
            return str(error)
        if isinstance(error, LeaseHeld):
            # Waited for once: the lease's age then says whether its holder came back.
            ctl.events.emit("lease_wait", wait_s=round(error.wait_s, 1), reason=str(error))
            ctl.sleep(error.wait_s + 0.5)
            waited_out = True
            continue
        waited = ctl.now() - t0
        if waited >= ctl.job.checkpoint.restore_wait_s:
            return (f"cannot take the run's lease in {ctl.lease.dir}: storage did not answer for {waited:.0f} s "
                    f"(checkpoint.restore_wait_s): {str(error)[:300] if error else 'no answer'}; nothing was "
                    f"started or written: run the job again once storage answers")
        ctl.sleep(delay)
        delay = min(2 * delay, 15.0)


def continue_generations(ctl: Controller) -> None:
    """A resubmitted run (same name: a new `ray job submit`, or the driver rerun after a head
    loss) numbers its generations on from its lease and the fence an earlier submission left, so
    a zombie of that submission (a frozen node that comes back) holds an older generation than
    every group of this one and can never pass the fence."""
    # Generations come from the lease first: a newer lease's groups are above every group an
    # older holder (a zombie driver) can form, even where the fence cannot be read.
    ctl.generation = ctl.lease.generation_base()
    answered, prior, error = call_within(lambda: current_generation(ctl.storage, ctl.root), ctl.grace_s)
    if not answered or error is not None:
        ctl.events.emit("storage_unanswered", op="read the fence", waited_s=ctl.grace_s,
                        error=str(error)[:300] if error else None,
                        using="generation 1 (an earlier submission's zombie is then fenced only "
                              "until this run reaches its generation)")
    elif prior:
        ctl.generation = max(ctl.generation, prior)
        ctl.events.emit("generations_continued", after=prior)


def write_fence(ctl: Controller) -> None:
    """The fence: the newest generation, in storage beside the checkpoints. A worker may write
    checkpoints only while the fence shows its own generation (a frozen worker that comes back
    finds itself fenced off). Written before the group forms when storage answers within 3 x
    ping_timeout_s; else (an outage) the group forms anyway, the write goes on in the
    background until it lands, and until then this generation writes no checkpoint."""
    wait_s = ctl.grace_s
    if not ctl.fence.announce(ctl.generation, wait_s):
        why = f"failed: {ctl.fence.last_error}" if ctl.fence.last_error else "no answer"
        ctl.events.emit("fence_not_written", generation=ctl.generation,
                        error=f"storage did not take the fence within {wait_s:.1f} s ({why})"[:300],
                        then="written in the background until it lands; no checkpoint of this "
                             "generation is written before")


def tend(ctl: Controller) -> None:
    """Background care, every 2 s: suspect nodes that answer again become usable; spares that
    finished warming are noticed, dead ones replaced."""
    now = ctl.now()
    if now - ctl.house.spares_checked_at < 2.0:
        return
    ctl.house.spares_checked_at = now
    group = ctl.group
    for node in group.probe_suspects():
        ctl.events.emit("node_cleared", node=node[:12], reason="answers again, or Ray declared it dead")
    for why in group.tend_prestarted():
        ctl.events.emit("spare_lost", reason=why)
    num_ready, news = group.prestarted_news()
    for node, pid in news:
        ctl.events.emit("prestarted_ready", node=node, pid=pid, num_ready=num_ready)
    if ctl.shape.swappable(ctl.layout):  # one replica: no rank can move onto a spare (regroup.py)
        group.start_regroup_spares()  # tp: a split group is mended at the first chance, spares kept or not
    if ctl.job.scaling.num_spares == 0:
        return
    lost = group.refresh_spares() + group.check_spares(ctl.job.failure.ping_timeout_s)
    lost += group.lost_spares
    group.lost_spares = []
    for node, pid, low in group.newly_ready:
        ctl.events.emit("spare_ready", node=node, pid=pid, num_ready=len(group.ready_spares), started_low=low)
    group.newly_ready.clear()
    for why in lost:
        ctl.events.emit("spare_lost", reason=why)
    if lost:
        refill = ctl.job.scaling.num_spares - group.num_spares()
        group.add_spares(refill, background=True, at=group.spare_homes(refill))
