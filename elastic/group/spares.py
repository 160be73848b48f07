"""The spare pool: workers started and warmed (model built, compute calibrated) before a rank
needs them, kept live, trimmed to the pool's size, and given ranks (`take_spare_for`, `promote`);
and the suspect nodes that no new worker may go to until they answer again.

`SparePool` is the base of `WorkerGroup` (elastic/group/worker_group.py): the controller asks the
group for its spares (`WorkerGroupProtocol` names them on the group), and a spare that takes a
rank becomes one of the group's members. How a pre-started worker claims a rank's slot is the
pool's own base, `PrestartedClaims` (elastic/group/prestart_claims.py); how spares and new workers fill
ranks, and where they go with tensor parallelism, `Replacing` (elastic/group/replacing.py), the
base between them. Mechanics only, as the group: the controller decides how many spares to keep
and when to use one.
"""
from __future__ import annotations

import time
from dataclasses import replace

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic.group.member import Member, gather, kill_member
from elastic.group.node_agent import NodeAgents
from elastic.group.prestart import PrestartPool, release_slot
from elastic.group.prestart_claims import CLAIM_POLL_S
from elastic.group.replacing import Replacing
from elastic.group.room import placing_node
from elastic.policies.placement import group_node, pick_spare
from elastic.protocol import LostCause, WorkerInfo
from elastic.runtime import priority
from elastic.runtime.actor import WorkerActor


@ray.remote(num_cpus=0, max_retries=0)
def _probe() -> bool:
    return True


class SparePool(Replacing):
    members: dict[int, Member]  # the group's ranks (set by WorkerGroup); a spare given a rank moves there

    def __init__(self, job, job_json: str, checkpoints_root: str, controller, runtime_env: dict | None):
        self.job, self.job_json, self.root = job, job_json, checkpoints_root
        self.controller = controller
        sc = job.scaling
        self._remote_worker = ray.remote(WorkerActor)
        self._actor_opts = dict(
            num_cpus=sc.cpus_per_worker, num_gpus=1 if sc.use_gpu else 0,
            max_concurrency=6,  # run() on one thread; poll, ping, abort and a buddy's copy on others
            max_restarts=0,  # the controller replaces workers; Ray must not resurrect a rank behind its back
            scheduling_strategy="SPREAD",
            runtime_env=runtime_env or None,
        )
        # One agent per node that hosts a member or a spare (elastic/group/node_agent.py).
        self.agents = NodeAgents(job.failure.heartbeat, runtime_env)
        # Spares: started and warmed (model built) before they are needed; not in the group.
        self._pending_spares: dict["ray.ObjectRef", "ray.actor.ActorHandle"] = {}
        self._on_demand: set["ray.ObjectRef"] = set()  # pending spares started by promote() itself
        self._background: set["ray.ObjectRef"] = set()  # pending spares started at low priority beside training
        self.ready_spares: list[Member] = []
        # (node, pid, started at low priority) of spares that became ready since the controller last looked
        self.newly_ready: list[tuple[str, int, bool]] = []
        self.lost_spares: list[str] = []  # why spares were lost inside a group operation, for the event log
        # Nodes that hosted a rank lost to silence (stopped, partitioned, dead). Ray may list such a
        # node as alive for a while; nothing new goes there until it answers again (see `probe_suspects`).
        self.suspect_nodes: set[str] = set()
        self.vacated: dict[int, str] = {}  # rank -> the node of its member killed since it was last filled
        self._probes: dict[str, "ray.ObjectRef"] = {}  # suspect node -> probe task in flight
        self._kept_off: dict["ray.ObjectRef", frozenset] = {}  # pending spare -> the suspect nodes it avoids
        # Pre-started workers (elastic/group/prestart.py): taken before a process is started on demand.
        self.prestart = PrestartPool(sc.prestarted_per_node, self._new_prestarted)
        self._waiting: list[tuple[object, object, float]] = []  # (worker, its claimed slot, since): slot not granted yet
        self._claims: dict["ray.ObjectRef", object] = {}  # pending spare (granted slot, building) -> its slot
        self.meant: dict["ray.ObjectRef", str] = {}  # pending spare -> the node it was started at (`at`)
        self.misplaced: set[str] = set()  # nodes a spare was started at but came up elsewhere (this promote)
        self.split_reasons: dict[int, str] = {}  # the last promote's: first rank of a tp group -> why it spans nodes

    def _new_actor(self, background: bool = False, node: str | None = None, prestarted: bool = False):
        """A new worker actor, never on a suspect node. `background`: it starts beside a training
        group, at the lowest CPU priority until it is built (see runtime/priority.py). `node`:
        there if it has room (a soft affinity), else where Ray's SPREAD puts it. `prestarted`: a
        pre-started worker (elastic/group/prestart.py), pinned to `node` and holding no CPU."""
        opts = dict(self._actor_opts)
        if prestarted:
            opts.update(num_cpus=0, num_gpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        elif node is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
        if background:
            env = dict(opts["runtime_env"] or {})
            env["env_vars"] = {**env.get("env_vars", {}), priority.BACKGROUND_ENV: "1"}
            opts["runtime_env"] = env
        if self.suspect_nodes and not prestarted:
            opts["label_selector"] = {"ray.io/node-id": f"!in({','.join(sorted(self.suspect_nodes))})"}
        return self._remote_worker.options(**opts).remote(self.job_json, self.root, self.controller)

    # ---------------------------------------------------------------- suspect nodes
    def suspect(self, node_id: str) -> None:
        if node_id not in self.suspect_nodes:
            self.suspect_nodes.add(node_id)
            self._restart_stranded(node_id)

    def _restart_stranded(self, node_id: str) -> None:
        """A pending spare whose placement waits on `node_id`, now suspect: Ray ties a pending
        actor to the node whose raylet it asked for a worker, and a request queued at a dead
        node's raylet waits there until Ray declares the node dead (13.7 s in a churn run, while
        a node with a free slot had joined 12 s before and the recovery waited on that spare).
        Started again, kept off the suspect nodes."""
        kept_off_it = {r for r, avoided in self._kept_off.items() if node_id in avoided}
        for ref in [r for r in self._pending_spares if r not in self._claims and r not in kept_off_it]:
            if placing_node(self._pending_spares[ref]) == node_id:
                self._restart(ref)
                self.lost_spares.append(f"spare waiting for a worker on suspect node {node_id[:12]}: started again "
                                        f"elsewhere")

    def probe_suspects(self) -> list[str]:
        """Clear suspect nodes that answer again (a thawed machine, a healed partition) or that Ray
        has declared dead (it schedules nothing there anyway). Never waits: a probe stays in flight
        until its node answers. Returns the cleared ones."""
        if not self.suspect_nodes:
            return []
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        cleared = {n for n in self.suspect_nodes if n not in alive}
        for n in self.suspect_nodes - cleared - set(self._probes):
            self._probes[n] = _probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
        if self._probes:
            ready, _ = ray.wait(list(self._probes.values()), num_returns=len(self._probes), timeout=0)
            cleared |= {n for n, ref in self._probes.items() if ref in ready}
        for n in cleared:
            self._probes.pop(n, None)
        self.suspect_nodes -= cleared
        if cleared:
            self._restart_kept_off(cleared)
        return sorted(cleared)

    def _restart_kept_off(self, cleared: set[str]) -> None:
        """Spares still waiting for a slot, kept off a node that is now cleared, may wait forever
        when that node's slot is the only free one (a stopped process on a full cluster): start
        them again, free to go there."""
        for ref, avoided in list(self._kept_off.items()):
            if ref in self._pending_spares and avoided & cleared:
                self._restart(ref)

    def _restart(self, ref: "ray.ObjectRef") -> None:
        """Kill a pending spare and start another like it, placed under the suspect nodes now."""
        h = self._pending_spares.pop(ref)
        self.meant.pop(ref, None)
        on_demand, background = ref in self._on_demand, ref in self._background
        self._on_demand.discard(ref)
        self._background.discard(ref)
        self._kept_off.pop(ref, None)
        ray.kill(h, no_restart=True)
        self.add_spares(1, on_demand=on_demand, background=background)

    # ---------------------------------------------------------------- the pool
    def add_spares(self, n: int, on_demand: bool = False, background: bool = False,
                   calibrate: bool | None = None, near: tuple[str, ...] = (), at: tuple[str, ...] = ()) -> None:
        """Start n spare workers in the background; they warm up (build the model) on their own.
        `on_demand`: wanted by a recovery in progress (no calibration). `background`: refilling the
        pool while the group trains; they start at the lowest CPU priority, so that on CPUs they
        share with training ranks they take only what training leaves. `calibrate`: time a rank's
        compute before the spare counts as ready (default: unless on demand); one left
        uncalibrated is calibrated when a straggler decision first weighs it (calibrate_spares).
        On demand, pre-started workers are taken first (`near`: the nodes whose slots were just
        freed, tried first); processes are started only for the rest. `at`: the nodes the first
        processes started belong on (a soft affinity: Ray waits for a slot there while the node
        lives). With tensor parallelism and no `at`, processes started on demand go to the `near`
        nodes: a dead process's slot is its tp group's (placed by SPREAD, the first replacement of
        a process kill landed on another node and took the rank before the one started beside the
        group: 1 of 2 runs in issue 55); with no `near` either (a node lost), a tp group's worth to
        a node (`spare_homes`), so a group lost whole finds them together."""
        if on_demand:
            got = self._take_prestarted(n, near or at)
            n -= got
            if not at and n > 0 and self.job.train.tp.size > 1:
                at = near[got:] or self.spare_homes(n)  # pre-started ones claim the `near` slots first
        low = background and not on_demand and self.job.scaling.low_priority_refills
        calibrate = not on_demand if calibrate is None else calibrate
        for i in range(max(0, n)):
            h = self._new_actor(background=low, node=at[i] if i < len(at) else None)
            ref = h.warm.remote(calibrate=calibrate)
            self._pending_spares[ref] = h
            if i < len(at):
                self.meant[ref] = at[i]
            self._kept_off[ref] = frozenset(self.suspect_nodes)
            if on_demand:
                self._on_demand.add(ref)
            if low:
                self._background.add(ref)

    def wait_spares_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._pending_spares and time.monotonic() < deadline:
            self.refresh_spares(wait_s=min(0.5, max(0.0, deadline - time.monotonic())))
        return not self._pending_spares

    def num_spares(self) -> int:
        return len(self.ready_spares) + len(self._pending_spares) + len(self._waiting)

    def refresh_spares(self, wait_s: float = 0.0) -> list[str]:
        """Move spares that finished warming to the ready list; returns why any were lost."""
        lost: list[str] = self._advance_claims() if self._waiting else []
        if self._waiting:  # a slot may be granted any moment: look again soon
            wait_s = min(wait_s, CLAIM_POLL_S)
        if not self._pending_spares:
            return lost
        ready, _ = ray.wait(list(self._pending_spares), num_returns=len(self._pending_spares), timeout=wait_s)
        for ref in ready:
            h = self._pending_spares.pop(ref)
            self._kept_off.pop(ref, None)
            meant = self.meant.pop(ref, None)
            on_demand = ref in self._on_demand
            self._on_demand.discard(ref)
            self._background.discard(ref)
            slot = self._claims.pop(ref, None)
            try:
                info: WorkerInfo = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a spare that died while warming is just gone
                lost.append(f"spare died while warming: {type(e).__name__}")
                ray.kill(h, no_restart=True)
                if slot is not None:
                    release_slot(slot)
                continue
            if meant is not None and meant != info.node_id:
                self.misplaced.add(meant)  # Ray's soft affinity let it go: that node is gone or cannot hold it
            self.ready_spares.append(Member(-1, h, info.node_id, info.ip, info.pid, info.calib_s, on_demand,
                                            prestarted=slot is not None, slot=slot))
            self.agents.ensure(info.node_id)  # up before the spare takes a rank there
            self.newly_ready.append((info.node_id[:12], info.pid, info.started_low))
        return lost

    def check_spares(self, timeout_s: float) -> list[str]:
        """Ping ready spares; drop (and report) the ones that are dead or silent."""
        if not self.ready_spares:
            return []
        _, bad = gather({i: m.handle.ping.remote() for i, m in enumerate(self.ready_spares)}, timeout_s)
        return self._drop_spares(bad)

    def _drop_spares(self, bad: dict[int, str], when: str = "") -> list[str]:
        """Kill the ready spares at these indices; why each was lost, for the event log."""
        lost = []
        for i in sorted(bad, reverse=True):
            m = self.ready_spares.pop(i)
            kill_member(m)
            lost.append(f"spare on node {m.node_id[:12]} {bad[i]}{when}")
        return lost

    def trim_spares(self, keep: int, regroup: bool = True) -> None:
        """Kill spares until `keep` are left, the last started first; those that can gather a tp
        group split over nodes (`regroup_guard`) stay beyond `keep` (`regroup`: False at shutdown)."""
        guard = self.regroup_guard() if regroup else set()
        while self.num_spares() > keep:
            ref = next((r for r in reversed(self._pending_spares) if id(r) not in guard), None)
            spare = next((m for m in reversed(self.ready_spares) if id(m) not in guard), None)
            if self._waiting:
                h, slot, _ = self._waiting.pop()
                release_slot(slot)
                ray.kill(h, no_restart=True)
            elif ref is not None:
                h = self._pending_spares.pop(ref)
                self._kept_off.pop(ref, None)
                self.meant.pop(ref, None)
                if ref in self._claims:
                    release_slot(self._claims.pop(ref))
                self._on_demand.discard(ref)
                self._background.discard(ref)
                ray.kill(h, no_restart=True)
            elif spare is not None:
                self.ready_spares.remove(spare)
                kill_member(spare)
            else:
                break

    def calibrate_spares(self, timeout_s: float) -> list[str]:
        """Calibrate the ready spares that were not (started on demand, kept afterwards), so a
        straggler decision weighs every spare; drop (and report) the ones that do not answer."""
        todo = {i: m for i, m in enumerate(self.ready_spares) if m.calib_s is None}
        if not todo or self.job.train.strategy == "pipeline":  # a pipeline stage cannot calibrate alone
            return []
        out, bad = gather({i: m.handle.calibrate.remote() for i, m in todo.items()}, timeout_s)
        for i, calib_s in out.items():
            todo[i].calib_s = calib_s
        return self._drop_spares(bad, " when calibrated")

    # ---------------------------------------------------------------- spares take ranks
    def take_spare_for(self, rank: int, max_calib_s: float, ping_timeout_s: float,
                       home: str | None = None) -> Member | None:
        """Give `rank` to the fastest live ready spare whose calibration is at most max_calib_s;
        on `home` first, by default its tp group's node (policies/placement.py)."""
        self.refresh_spares()
        if home is None:
            home = group_node(rank, self.job.train.tp.size, {r: m.node_id for r, m in self.members.items()})
        while True:
            i = pick_spare([(m.node_id, m.calib_s) for m in self.ready_spares], max_calib_s, home)
            if i is None:
                return None
            m = self.ready_spares[i]
            if self._spare_alive(m, ping_timeout_s):
                self._assign(rank, m)
                return m

    def _spare_alive(self, m: Member, ping_timeout_s: float) -> bool:
        """A spare is pinged before it gets a rank: one that died or went silent since it warmed
        (its node stopped) would otherwise block the next rendezvous. A dead one is dropped."""
        _, bad = gather({0: m.handle.ping.remote()}, ping_timeout_s)
        if not bad:
            return True
        self.ready_spares.remove(m)
        kill_member(m)
        if bad[0] != LostCause.PROCESS_DIED:
            self.suspect(m.node_id)
        self.lost_spares.append(f"spare on node {m.node_id[:12]} {bad[0]} when it was to take a rank")
        return False

    def _assign(self, rank: int, spare: Member) -> None:
        self.ready_spares.remove(spare)
        self.members[rank] = replace(spare, rank=rank, on_demand=False)
