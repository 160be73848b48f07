"""Placement, ranks and process-group (re)formation for a set of worker actors.

The group does mechanics only (start, form, restore, run, poll, kill), each
with a timeout; it never decides what to do about a failure.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, replace

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic.runtime import priority
from elastic.runtime.heartbeat import Heartbeats
from elastic.policies.failure import formation_silent
from elastic.runtime.worker import Worker


class GroupError(RuntimeError):
    """A group operation failed. `ranks` are the ranks that did not answer or died."""

    def __init__(self, msg: str, ranks: dict[int, str]):
        super().__init__(msg)
        self.ranks = ranks


@dataclass
class Member:
    rank: int
    handle: "ray.actor.ActorHandle"
    node_id: str
    ip: str
    pid: int
    calib_s: float | None = None  # spares: measured compute time of one rank's share of a step
    on_demand: bool = False  # spares: started for a recovery in progress, not ahead of time
    hb_port: int | None = None  # its heartbeat sidecar's UDP port on `ip` (elastic/heartbeat.py); None: none


def cause_of(why: str) -> str:
    """A rank's reason reduced to its cause: gone (node_died, process_died, unreachable),
    silent (unresponsive), or alive but failed ("error")."""
    return why if why in ("node_died", "process_died", "unreachable", "unresponsive") else "error"


def short_reason(e: BaseException) -> str:
    if isinstance(e, ActorUnavailableError):
        return "RPC socket closed"
    return str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__


def death_cause(e: BaseException) -> str:
    if isinstance(e, ActorUnavailableError):
        return "unreachable"  # its RPC socket closed: the process, or the whole node, is gone
    text = str(e).lower()
    # Ray words node loss as "...because its node has died" / "node ... is dead".
    if "its node has died" in text or "node has died" in text or "because its node" in text:
        return "node_died"
    return "process_died"


@ray.remote(num_cpus=0, max_retries=0)
def _probe() -> bool:
    return True


@ray.remote(num_cpus=0)
def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class WorkerGroup:
    def __init__(self, job, job_json: str, checkpoints_root: str, controller, runtime_env: dict | None):
        self.job, self.job_json, self.root = job, job_json, checkpoints_root
        self.controller = controller
        sc = job.scaling
        self._remote_worker = ray.remote(Worker)
        self._actor_opts = dict(
            num_cpus=sc.cpus_per_worker, num_gpus=1 if sc.use_gpu else 0,
            max_concurrency=4,  # run() on one thread; poll, ping and abort answer on others
            max_restarts=0,  # the controller replaces workers; Ray must not resurrect a rank behind its back
            scheduling_strategy="SPREAD",
            runtime_env=runtime_env or None,
        )
        self.members: dict[int, Member] = {}
        self._polls: dict[int, tuple["ray.ObjectRef", float]] = {}  # rank -> (poll in flight, sent at)
        self.heartbeats = Heartbeats()
        self.slowest_poll_answer_s = 0.0  # the longest a poll waited for its answer (the silence margin)
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
        self._probes: dict[str, "ray.ObjectRef"] = {}  # suspect node -> probe task in flight
        self._kept_off: dict["ray.ObjectRef", frozenset] = {}  # pending spare -> the suspect nodes it avoids
        self._kept_by: dict[int, tuple[str, int]] = {}  # old part -> (node, pid) of the member keeping it

    def _new_actor(self, background: bool = False):
        """A new worker actor, never on a suspect node. `background`: it starts beside a training
        group, at the lowest CPU priority until it is built (see elastic/priority.py)."""
        opts = dict(self._actor_opts)
        if background:
            env = dict(opts["runtime_env"] or {})
            env["env_vars"] = {**env.get("env_vars", {}), priority.BACKGROUND_ENV: "1"}
            opts["runtime_env"] = env
        if self.suspect_nodes:
            opts["label_selector"] = {"ray.io/node-id": f"!in({','.join(sorted(self.suspect_nodes))})"}
        return self._remote_worker.options(**opts).remote(self.job_json, self.root, self.controller)

    def suspect(self, node_id: str) -> None:
        self.suspect_nodes.add(node_id)

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
                h = self._pending_spares.pop(ref)
                on_demand, background = ref in self._on_demand, ref in self._background
                self._on_demand.discard(ref)
                self._background.discard(ref)
                self._kept_off.pop(ref)
                ray.kill(h, no_restart=True)
                self.add_spares(1, on_demand=on_demand, background=background)

    # ---------------------------------------------------------------- start
    def start(self, ranks: list[int], timeout_s: float) -> None:
        """Start one worker per rank and wait until each has built its dataset and answered.
        On failure, the ones that did start are kept only if all did (a half-done start is undone)."""
        handles = {r: self._new_actor() for r in ranks}
        refs = {r: h.info.remote() for r, h in handles.items()}
        infos, bad = self._gather(refs, timeout_s)
        if bad:
            for h in handles.values():
                ray.kill(h, no_restart=True)
            raise GroupError(f"could not start workers for ranks {sorted(bad)} within {timeout_s:.0f}s: "
                             f"{bad}; is there a free slot ({self.job.scaling.cpus_per_worker} CPU) per worker?", bad)
        for r, info in infos.items():
            self.members[r] = Member(r, handles[r], info["node_id"], info["ip"], info["pid"],
                                     hb_port=info.get("hb_port"))

    # ---------------------------------------------------------------- spares
    def add_spares(self, n: int, on_demand: bool = False, background: bool = False,
                   calibrate: bool | None = None) -> None:
        """Start n spare workers in the background; they warm up (build the model) on their own.
        `on_demand`: wanted by a recovery in progress (no calibration). `background`: refilling the
        pool while the group trains; they start at the lowest CPU priority, so that on CPUs they
        share with training ranks they take only what training leaves. `calibrate`: time a rank's
        compute before the spare counts as ready (default: unless on demand); one left
        uncalibrated is calibrated when a straggler decision first weighs it (calibrate_spares)."""
        low = background and not on_demand and self.job.scaling.low_priority_refills
        calibrate = not on_demand if calibrate is None else calibrate
        for _ in range(max(0, n)):
            h = self._new_actor(background=low)
            ref = h.warm.remote(calibrate=calibrate)
            self._pending_spares[ref] = h
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
        return len(self.ready_spares) + len(self._pending_spares)

    def refresh_spares(self, wait_s: float = 0.0) -> list[str]:
        """Move spares that finished warming to the ready list; returns why any were lost."""
        lost: list[str] = []
        if not self._pending_spares:
            return lost
        ready, _ = ray.wait(list(self._pending_spares), num_returns=len(self._pending_spares), timeout=wait_s)
        for ref in ready:
            h = self._pending_spares.pop(ref)
            self._kept_off.pop(ref, None)
            on_demand = ref in self._on_demand
            self._on_demand.discard(ref)
            self._background.discard(ref)
            try:
                info = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a spare that died while warming is just gone
                lost.append(f"spare died while warming: {type(e).__name__}")
                ray.kill(h, no_restart=True)
                continue
            self.ready_spares.append(Member(-1, h, info["node_id"], info["ip"], info["pid"], info.get("calib_s"),
                                            on_demand, info.get("hb_port")))
            self.newly_ready.append((info["node_id"][:12], info["pid"], bool(info.get("started_low"))))
        return lost

    def check_spares(self, timeout_s: float) -> list[str]:
        """Ping ready spares; drop (and report) the ones that are dead or silent."""
        if not self.ready_spares:
            return []
        _, bad = self._gather({i: m.handle.ping.remote() for i, m in enumerate(self.ready_spares)}, timeout_s)
        return self._drop_spares(bad)

    def _drop_spares(self, bad: dict[int, str], when: str = "") -> list[str]:
        """Kill the ready spares at these indices; why each was lost, for the event log."""
        lost = []
        for i in sorted(bad, reverse=True):
            m = self.ready_spares.pop(i)
            self._kill_member(m)
            lost.append(f"spare on node {m.node_id[:12]} {bad[i]}{when}")
        return lost

    def trim_spares(self, keep: int) -> None:
        while self.num_spares() > keep:
            if self._pending_spares:
                ref, h = self._pending_spares.popitem()
                self._kept_off.pop(ref, None)
                self._on_demand.discard(ref)
                self._background.discard(ref)
                ray.kill(h, no_restart=True)
            else:
                self._kill_member(self.ready_spares.pop())

    def request_stop(self, generation: int, timeout_s: float) -> dict[int, int]:
        out, bad = self._gather({r: m.handle.request_stop.remote(generation) for r, m in self.members.items()},
                                timeout_s)
        if bad:
            raise GroupError(f"request_stop failed for ranks {sorted(bad)}: {bad}", bad)
        return out

    def calibrate_spares(self, timeout_s: float) -> list[str]:
        """Calibrate the ready spares that were not (started on demand, kept afterwards), so a
        straggler decision weighs every spare; drop (and report) the ones that do not answer."""
        todo = {i: m for i, m in enumerate(self.ready_spares) if m.calib_s is None}
        if not todo or self.job.train.strategy == "pipeline":  # a pipeline stage cannot calibrate alone
            return []
        out, bad = self._gather({i: m.handle.calibrate.remote() for i, m in todo.items()}, timeout_s)
        for i, calib_s in out.items():
            todo[i].calib_s = calib_s
        return self._drop_spares(bad, " when calibrated")

    def take_spare_for(self, rank: int, max_calib_s: float, ping_timeout_s: float) -> Member | None:
        """Give `rank` to the fastest live ready spare whose calibration is at most max_calib_s."""
        self.refresh_spares()
        while True:
            ok = [m for m in self.ready_spares if m.calib_s is not None and m.calib_s <= max_calib_s]
            if not ok:
                return None
            m = min(ok, key=lambda m: m.calib_s)
            if self._spare_alive(m, ping_timeout_s):
                self._assign(rank, m)
                return m

    def _spare_alive(self, m: Member, ping_timeout_s: float) -> bool:
        """A spare is pinged before it gets a rank: one that died or went silent since it warmed
        (its node stopped) would otherwise block the next rendezvous. A dead one is dropped."""
        _, bad = self._gather({0: m.handle.ping.remote()}, ping_timeout_s)
        if not bad:
            return True
        self.ready_spares.remove(m)
        self._kill_member(m)
        if bad[0] != "process_died":
            self.suspect(m.node_id)
        self.lost_spares.append(f"spare on node {m.node_id[:12]} {bad[0]} when it was to take a rank")
        return False

    def renumber(self, mapping: dict[int, int] | None = None) -> dict[int, int]:
        """After a shrink: ranks 0..k-1 for the k members, in their old order, or as `mapping`
        (old -> new) says; members it leaves out are killed. Returns old -> new."""
        mapping = mapping if mapping is not None else {old: new for new, old in enumerate(sorted(self.members))}
        for o in [o for o in self.members if o not in mapping]:
            self.kill(o)
        self.members = {mapping[o]: replace(m, rank=mapping[o]) for o, m in self.members.items()}
        self._polls.clear()
        return mapping

    def _assign(self, rank: int, spare: Member) -> None:
        self.ready_spares.remove(spare)
        self.members[rank] = replace(spare, rank=rank, on_demand=False)

    def promote(self, ranks: list[int], timeout_s: float, ping_timeout_s: float) -> dict[int, str]:
        """Fill `ranks` with spares: live warm ones first, then ones still warming (waited for), then
        freshly started workers. A spare that dies or goes silent before it gets its rank is
        replaced in turn, until `timeout_s` runs out. Returns {rank: how it was filled}."""
        how: dict[int, str] = {}
        need = list(ranks)
        deadline = time.monotonic() + timeout_s

        def take_ready(label_if_planned: str) -> None:
            for m in list(self.ready_spares):
                if not need:
                    return
                if not self._spare_alive(m, ping_timeout_s):
                    continue
                r = need.pop(0)
                self._assign(r, m)
                how[r] = "started on demand" if m.on_demand else label_if_planned

        self.lost_spares.extend(self.refresh_spares())
        take_ready("warm spare")
        if need:
            # A spare still warming at low priority is now wanted: it finishes at full priority
            # (the call runs once its constructor has, beside warm()).
            for ref in self._background:
                self._pending_spares[ref].restore_priority.remote()
        while need and time.monotonic() < deadline:
            # Keep one warming spare per missing rank: a replacement that died (its node was lost
            # too, or not yet known to be lost) is replaced in turn, never waited on forever.
            self.add_spares(len(need) - len(self._pending_spares), on_demand=True)
            self.probe_suspects()  # a node that answers again may hold the only free slot
            self.lost_spares.extend(self.refresh_spares(wait_s=min(0.5, max(0.0, deadline - time.monotonic()))))
            take_ready("spare, waited while it warmed")
        if need:
            raise GroupError(f"no worker could be started for ranks {need} within {timeout_s:.0f}s; is there a free "
                             f"slot ({self.job.scaling.cpus_per_worker} CPU) per worker?", {r: "unavailable" for r in need})
        return how

    # ---------------------------------------------------------------- form / restore / run
    def form(self, generation: int, timeout_s: float, ping_timeout_s: float, pp: int = 1) -> float:
        """A fresh rendezvous (new port, so a fresh store) for the current members, as group
        `generation`. A member that dies or stops answering fails the formation at once: the
        others' joins are aborted, and they come back with their state as survivors (a join
        that failed because of a peer is the peer's failure, reported as "peer failed").
        "Stops answering" is `formation_silent`'s verdict on its unanswered ping and its heartbeat.
        Returns the slowest ping answer seen (seconds), for the group_formed event."""
        world = len(self.members)
        assert sorted(self.members) == list(range(world)), f"ranks must be 0..{world - 1}: {sorted(self.members)}"
        m0 = self.members[0]
        port, bad = self._gather({0: m0.handle.free_port.remote()}, ping_timeout_s * 5)
        if bad:
            raise GroupError(f"rank 0 did not give a rendezvous port: {bad}", bad)
        refs = {r: m.handle.join.remote(m0.ip, port[0], r, world, generation, pp) for r, m in self.members.items()}
        pending = {ref: r for r, ref in refs.items()}
        bad: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        polls: dict[int, tuple] = {}
        slowest = 0.0
        while pending and time.monotonic() < deadline:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.2)
            for ref in ready:
                r = pending.pop(ref)
                try:
                    ray.get(ref)
                except RayActorError as e:
                    bad[r] = death_cause(e)
                except Exception as e:  # noqa: BLE001 - join raised: a peer failed, or the rendezvous timed out
                    bad[r] = f"error: {type(e).__name__}: {str(e)[:300]}"
            # A member that stops answering (its machine stopped) would hold everyone for the whole
            # rendezvous timeout: watch them all, as the run loop does.
            now = time.monotonic()
            beats = self.beats() if self.job.failure.heartbeat else {}
            for r, m in self.members.items():
                if r in bad or r not in {*pending.values()}:
                    continue
                ref_sent = polls.get(r)
                if ref_sent is None:
                    polls[r] = (m.handle.ping.remote(), now)
                    continue
                done, _ = ray.wait([ref_sent[0]], timeout=0)
                if done:
                    try:
                        ray.get(done[0])
                        polls.pop(r)
                        slowest = max(slowest, now - ref_sent[1])
                    except RayActorError as e:
                        bad[r] = death_cause(e)
                elif formation_silent(now - ref_sent[1], beats.get(r), ping_timeout_s):
                    bad[r] = "unresponsive"
            if any(cause_of(w) != "error" for w in bad.values()):
                break  # someone is gone: the rest cannot complete; cut their rendezvous
        if pending and bad:
            self.abort_all(generation, ping_timeout_s * 3, only=[r for r in pending.values() if r not in bad])
            late, _ = ray.wait(list(pending), num_returns=len(pending), timeout=ping_timeout_s * 5)
            for ref in late:
                r = pending.pop(ref)
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - expected: its rendezvous was cut
                    pass
                bad.setdefault(r, "error: peer failed during formation")
        for r in pending.values():
            bad.setdefault(r, "unresponsive")
        if bad:
            raise GroupError(f"process group formation failed for ranks {sorted(bad)}: {bad}", bad)
        return slowest

    def abort_all(self, generation: int, timeout_s: float, only: list[int] | None = None) -> dict[int, str]:
        """Ask members (all, or `only`) to abort their collectives of `generation` (answered on
        another actor thread while run() or join() is blocked). Returns {rank: why} for those
        that did not answer."""
        ranks = self.members if only is None else only
        _, bad = self._gather({r: self.members[r].handle.abort.remote(generation) for r in ranks
                               if r in self.members}, timeout_s)
        return bad

    def restore(self, candidates: list[str], timeout_s: float) -> dict[int, dict]:
        return self._all("restore", timeout_s, candidates)

    def restore_from_peer(self, src_rank: int, timeout_s: float, stage_sources: tuple[int, ...] = ()) -> dict[int, dict]:
        return self._all("restore_from_peer", timeout_s, src_rank, list(stage_sources))

    def restore_from_shards(self, offers: dict[int, "ray.ObjectRef"], old_world: int,
                            timeout_s: float, old_pp: int = 1) -> dict[int, dict]:
        # Parts kept by a process that is a member again move rank to rank: old part -> its new rank.
        where = {(m.node_id, m.pid): r for r, m in self.members.items()}
        holders = {p: where.get(key) for p, key in self._kept_by.items()}
        self._kept_by = {}
        if None in holders.values():
            gone = sorted(p for p, r in holders.items() if r is None)
            raise GroupError(f"old parts {gone} were kept by ranks that are not in the new group", {})
        # Refs nested in a list reach the workers as refs: each fetches only the parts it needs.
        return self._all("restore_from_shards", timeout_s, [offers[p] for p in range(old_world)], old_world, old_pp,
                         holders)

    def offer_shards(self, timeout_s: float, keep: frozenset[int] = frozenset()
                     ) -> tuple[dict[int, "ray.ObjectRef"], list[int]]:
        """Every member's part of the state. Ranks in `keep` (they stay in the new group) keep
        theirs in memory and send it rank to rank at the restore; the others' are object refs
        owned by this (the controller's) process: the bytes stay in each member's node store and
        outlive the member's process. Returns (refs by rank, ranks whose offer was not ready in
        time). An offer that failed is ready too; its error surfaces when a receiver reads it,
        and that restore fails."""
        self._kept_by = {r: (m.node_id, m.pid) for r, m in self.members.items() if r in keep}
        refs = {r: m.handle.offer_shards.remote(publish=r not in keep) for r, m in self.members.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s, fetch_local=False)
        ready = set(ready)
        late = [r for r, ref in refs.items() if ref not in ready]
        return refs, late

    def _all(self, method: str, timeout_s: float, *args) -> dict[int, dict]:
        refs = {r: getattr(m.handle, method).remote(*args) for r, m in self.members.items()}
        out, bad = self._gather(refs, timeout_s)
        if bad:
            raise GroupError(f"{method} failed for ranks {sorted(bad)}: {bad}", bad)
        return out

    @staticmethod
    def collect_runs(refs: dict[int, "ray.ObjectRef"], timeout_s: float) -> tuple[dict[int, dict], dict[int, tuple]]:
        """The run() calls in `refs` that returned within `timeout_s` (removed from `refs`):
        ({rank: result}, {rank: (cause, detail)} for ranks whose actor died)."""
        if not refs:
            time.sleep(timeout_s)
            return {}, {}
        by_ref = {ref: r for r, ref in refs.items()}
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=timeout_s)
        results, died = {}, {}
        for ref in ready:
            rank = by_ref[ref]
            del refs[rank]
            try:
                results[rank] = ray.get(ref)
            except RayActorError as e:
                died[rank] = (death_cause(e), short_reason(e))
        return results, died

    def run(self, num_steps: int, faults: list[dict], skip_steps: list[int] = ()) -> dict[int, "ray.ObjectRef"]:
        self._polls.clear()  # an answer to a poll sent before a recovery describes the old group
        return {r: m.handle.run.remote(num_steps, faults, list(skip_steps)) for r, m in self.members.items()}

    def drain_polls(self, timeout_s: float) -> dict[int, dict]:
        """Answers of the polls still in flight (they may carry the last persist reports)."""
        refs = {r: ref for r, (ref, _) in self._polls.items()}
        self._polls.clear()
        return self._gather(refs, timeout_s)[0]

    def poll_nowait(self, ping_timeout_s: float) -> tuple[dict[int, dict], dict[int, str]]:
        """Non-blocking poll for the run loop. Each member has at most one poll in flight; returns
        the answers that arrived, and {rank: why} for members that died or whose poll has been
        unanswered for longer than ping_timeout_s. A dead rank never blocks the loop."""
        now = time.monotonic()
        for r, m in self.members.items():
            if r not in self._polls:
                self._polls[r] = (m.handle.poll.remote(), now)
        self._polls = {r: v for r, v in self._polls.items() if r in self.members}
        refs = {v[0]: r for r, v in self._polls.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        answers, silent = {}, {}
        for ref in ready:
            r = refs[ref]
            _, sent = self._polls.pop(r)
            try:
                answers[r] = ray.get(ref)
                self.slowest_poll_answer_s = max(self.slowest_poll_answer_s, now - sent)
            except RayActorError as e:
                silent[r] = death_cause(e)
            except Exception as e:  # noqa: BLE001
                silent[r] = f"error: {type(e).__name__}: {str(e)[:200]}"
        for r, (ref, sent) in self._polls.items():
            if now - sent > ping_timeout_s:
                silent[r] = "unresponsive"
        return answers, silent

    def unanswered_s(self) -> dict[int, float]:
        """For each member with a poll in flight, how long ago it was sent: since its last answer,
        within one run-loop iteration (the next poll goes out as soon as an answer is taken)."""
        now = time.monotonic()
        return {r: now - sent for r, (_, sent) in self._polls.items()}

    def beats(self) -> dict:
        """{rank: Beat} from the members' heartbeat sidecars (elastic/heartbeat.py), pinging them
        as due; a rank whose sidecar never answered is left out."""
        self.heartbeats.watch({r: (m.ip, m.hb_port) for r, m in self.members.items() if m.hb_port})
        self.heartbeats.tick()
        return self.heartbeats.beats()

    def poll(self, timeout_s: float) -> tuple[dict[int, dict], dict[int, str]]:
        """(answers by rank, {rank: why not} for those that died or did not answer in time)."""
        return self._gather({r: m.handle.poll.remote() for r, m in self.members.items()}, timeout_s)

    # ---------------------------------------------------------------- teardown
    def kill(self, rank: int) -> None:
        """Kill a member for sure: ray.kill, plus a SIGKILL by pid from its own node, which also
        ends a stopped (SIGSTOP) process whose Ray core worker cannot act on a kill request.
        Fire and forget: on a dead node the second part never runs, and need not."""
        m = self.members.pop(rank, None)
        self._polls.pop(rank, None)
        if m is not None:
            self._kill_member(m)

    def _kill_member(self, m: Member) -> None:
        ray.kill(m.handle, no_restart=True)
        _sigkill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(m.node_id, soft=False)).remote(m.pid)

    def wait_runs(self, refs: dict[int, "ray.ObjectRef"], timeout_s: float) -> dict[int, str]:
        """Wait for members' run() calls to return; {rank: why} for those that did not."""
        live = {r: ref for r, ref in refs.items() if r in self.members}
        _, bad = self._gather(live, timeout_s)
        return bad

    def save_again(self, timeout_s: float) -> dict[int, str]:
        """Every member saves its final state again and waits for the persist; {rank: why} for
        those that did not return within timeout_s."""
        _, bad = self._gather({r: m.handle.save_again.remote() for r, m in self.members.items()}, timeout_s)
        return bad

    def leave_all(self, timeout_s: float) -> dict[int, str]:
        """Ask every member to drop its process group; returns the ranks that could not."""
        _, bad = self._gather({r: m.handle.leave.remote() for r, m in self.members.items()}, timeout_s)
        return bad

    def shutdown(self) -> None:
        for r in list(self.members):
            self.kill(r)
        self.trim_spares(0)

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _gather(refs: dict[int, "ray.ObjectRef"], timeout_s: float) -> tuple[dict[int, object], dict[int, str]]:
        """Results by rank, and {rank: reason} for errors and timeouts, waiting at most timeout_s in all."""
        deadline = time.monotonic() + timeout_s
        ok, bad = {}, {}
        for r, ref in refs.items():
            try:
                ok[r] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except GetTimeoutError:
                bad[r] = "unresponsive"
            except RayActorError as e:
                bad[r] = death_cause(e)
            except Exception as e:  # noqa: BLE001 - a worker method raised
                bad[r] = f"error: {type(e).__name__}: {str(e)[:300]}"
        return ok, bad
