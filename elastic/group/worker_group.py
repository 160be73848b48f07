"""Placement, ranks and process-group (re)formation for a set of worker actors.

The group does mechanics only (start, form, restore, run, poll, kill), each
with a timeout; it never decides what to do about a failure. Its spares and suspect
nodes are elastic/group/spares.py's (`SparePool`, its base); what it knows of each
member and how it reads a failed call, elastic/group/member.py's. The workers answer
with the typed messages of elastic/protocol.py, passed on to the controller as they are.
"""
from __future__ import annotations

import time
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import replace

import ray
from ray.exceptions import RayActorError

from elastic.group.rendezvous import Rendezvous
from elastic.group.member import (GroupError, Member, Members, cause_of, death_cause, gather, gather_watched,
                                  kill_member, short_reason)
from elastic.group.room import free_cpus_by_node
from elastic.group.spares import SparePool
from elastic.policies.failure import formation_silent
from elastic.policies.placement import Placement, place_tp_groups
from elastic.protocol import AbortResult, LostCause, PollReport, RestoreResult, RunResult, Watch
from elastic.runtime.pinger import PingerProcess

AGENT_UP_S = 10.0  # the longest a start waits for its nodes' agents (else its ranks are polled directly)

__all__ = ["WorkerGroup", "GroupError", "Member", "cause_of"]


class WorkerGroup(SparePool):
    def __init__(self, job, job_json: str, checkpoints_root: str, controller, runtime_env: dict | None):
        super().__init__(job, job_json, checkpoints_root, controller, runtime_env)
        self.members = Members()
        self._polls: dict[int, tuple["ray.ObjectRef", float]] = {}  # rank -> (poll in flight, sent at)
        self.heartbeats: PingerProcess | None = None  # started at the first `beats()`
        self.slowest_poll_answer_s = 0.0  # the longest a poll waited for its answer (the silence margin)
        self.direct_polls = 0  # polls sent to ranks themselves (their node's agent not up yet)
        self._kept_by: dict[int, tuple[str, int]] = {}  # old part -> (node, pid) of the member keeping it
        # Started in the background once the first workers are asked for (`start`), not before:
        # its torch import holds the GIL, and the first actor creation (Ray exports the class)
        # waited 1.9 s behind it, on every run's start.
        self.rendezvous = Rendezvous(ray.util.get_node_ip_address(), job.failure.rendezvous_timeout_s)
        self.placement: Placement | None = None  # of the first start, with tensor parallelism

    @property
    def members(self) -> Members:
        return self._members

    @members.setter
    def members(self, value: dict) -> None:
        self._members = value if isinstance(value, Members) else Members(value)

    # ---------------------------------------------------------------- start
    def start(self, ranks: list[int], timeout_s: float) -> None:
        """Start one worker per rank and wait until each has built its dataset and answered.
        On failure, the ones that did start are kept only if all did (a half-done start is undone).
        With tensor parallelism each tp group starts on one node where one holds it
        (elastic/policies/placement.py; `self.placement` says where, for the event log)."""
        tp = self.job.train.tp.size
        self.placement = None
        self.agents.start_where_workers_fit(self.job.scaling.cpus_per_worker, self.job.scaling.use_gpu)
        if tp > 1:
            self.placement = place_tp_groups(ranks, tp, free_cpus_by_node(), self.job.scaling.cpus_per_worker)
        handles = {r: self._new_actor(node=self.placement.nodes.get(r)) for r in ranks} if self.placement else \
            {r: self._new_actor() for r in ranks}
        self.rendezvous.start_in_background()  # while the workers start (a no-op once started)
        refs = {r: h.info.remote() for r, h in handles.items()}
        infos, bad = gather(refs, timeout_s)
        if bad:
            for h in handles.values():
                ray.kill(h, no_restart=True)
            raise GroupError(f"could not start workers for ranks {sorted(bad)} within {timeout_s:.0f}s: "
                             f"{bad}; is there a free slot ({self.job.scaling.cpus_per_worker} CPU) per worker?", bad)
        for r, info in infos.items():
            self.members[r] = Member(r, handles[r], info.node_id, info.ip, info.pid)
        # Their nodes' agents, started before the workers, are up by now (or within AGENT_UP_S): a
        # rank's heartbeat is there from its first step.
        self.agents.wait_up({m.node_id for m in self.members.values()}, min(AGENT_UP_S, timeout_s))
        self.agents.sync(self.members)

    def request_stop(self, generation: int, timeout_s: float) -> dict[int, int]:
        out, bad = gather({r: m.handle.request_stop.remote(generation) for r, m in self.members.items()}, timeout_s)
        if bad:
            raise GroupError(f"request_stop failed for ranks {sorted(bad)}: {bad}", bad)
        return out

    def renumber(self, mapping: dict[int, int] | None = None) -> dict[int, int]:
        """After a shrink: ranks 0..k-1 for the k members, in their old order, or as `mapping`
        (old -> new) says; members it leaves out are killed. Returns old -> new."""
        mapping = mapping if mapping is not None else {old: new for new, old in enumerate(sorted(self.members))}
        for o in [o for o in self.members if o not in mapping]:
            self.kill(o)
        self.members = {mapping[o]: replace(m, rank=mapping[o]) for o, m in self.members.items()}
        self._polls.clear()
        self.vacated.clear()  # by old ranks
        self.agents.new_epoch()
        return mapping

    # ---------------------------------------------------------------- form / restore / run
    def form(self, generation: int, timeout_s: float, ping_timeout_s: float, pp: int = 1) -> float:
        """A rendezvous for the current members, as group `generation`: on the controller's store
        (elastic/group/rendezvous.py), under the generation's own prefix. A member that dies,
        stops answering or fails its join ends the formation at once: the others' joins are
        cut, and they come back with their state as survivors (a join that failed because of a
        peer is the peer's failure, reported as "peer failed", with where the join was).
        "Stops answering" is `formation_silent`'s verdict on its unanswered ping and its heartbeat.
        Returns the slowest ping answer seen (seconds), for the group_formed event."""
        world = len(self.members)
        assert sorted(self.members) == list(range(world)), f"ranks must be 0..{world - 1}: {sorted(self.members)}"
        host, port = self.rendezvous.address()  # the controller's store: no member hosts it
        refs = {r: m.handle.join.remote(host, port, r, world, generation, pp) for r, m in self.members.items()}
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
                    bad[r] = death_cause(e).value
                except Exception as e:  # noqa: BLE001 - join raised: a peer failed, or the rendezvous timed out
                    cause = getattr(e, "cause", None) or e  # a RayTaskError wraps what join() raised
                    bad[r] = f"error: {type(cause).__name__}: {str(cause)[:300]}"
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
                        bad[r] = death_cause(e).value
                elif formation_silent(now - ref_sent[1], beats.get(r), ping_timeout_s):
                    bad[r] = LostCause.UNRESPONSIVE.value
            if bad:
                break  # someone is gone, silent, or failed to join: the rest cannot complete; cut them
        if pending and not bad:  # the rendezvous timed out with every member answering
            bad = {r: f"error: did not join within failure.rendezvous_timeout_s={timeout_s:g}"
                   for r in pending.values()}
        where: dict[int, str] = {}
        if pending:
            cut = [r for r in pending.values() if r in self.members and cause_of(bad.get(r, "error")) == LostCause.ERROR]
            answers, _ = self._abort(generation, ping_timeout_s * 3, cut)
            where = {r: a.joining for r, a in answers.items() if a.joining}
            # Only the cut joins are waited for: a member already judged lost (its machine
            # stopped) never returns, and waiting ping_timeout_s x 5 on it added 5 s to
            # every formation it stopped (churn seed 2: a freeze found 9.3 s after it).
            lost = {r for r, w in bad.items() if cause_of(w) != LostCause.ERROR}
            waiting = [ref for ref, r in pending.items() if r not in lost]
            late, _ = (ray.wait(waiting, num_returns=len(waiting), timeout=ping_timeout_s * 5)
                       if waiting else ([], []))
            for ref in late:
                r = pending.pop(ref)
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - expected: its rendezvous was cut
                    pass
                bad.setdefault(r, "error: peer failed during formation")
        for r in pending.values():
            bad.setdefault(r, LostCause.UNRESPONSIVE.value)
        if where:  # what each cut member was doing: a formation that hung says where
            bad = {r: f"{w} (was {where[r]})" if r in where and cause_of(w) == LostCause.ERROR else w
                   for r, w in bad.items()}
        if bad:
            raise GroupError(f"process group formation failed for ranks {sorted(bad)}: {bad}", bad)
        return slowest

    def abort_all(self, generation: int, timeout_s: float, only: list[int] | None = None) -> dict[int, str]:
        """Ask members (all, or `only`) to abort their collectives of `generation` (answered on
        another actor thread while run() or join() is blocked). Returns {rank: why} for those
        that did not answer."""
        return self._abort(generation, timeout_s, self.members if only is None else only)[1]

    def _abort(self, generation: int, timeout_s: float, ranks) -> tuple[dict[int, AbortResult], dict[int, str]]:
        """`abort(generation)` on `ranks`: (answers by rank, {rank: why} for those that did not answer)."""
        return gather({r: self.members[r].handle.abort.remote(generation) for r in ranks if r in self.members},
                      timeout_s)

    def restore(self, candidates: list[str], timeout_s: float, watch: Watch | None = None
                ) -> dict[int, RestoreResult]:
        return self._all("restore", timeout_s, candidates, watch=watch)

    def restore_from_peer(self, src_rank: int, timeout_s: float, slot_sources: tuple[int, ...] = (),
                          watch: Watch | None = None, faults: dict[int, dict] | None = None
                          ) -> dict[int, RestoreResult]:
        return self._all("restore_from_peer", timeout_s, src_rank, list(slot_sources), watch=watch, faults=faults)

    def restore_from_shards(self, offers: dict[int, "ray.ObjectRef"], old_world: int,
                            timeout_s: float, old_pp: int = 1, copies_step: int | None = None,
                            watch: Watch | None = None, faults: dict[int, dict] | None = None
                            ) -> dict[int, RestoreResult]:
        # Parts kept by a process that is a member again move rank to rank: old part -> its new rank.
        where = {(m.node_id, m.pid): r for r, m in self.members.items()}
        holders = {p: where.get(key) for p, key in self._kept_by.items()}
        self._kept_by = {}
        if None in holders.values():
            gone = sorted(p for p, r in holders.items() if r is None)
            raise GroupError(f"old parts {gone} were kept by ranks that are not in the new group", {})
        # Refs nested in a list reach the workers as refs: each fetches only the parts it needs.
        return self._all("restore_from_shards", timeout_s, [offers.get(p) for p in range(old_world)], old_world,
                         old_pp, holders, copies_step, watch=watch, faults=faults)

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

    def _all(self, method: str, timeout_s: float, *args, watch: Watch | None = None,
             faults: dict[int, dict] | None = None) -> dict:
        """`method` called on every member: its answers by rank (typed: RestoreResult, ...).
        With `watch`, the wait is judged as training is (`gather_watched`); `faults`: a chaos
        fault a rank fires as its call starts."""
        faults = faults or {}
        refs = {r: getattr(m.handle, method).remote(*args, **({"fault": faults[r]} if r in faults else {}))
                for r, m in self.members.items()}
        out, bad = gather_watched(refs, timeout_s, watch, method) if watch else gather(refs, timeout_s)
        if bad:
            raise GroupError(f"{method} failed for ranks {sorted(bad)}: {bad}", bad)
        return out

    @staticmethod
    def collect_runs(refs: dict[int, "ray.ObjectRef"], timeout_s: float
                     ) -> tuple[dict[int, RunResult], dict[int, tuple[LostCause, str]]]:
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

    def run(self, num_steps: int, faults: list[dict], skip_steps: list[int] = (),
            buddies: dict[int, int] | None = None, evaluated_through: int = 0
            ) -> dict[int, "ray.ObjectRef"]:
        """Every member's run(); `buddies` (rank -> the rank that keeps its in-memory copies);
        `evaluated_through`: the last step whose evaluation the controller has."""
        self._polls.clear()  # an answer to a poll sent before a recovery describes the old group
        self.agents.new_epoch()
        buddies = buddies or {}
        return {r: m.handle.run.remote(num_steps, faults, list(skip_steps),
                                       (buddies[r], self.members[buddies[r]].handle) if r in buddies else None,
                                       tuple(q for q, b in sorted(buddies.items()) if b == r),
                                       evaluated_through)
                for r, m in self.members.items()}

    def memory_parts(self, sources: dict[int, int], step: int) -> dict[int, "ray.ObjectRef"]:
        """Each old rank's in-memory part at `step`, from the member named in `sources` (the rank
        itself, or its buddy): object refs owned by this process, the bytes in the holder's node
        store, read by the ranks that need them (restore_from_shards; a pipeline's stages)."""
        return {r: self.members[h].handle.memory_part.remote(r, step, h == r) for r, h in sources.items()}

    def keep_copies(self, sources: dict[int, int]) -> None:
        """Each old rank's in-memory part stays with the member named in `sources` (the rank
        itself, or its buddy), which sends its rows rank to rank at the restore
        (restore_from_shards with copies_step), under whatever number it has by then."""
        self._kept_by = {p: (self.members[h].node_id, self.members[h].pid) for p, h in sources.items()}

    def drain_polls(self, timeout_s: float) -> dict[int, PollReport]:
        """Answers of the polls still in flight, direct and through the nodes' agents (they may
        carry the last persist reports)."""
        refs = {r: ref for r, (ref, _) in self._polls.items()}
        self._polls.clear()
        return {**self.agents.drain(self.members, timeout_s), **gather(refs, timeout_s)[0]}

    def poll_nowait(self, ping_timeout_s: float) -> tuple[dict[int, PollReport], dict[int, str]]:
        """Non-blocking poll for the run loop: one aggregated poll in flight per node whose agent
        is up (elastic/group/node_agent.py), and one direct poll in flight per other member.
        Returns the answers that arrived, and {rank: why} for members that died or whose poll
        has been unanswered for longer than ping_timeout_s. A dead rank never blocks the loop.
        A rank with a direct poll in flight moves to its agent once that poll is answered."""
        self._polls = {r: v for r, v in self._polls.items() if r in self.members}
        through = self.agents.sync(self._routable())
        answers, silent = self.agents.poll_nowait(self.members, through, ping_timeout_s)
        now = time.monotonic()
        for r, m in self.members.items():
            if r not in self._polls and r not in through:
                self._polls[r] = (m.handle.poll.remote(), now)
                self.direct_polls += 1
        refs = {v[0]: r for r, v in self._polls.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0) if refs else ([], [])
        for ref in ready:
            r = refs[ref]
            _, sent = self._polls.pop(r)
            try:
                answers[r] = ray.get(ref)
                self.slowest_poll_answer_s = max(self.slowest_poll_answer_s, now - sent)
            except RayActorError as e:
                silent[r] = death_cause(e).value
            except Exception as e:  # noqa: BLE001
                silent[r] = f"error: {type(e).__name__}: {str(e)[:200]}"
        for r, (ref, sent) in self._polls.items():
            if now - sent > ping_timeout_s:
                silent[r] = LostCause.UNRESPONSIVE.value
        self.slowest_poll_answer_s = max(self.slowest_poll_answer_s, self.agents.slowest_answer_s)
        return answers, silent

    def _routable(self) -> dict:
        """The members an agent may poll: all but those with a direct poll in flight (they move to
        their agent once it is answered). The same dict for the polls and the heartbeat, so what
        each agent is told does not flip between the two."""
        return {r: m for r, m in self.members.items() if r not in self._polls} if self._polls else self.members

    def unanswered_s(self) -> Mapping[int, float]:
        """For each member with a poll in flight (direct, or through its node's agent), how long it
        has waited: since its last answer, within one run-loop iteration (the next poll goes out as
        soon as an answer is taken)."""
        now = time.monotonic()
        return ChainMap({r: now - sent for r, (_, sent) in self._polls.items()}, self.agents.unanswered_s())

    def control_traffic(self) -> dict[str, int]:
        """The controller's periodic messages so far: polls sent to agents and to ranks directly,
        heartbeat pings sent (one per node per interval)."""
        return {"agent_polls": self.agents.rpcs, "direct_polls": self.direct_polls,
                "heartbeat_pings": self.heartbeats.pings_sent if self.heartbeats else 0}

    def beats(self, fresh_within_s: float = 0.0) -> dict:
        """{rank: Beat} from the nodes' heartbeat sidecars (elastic/runtime/heartbeat.py, run by the
        node agents), pinged by a process of its own from the first call (elastic/runtime/pinger.py):
        its newest snapshot, at most one call old, or with `fresh_within_s` one taken after this
        call (waited for up to that long). A rank whose node's sidecar never answered for it is
        left out."""
        if self.agents.auth is None:
            return {}  # heartbeat off: no sidecar runs to ask
        if self.heartbeats is None:
            self.heartbeats = PingerProcess(self.agents.auth)
        self.heartbeats.watch(self.agents.heartbeat_targets(self._routable()))
        return self.heartbeats.beats(fresh_within_s)

    def poll(self, timeout_s: float) -> tuple[dict[int, PollReport], dict[int, str]]:
        """(answers by rank, {rank: why not} for those that died or did not answer in time)."""
        return gather({r: m.handle.poll.remote() for r, m in self.members.items()}, timeout_s)

    # ---------------------------------------------------------------- teardown
    def kill(self, rank: int) -> None:
        """Kill a member for sure: ray.kill, plus a SIGKILL by pid from its own node, which also
        ends a stopped (SIGSTOP) process whose Ray core worker cannot act on a kill request.
        Fire and forget: on a dead node the second part never runs, and need not."""
        m = self.members.pop(rank, None)
        self._polls.pop(rank, None)
        if m is not None:
            self.vacated[rank] = m.node_id
            kill_member(m)

    def where(self, ranks, timeout_s: float) -> dict[int, str | None]:
        """Where each member's run() is now (`Worker.where`); a rank that did not answer is left out."""
        return gather({r: self.members[r].handle.where.remote() for r in ranks if r in self.members}, timeout_s)[0]

    def wait_runs(self, refs: dict[int, "ray.ObjectRef"], timeout_s: float) -> dict[int, str]:
        """Wait for members' run() calls to return; {rank: why} for those that did not."""
        live = {r: ref for r, ref in refs.items() if r in self.members}
        _, bad = gather(live, timeout_s)
        return bad

    def save_again(self, timeout_s: float) -> dict[int, str]:
        """Every member saves its final state again and waits for the persist; {rank: why} for
        those that did not return within timeout_s."""
        _, bad = gather({r: m.handle.save_again.remote() for r, m in self.members.items()}, timeout_s)
        return bad

    def leave_all(self, timeout_s: float) -> dict[int, str]:
        """Ask every member to drop its process group; returns the ranks that could not."""
        _, bad = gather({r: m.handle.leave.remote() for r, m in self.members.items()}, timeout_s)
        return bad

    def shutdown(self) -> None:
        for r in list(self.members):
            self.kill(r)
        self.trim_spares(0, regroup=False)
        self.prestart.shutdown()
        self.agents.shutdown()
        if self.heartbeats is not None:
            self.heartbeats.close()
