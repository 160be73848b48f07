"""One agent per node: the controller's periodic traffic grows with nodes, not ranks.

`NodeAgent` is a small Ray actor (no torch, no CPU reserved) pinned to a node. It
  * polls the node's ranks for the controller: one `poll()` to the agent per node per poll
    interval carries every local rank's report (`NodePoll`), with how long each unanswered
    rank has waited and which ranks' workers died;
  * runs the node's heartbeat sidecar (elastic/runtime/heartbeat.py), one process answering
    for every local worker's pid, so the controller's UDP pings are one per node too. It answers
    the controller's address only, with the token derived from the group's key
    (`NodeAgents.auth`, elastic/runtime/ping_auth.py).
Commands (join, run, restore, abort, kill) still go to each rank: they are not periodic.

`NodeAgents` is the group's side: it starts an agent on each node that hosts a member, tells it
its ranks, keeps one aggregated poll in flight per node, and turns the answers back into what the
run loop reads per rank (answers, silent ranks, unanswered seconds). Until a node's agent has
answered that it is up (a second or two after the node's first rank), its ranks are polled
directly, as before agents. An agent that dies takes its node's ranks with it: they are reported
lost with the agent's cause (`node_died` when the node went, `process_died` when only the agent
did; `unresponsive` when its sidecar's port refusing the heartbeat says so first), and replaced
like any lost rank; a new agent starts with the next member on that node.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic.group.member import death_cause
from elastic.protocol import AgentInfo, LostCause, NodePoll, PollReport
from elastic.runtime import heartbeat
from elastic.runtime.ping_auth import PingAuth

AGENT_WAIT_S = 0.05  # how long an agent's poll waits for its ranks' answers before it replies


def _actor_id(handle) -> str:
    return handle._actor_id.hex()


class NodeAgent:
    """Runs on one node (see the module's docstring). Single-threaded: the controller's calls run
    in the order sent, so a `watch` always precedes the polls sent after it."""

    def __init__(self, auth: PingAuth | None):
        """`auth`: whose pings the node's sidecar answers; None: no sidecar (heartbeat off)."""
        self.ip = ray.util.get_node_ip_address()
        self.sidecar = heartbeat.start_sidecar(self.ip, auth) if auth is not None else None
        self.epoch = -1
        self.watched: dict[int, tuple[str, object, int]] = {}  # rank -> (actor id, handle, pid)
        self._polls: dict[int, tuple[str, ray.ObjectRef, float]] = {}  # rank -> (actor id, poll, sent at)

    def info(self) -> AgentInfo:
        return AgentInfo(node_id=ray.get_runtime_context().get_node_id(), ip=self.ip, pid=os.getpid(),
                         hb_port=self.sidecar.port if self.sidecar else None)

    def watch(self, epoch: int, members: dict[int, tuple[object, int]]) -> None:
        """The node's ranks from now on: {rank: (worker handle, pid)}. A new epoch (the group's
        ranks were renumbered or its run restarted) drops every poll in flight: their answers
        describe the group before."""
        self.watched = {r: (_actor_id(h), h, pid) for r, (h, pid) in members.items()}
        if epoch != self.epoch:
            self._polls.clear()
            self.epoch = epoch
        self._polls = {r: p for r, p in self._polls.items() if r in self.watched and self.watched[r][0] == p[0]}
        if self.sidecar:
            self.sidecar.watch(sorted({pid for _, _, pid in self.watched.values()}))

    def poll(self, epoch: int, wait_s: float = AGENT_WAIT_S) -> NodePoll:
        """One poll of every local rank (at most one in flight each), the answers that arrive
        within `wait_s`."""
        if epoch != self.epoch:
            return NodePoll(epoch=self.epoch)
        now = time.monotonic()
        for r, (aid, h, _) in self.watched.items():
            if r not in self._polls:
                self._polls[r] = (aid, h.poll.remote(), now)
        return self._collect(wait_s)

    def drain(self, epoch: int, timeout_s: float) -> NodePoll:
        """The answers of the polls in flight, waiting up to `timeout_s` (before the group changes:
        they may carry the last persist reports). Sends no new poll."""
        if epoch != self.epoch:
            return NodePoll(epoch=self.epoch)
        out = self._collect(timeout_s)
        self._polls.clear()
        return out

    def _collect(self, wait_s: float) -> NodePoll:
        by_ref = {ref: r for r, (_, ref, _) in self._polls.items()}
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=wait_s) if by_ref else ([], [])
        answers, died, actors = {}, {}, {}
        for ref in ready:
            r = by_ref[ref]
            aid, _, _ = self._polls.pop(r)
            actors[r] = aid
            try:
                answers[r] = ray.get(ref)
            except RayActorError as e:
                died[r] = death_cause(e).value
            except Exception as e:  # noqa: BLE001 - its poll() raised
                died[r] = f"error: {type(e).__name__}: {str(e)[:200]}"
        now = time.monotonic()
        waiting = {r: now - sent for r, (_, _, sent) in self._polls.items()}
        return NodePoll(epoch=self.epoch, answers=answers, died=died, waiting_s=waiting, actors=actors)


class NodeAgents:
    """The group's side of the node agents (see the module's docstring)."""

    def __init__(self, heartbeat_on: bool, runtime_env: dict | None = None):
        self.heartbeat_on = heartbeat_on
        # Pings come from this process's node (the pinger is its child), with the key its agents get.
        self.auth = PingAuth.new(ray.util.get_node_ip_address()) if heartbeat_on else None
        self._remote = ray.remote(NodeAgent)
        self._runtime_env = runtime_env or None
        self._agents: dict[str, object] = {}  # node -> agent handle
        self._infos: dict[str, ray.ObjectRef | AgentInfo] = {}  # node -> its info: a ref until it answered
        self._watched: dict[str, tuple] = {}  # node -> what its agent was last told (epoch, ranks)
        self._told: dict[str, dict[int, str]] = {}  # node -> {rank: actor id} at the last sync
        self._node_of: dict[int, str] = {}  # rank -> its node, at the last sync
        self._polls: dict[str, tuple[ray.ObjectRef, float]] = {}  # node -> (aggregated poll in flight, sent at)
        # rank -> since when its poll has been unanswered, where not since its node's poll went out
        # (its agent still waits on it, or was not told of it yet)
        self._since: dict[int, float] = {}
        self.epoch = 0
        self.rpcs = 0  # aggregated polls sent
        self.slowest_answer_s = 0.0  # the longest a rank's poll waited for its answer
        self.lost: dict[str, str] = {}  # node -> why its agent is gone
        self._agents_changed = 0  # counts agents started, up or dropped: `sync` is redone after one
        self._sync_key: tuple | None = None
        self._through: set[int] = set()
        self._by_node: dict[str, list[int]] = {}  # node -> its ranks polled through its agent
        self._targets: dict[int, tuple[str, int, int]] = {}  # rank -> its node's sidecar (ip, port) and its pid

    # ---------------------------------------------------------------- agents
    def ensure(self, node_id: str) -> None:
        """An agent on `node_id` (started without waiting for it)."""
        if node_id in self._agents:
            return
        h = self._remote.options(
            num_cpus=0, max_restarts=0, max_concurrency=1, runtime_env=self._runtime_env,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(self.auth)
        self._agents[node_id] = h
        self._infos[node_id] = h.info.remote()
        self._agents_changed += 1

    def start_where_workers_fit(self, cpus_per_worker: float, gpu: bool, avoid=frozenset(), nodes=None) -> None:
        """Agents on every alive node that could host a worker, before the workers start: an
        agent (no torch) is up well before a worker has built its model, so the first step
        already has its node's heartbeat. `nodes`: `ray.nodes()` as the caller just read it."""
        for node in ray.nodes() if nodes is None else nodes:
            res = node.get("Resources", {})
            if node.get("Alive") and node["NodeID"] not in avoid and \
                    (res.get("GPU", 0) >= 1 if gpu else res.get("CPU", 0) >= cpus_per_worker):
                self.ensure(node["NodeID"])

    def wait_up(self, nodes, timeout_s: float) -> list[str]:
        """Wait up to `timeout_s` for the agents of `nodes` to answer; returns those still not up
        (their ranks are polled directly, and have no heartbeat, until they are)."""
        deadline = time.monotonic() + timeout_s
        pending = {self._infos[n]: n for n in nodes if n in self._infos and not isinstance(self._infos[n], AgentInfo)}
        if pending:
            ray.wait(list(pending), num_returns=len(pending), timeout=max(0.0, deadline - time.monotonic()))
        return [n for n in nodes if self.info(n) is None]

    def nodes(self) -> list[str]:
        """The nodes whose agent is up."""
        return [n for n in self._agents if self.info(n) is not None]

    def info(self, node_id: str) -> AgentInfo | None:
        """The node's agent's info once it has answered; None before (or if it failed to start)."""
        info = self._infos.get(node_id)
        if info is None or isinstance(info, AgentInfo):
            return info
        if not ray.wait([info], timeout=0)[0]:
            return None
        self._agents_changed += 1
        try:
            self._infos[node_id] = ray.get(info)
        except Exception as e:  # noqa: BLE001 - it could not start: its node's ranks are polled directly
            self._drop(node_id, f"did not start: {type(e).__name__}")
            return None
        return self._infos[node_id]

    def _drop(self, node_id: str, why: str) -> None:
        h = self._agents.pop(node_id, None)
        self._infos.pop(node_id, None)
        self._watched.pop(node_id, None)
        self._polls.pop(node_id, None)
        self._by_node.pop(node_id, None)
        self._agents_changed += 1
        self.lost[node_id] = why
        if h is not None:
            ray.kill(h, no_restart=True)

    def new_epoch(self) -> None:
        """The group's ranks changed meaning (renumbered) or its run restarted: answers to polls
        sent before are dropped, here and at every agent."""
        self.epoch += 1
        self._polls.clear()
        self._since.clear()

    def sync(self, members: dict) -> set[int]:
        """Start the agents the members' nodes need and tell each its ranks. Returns the ranks
        polled through an agent (the others are polled directly). Redone only when the membership
        (`Members.version`), the epoch or an agent changed: O(nodes not up yet) otherwise."""
        for node in [n for n, i in self._infos.items() if not isinstance(i, AgentInfo)]:
            self.info(node)
        version = getattr(members, "version", None)
        key = (version, self.epoch, self._agents_changed)
        if version is not None and key == self._sync_key:
            return self._through
        by_node: dict[str, dict[int, object]] = {}
        for r, m in members.items():
            by_node.setdefault(m.node_id, {})[r] = m
        through, self._by_node, targets, self._told, self._node_of = set(), {}, {}, {}, {}
        for node, ms in by_node.items():
            self.ensure(node)
            info = self.info(node)
            if info is None:
                continue
            told = (self.epoch, tuple(sorted((r, m.actor_hex, m.pid) for r, m in ms.items())))
            if self._watched.get(node) != told:
                self._agents[node].watch.remote(self.epoch, {r: (m.handle, m.pid) for r, m in ms.items()})
                self._watched[node] = told
            through |= set(ms)
            self._by_node[node] = sorted(ms)
            self._told[node] = {r: m.actor_hex for r, m in ms.items()}
            self._node_of.update(dict.fromkeys(ms, node))
            if info.hb_port:
                targets.update({r: (info.ip, info.hb_port, m.pid) for r, m in ms.items()})
        for node in [n for n in self._watched if n not in self._by_node]:  # no member there any more
            self._agents[node].watch.remote(self.epoch, {})
            del self._watched[node]
            self._polls.pop(node, None)
        self._since = {r: t for r, t in self._since.items() if r in through}
        self._through, self._targets = through, targets
        self._sync_key = (version, self.epoch, self._agents_changed)  # ensure() may have started agents
        return through

    # ---------------------------------------------------------------- aggregated polls
    def poll_nowait(self, members: dict, through: set[int], ping_timeout_s: float
                    ) -> tuple[dict[int, PollReport], dict[int, str]]:
        """One aggregated poll in flight per node with ranks in `through` (the last `sync`'s); the
        answers that arrived, and {rank: why} for ranks whose worker (or agent) died or that have
        been unanswered for longer than ping_timeout_s. O(nodes) in Python, and O(ranks) only in
        bulk dict operations: a rank's wait is its node's poll's, unless its agent said it still
        waits (`_since`, the few slow ones)."""
        now = time.monotonic()
        for node in self._by_node:
            if node not in self._polls:
                self._polls[node] = (self._agents[node].poll.remote(self.epoch), now)
                self.rpcs += 1
        by_ref = {ref: node for node, (ref, _) in self._polls.items()}
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0) if by_ref else ([], [])
        answers, silent, replies = {}, {}, []
        for ref in ready:
            node = by_ref[ref]
            _, sent = self._polls.pop(node)
            try:
                replies.append((node, sent, ray.get(ref)))
            except RayActorError as e:
                cause = death_cause(e)
                ranks = self._by_node.get(node, [])
                self._drop(node, f"its agent died ({cause.value})")
                silent.update({r: cause.value for r in ranks if r in members})
            except Exception as e:  # noqa: BLE001 - a bug in the agent: poll its ranks directly meanwhile
                self._drop(node, f"its agent failed: {type(e).__name__}: {str(e)[:200]}")
        self.settle(replies, members, now, ping_timeout_s, answers, silent)
        return answers, silent

    def settle(self, replies: list[tuple[str, float, NodePoll]], members: dict, now: float, ping_timeout_s: float,
               answers: dict, silent: dict) -> None:
        """The nodes' answers that arrived, (node, when its poll went out, NodePoll) each, folded
        into `answers` and `silent`; then every rank unanswered for longer than ping_timeout_s
        added to `silent`. The controller's own cost of a round of polls, less Ray's."""
        received = time.monotonic()
        same = self._sync_key is not None and getattr(members, "version", None) == self._sync_key[0]
        oldest = received
        for node, sent, reply in replies:  # once per node and poll: kept to bulk dict operations
            if reply.epoch != self.epoch:
                continue  # it describes the group before
            told, actors = self._told.get(node), reply.actors
            if same and told is not None and (actors == told or actors.items() <= told.items()):
                # The usual case: the members are those of the last sync, and every rank
                # answered with the actor its agent was told of then.
                answers.update(reply.answers)
                if reply.died:
                    silent.update(reply.died)
                if self._since:
                    for r in self._since.keys() & actors.keys():
                        oldest = min(oldest, self._since.pop(r))
                oldest = min(oldest, sent)
            else:
                self._fold_each(reply, members, received, answers, silent, sent)
            if reply.waiting_s or len(actors) < len(self._by_node.get(node, ())):
                self._fold_rest(node, reply, members, received, sent)
        self.slowest_answer_s = max(self.slowest_answer_s, received - oldest)
        unresponsive = LostCause.UNRESPONSIVE.value
        for node, (_, sent) in self._polls.items():
            if now - sent > ping_timeout_s:  # the whole node's poll: none of its ranks answered
                for r in self._by_node.get(node, ()):
                    silent.setdefault(r, unresponsive)
        for r, since in self._since.items():
            if now - since > ping_timeout_s:
                silent.setdefault(r, unresponsive)

    def _fold_rest(self, node: str, reply: NodePoll, members: dict, received: float, sent: float) -> None:
        """The waits a node's answer reports: ranks its agent still waits on, and ranks it
        neither answered for nor waits on (not told of them yet), whose wait goes on from `sent`."""
        for r, waited in reply.waiting_s.items():
            if r in members:
                self._since[r] = min(self._since.get(r, received), received - waited)
        ranks = self._by_node.get(node, ())
        if len(reply.actors) + len(reply.waiting_s) < len(ranks):
            for r in set(ranks) - reply.actors.keys() - reply.waiting_s.keys():
                self._since.setdefault(r, sent)

    def _fold_each(self, reply: NodePoll, members: dict, received: float, answers: dict, silent: dict,
                   sent: float) -> None:
        for r, aid in reply.actors.items():
            m = members.get(r)
            if m is None or m.actor_hex != aid:
                continue  # that rank has another worker now
            self.slowest_answer_s = max(self.slowest_answer_s, received - self._since.pop(r, sent))
            if r in reply.answers:
                answers[r] = reply.answers[r]
            else:
                silent[r] = reply.died[r]

    def unanswered_s(self) -> Mapping[int, float]:
        """rank -> how long its poll has waited, for the ranks with one in flight: read per rank
        (the run loop reads the silent ones'), never built for all."""
        return _Unanswered(dict(self._since), dict(self._polls), self._node_of, time.monotonic())

    def drain(self, members: dict, timeout_s: float) -> dict[int, PollReport]:
        """Answers of the aggregated polls in flight, and of every agent's own polls in flight
        (waited for up to `timeout_s` in all): the last reports before the group changes. An
        agent that does not answer in time (its node stopped) adds nothing. Only the agents of
        nodes that host a member are waited for: a node whose ranks were all lost (killed,
        stopped) may never answer, and once cost every recovery and formation 2 s here; what
        its agent already sent is taken."""
        answers, silent = {}, {}
        deadline = time.monotonic() + timeout_s
        hosts = {m.node_id for m in members.values()}
        in_flight = [(node, ref) for node, (ref, _) in self._polls.items()]
        sent = {node: t for node, (_, t) in self._polls.items()}
        self._polls.clear()
        replies: list[tuple[str, float, NodePoll]] = []
        drains = [(node, self._agents[node].drain.remote(self.epoch, timeout_s))
                  for node in self._watched if node in self._agents]
        for pairs in (in_flight, drains):  # in this order: a drained answer is newer than one in flight
            wait_for = [ref for node, ref in pairs if node in hosts]
            if wait_for:
                ray.wait(wait_for, num_returns=len(wait_for), timeout=max(0.0, deadline - time.monotonic()) + 1.0)
            refs = [ref for _, ref in pairs]
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
            for node, ref in ((n, r) for n, r in pairs if r in ready):
                try:
                    replies.append((node, sent.get(node, time.monotonic()), ray.get(ref)))
                except Exception:  # noqa: BLE001 - an agent gone: the run loop learns it from its ranks
                    pass
        self.settle(replies, members, time.monotonic(), float("inf"), answers, silent)  # in order: newest last
        self._since.clear()
        return answers

    # ---------------------------------------------------------------- heartbeat
    def heartbeat_targets(self, members: dict) -> dict[int, tuple[str, int, int]]:
        """{rank: (ip, port, pid)} of the members whose node's sidecar is up (the same object
        while nothing changed)."""
        self.sync(members)
        return self._targets

    def shutdown(self) -> None:
        for h in self._agents.values():
            ray.kill(h, no_restart=True)
        self._agents.clear()
        self._infos.clear()
        self._watched.clear()
        self._polls.clear()
        self._by_node.clear()
        self._since.clear()
        self._through, self._targets, self._sync_key = set(), {}, None


class _Unanswered(Mapping):
    """rank -> seconds its poll has waited, as of `now`: its own wait where its agent reported one,
    else its node's poll's while one is in flight (`NodeAgents.unanswered_s`)."""

    def __init__(self, since: dict, polls: dict, node_of: dict, now: float):
        self._since, self._polls, self._node_of, self._now = since, polls, node_of, now

    def __getitem__(self, rank: int) -> float:
        t = self._since.get(rank)
        if t is None:
            t = self._polls[self._node_of[rank]][1]  # KeyError: no poll of its in flight
        return self._now - t

    def __iter__(self):
        return iter({*self._since, *(r for r, n in self._node_of.items() if n in self._polls)})

    def __len__(self) -> int:
        return sum(1 for _ in self)
