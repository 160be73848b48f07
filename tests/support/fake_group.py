"""A worker group without Ray: simulated ranks on a fake clock, for stepping the controller.

The controller talks to its workers only through the group, so this stand-in
lets tests drive it one iteration at a time (`Controller.step_once`) through
frozen ranks, partial stop deliveries, failures during a recovery or a resize,
and lets `python -m benchmarks controller` measure an iteration's cost at 10,000
ranks. Training is simulated as in a real all-reduce group: every `step_s` of
fake time all ranks complete a step together, unless one of them is frozen or
dead, in which case the others wait (blocked in the collective) until they are
aborted. Every call the controller makes is recorded in `calls`. It implements
`elastic.protocol.WorkerGroupProtocol`, as the real group does, and answers
with the same typed messages (tests/test_protocol.py checks the two agree).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from elastic.group.member import SurvivorsLost
from elastic.group.worker_group import GroupError
from elastic.protocol import (PersistResult, PollReport, RankStatus, RestoreResult, RunResult, RunStatus,
                              StepRecord)
from elastic.runtime.heartbeat import Beat


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class _FakeBeats(dict):
    """rank -> Beat, and the refusing ones without a scan (as `heartbeat.Beats.refused`)."""

    def __init__(self):
        super().__init__()
        self.refusing: list[int] = []

    def refused(self) -> list[int]:
        return self.refusing


@dataclass
class FakeRank:
    rank: int
    node_id: str
    pid: int
    handle: object = None
    calib_s: float | None = 0.01
    on_demand: bool = False
    step: int = 0
    holds_state: bool = False  # restored (or trained) state; a fresh replacement holds none
    generation: int = 0
    frozen_at: float | None = None  # silent from then on (a stopped machine)
    frozen_how: str = "machine"  # its heartbeat: "machine" silent too, "process" says stopped (T), "held" says S
    dead: bool = False  # Ray reports it dead
    run_out: RunResult | None = None  # what its run() returned, once it returned
    running: bool = False
    stop: bool = False
    logged: int = 0  # the last step whose compute time it reported
    slow: tuple[int, float, float] | None = None  # (after step, factor, for steps): computes that much slower
    finish_at: float | None = None  # its last persist ends then (until then it reports storage_wait)


@dataclass
class FakeGroup:
    clock: FakeClock
    num_steps_hint: int = 0
    step_s: float = 0.05  # fake seconds per training step
    spare_warm_s: float = 0.5  # fake seconds for a spare to become ready
    members: dict = field(default_factory=dict)
    ready_spares: list = field(default_factory=list)
    newly_ready: list = field(default_factory=list)
    spare_starts: list = field(default_factory=list)  # (n, on_demand, background) per add_spares that started any
    calibrated_starts: list = field(default_factory=list)  # whether those spares calibrate before they are ready
    lost_spares: list = field(default_factory=list)
    placement: object = None  # where tp groups start (WorkerGroup.start); none here
    split_reasons: dict = field(default_factory=dict)  # first rank of a tp group -> why it spans nodes (promote)
    regroup_starts: int = 0  # start_regroup_spares calls
    suspect_nodes: set = field(default_factory=set)
    calls: list = field(default_factory=list)  # (method, args) in order
    # test hooks
    fail_promote: int = 0  # the next N promote() calls raise (replacements that never come)
    die_on_form: list = field(default_factory=list)  # ranks that die during the next form()
    die_on_promote: list = field(default_factory=list)  # ranks that die while the next promote() starts workers
    freeze_on_promote: dict = field(default_factory=dict)  # rank -> how it freezes while the next promote() runs
    stop_undelivered: set = field(default_factory=set)  # ranks a request_stop does not reach
    self_s: float = 0.0  # real seconds spent inside this fake (to subtract from controller timings)
    persisting: bool = False  # every rank reports a checkpoint persist in flight
    commits: list = field(default_factory=list)  # checkpoint uris rank 0 reports committed at its next answer
    retried: list = field(default_factory=list)  # steps rank 0 reports saved again (a failed checkpoint), next answer
    report_compute: bool = False  # answers carry each step's compute time (for the straggler policy)
    t_start: float = field(default_factory=time.time)  # wall clock of step 0's start, for the step records' ends
    slowest_poll_answer_s: float = 0.0
    final_commits: bool = True  # the run's last checkpoint commits (False: storage was out at the end)
    commit_on_save_again: int = 1  # the final state saved again commits at this try (0: never)
    save_again_s: float = 30.0  # fake seconds one more save of the final state takes
    final_persist_s: dict = field(default_factory=dict)  # rank -> fake seconds its last persist outlasts the others'
    stalled_until: float = 0.0  # no rank completes a step before this fake time (a long checkpoint)
    # restore(): each call with candidates takes the next entry: a reason every candidate fails with
    # (storage out, a mismatched model); with none left, the newest candidate loads.
    load_failures: list = field(default_factory=list)
    heartbeats: bool = False  # each rank's node has a heartbeat sidecar (else the controller judges by polls alone)
    ranks_per_node: int = 1  # ranks started on one node (each node's agent takes one aggregated poll)
    late_returns: dict = field(default_factory=dict)  # rank -> waits its run() outlasts after an abort it answered
    # A restore from a peer reports a copy of this many bytes of state per rank, into each rank
    # that held none (or an older step), in `transfer_s` (None: it reports no copy, as before).
    state_bytes: int | None = None
    transfer_s: float = 0.5
    late_polls: dict = field(default_factory=dict)  # rank -> blocking polls it leaves unanswered (a loaded machine)
    freeze_on_restore: dict = field(default_factory=dict)  # rank -> how it freezes as the next restore starts
    die_on_restore: list = field(default_factory=list)  # ranks whose process dies as the next restore starts

    def __post_init__(self):
        self._pending: list[float] = []  # fake times at which pending spares become ready
        self._next_pid = 10_000
        self._num_steps = 0
        self._last_advance = self.clock()
        self._polls_sent = 0  # aggregated polls, one per node with members per poll round
        self._pings_sent = 0

    # ---------------------------------------------------------------- helpers for tests
    def _new_rank(self, rank: int, on_demand: bool = False) -> FakeRank:
        self._next_pid += 1
        node = 10_001 + (self._next_pid - 10_001) // self.ranks_per_node
        return FakeRank(rank, f"node{node:06d}" + "0" * 44, self._next_pid, on_demand=on_demand)

    def freeze(self, rank: int, how: str = "machine") -> None:
        """`rank` answers no poll from now on: its machine stopped ("machine": its heartbeat is
        silent too), its process was stopped ("process": the heartbeat says T), its Python is
        held ("held": the heartbeat says S; `thaw` lets it go), or its node's processes died with
        the machine up ("refused": the node refuses the heartbeat's pings)."""
        m = self.members[rank]
        m.frozen_at, m.frozen_how = self.clock(), how

    def slow_down(self, rank: int, after_step: int, factor: float, steps: float = float("inf")) -> None:
        """The process holding `rank` computes `factor` x slower for `steps` steps after
        `after_step` (a process that replaces it does not)."""
        self.members[rank].slow = (after_step, factor, steps)

    def thaw(self, rank: int) -> None:
        """A rank that was only slow to answer answers again (it was never lost)."""
        m = self.members[rank]
        self.slowest_poll_answer_s = max(self.slowest_poll_answer_s, self.clock() - m.frozen_at)
        m.frozen_at = None

    def kill_process(self, rank: int) -> None:
        self.members[rank].dead = True

    def kill_node(self, rank: int, refuses: bool = False) -> None:
        """`rank`'s machine dies and Ray has not noticed yet: it and its node's heartbeat fall
        silent (or, `refuses`, its processes die with the machine up and the node refuses the
        heartbeat's pings), and its peers' collectives fail at once (their sockets to it closed)."""
        self.freeze(rank, how="refused" if refuses else "machine")
        for r, m in self.members.items():
            if r != rank and m.running:
                m.running, m.run_out = False, RunResult(RunStatus.ABORTED, m.step, m.generation,
                                                        error="Connection closed by peer")

    def _advance_training(self) -> None:
        """All ranks step together while none is frozen or dead (an all-reduce needs everyone)."""
        now = self.clock()
        live = [m for m in self.members.values() if m.running]
        blocked = any(m.frozen_at is not None or m.dead for m in self.members.values())
        if now < self.stalled_until:
            self._last_advance = now
            return
        while now - self._last_advance >= self.step_s:
            self._last_advance += self.step_s
            if blocked or not live or len(live) != len(self.members):
                continue
            stop = any(m.stop for m in live)
            for m in live:
                m.step += 1
                if m.step >= self._num_steps:
                    m.running = False
                    if m.rank in self.final_persist_s:  # still waiting for storage, then done
                        m.finish_at = now + self.final_persist_s[m.rank]
                    else:
                        m.run_out = self._done(m)
                    if m.rank == 0 and self.final_commits:  # the run's last checkpoint
                        self.commits.append(f"memory://fake/step_{m.step:09d}")
                elif stop:
                    m.running, m.stop = False, False
                    m.run_out = RunResult(RunStatus.STOPPED, m.step, m.generation)
            if any(not m.running for m in live):
                return

    # ---------------------------------------------------------------- start and spares
    def start(self, ranks, timeout_s) -> None:
        self.calls.append(("start", tuple(ranks)))
        for r in ranks:
            self.members[r] = self._new_rank(r)

    def add_spares(self, n: int, on_demand: bool = False, background: bool = False,
                   calibrate: bool | None = None, near: tuple[str, ...] = (), at: tuple[str, ...] = ()) -> None:
        if n > 0:
            self.spare_starts.append((n, on_demand, background))
            self.calibrated_starts.append(not on_demand if calibrate is None else calibrate)
        for _ in range(max(0, n)):
            self._pending.append(self.clock() + self.spare_warm_s)

    def tend_prestarted(self) -> list[str]:
        return []

    def wait_prestarted_ready(self, timeout_s: float) -> bool:
        return True

    def prestarted_news(self):
        return 0, []

    def wait_spares_ready(self, timeout_s: float) -> bool:
        self.clock.advance(self.spare_warm_s)
        self.refresh_spares()
        return not self._pending

    def num_spares(self) -> int:
        return len(self.ready_spares) + len(self._pending)

    def refresh_spares(self, wait_s: float = 0.0) -> list[str]:
        now = self.clock()
        for t in [t for t in self._pending if t <= now]:
            self._pending.remove(t)
            m = self._new_rank(-1)
            self.ready_spares.append(m)
            self.newly_ready.append((m.node_id[:12], m.pid, False))
        return []

    def check_spares(self, timeout_s: float) -> list[str]:
        return []

    def calibrate_spares(self, timeout_s: float) -> list[str]:
        return []  # fake spares are calibrated when they become ready

    def probe_suspects(self) -> list[str]:
        return []

    def start_regroup_spares(self) -> int:
        self.regroup_starts += 1
        return 0  # fake members hold no tp groups

    def trim_spares(self, keep: int, regroup: bool = True) -> None:
        while self.num_spares() > keep:
            (self._pending.pop() if self._pending else self.ready_spares.pop())

    def suspect(self, node_id: str) -> None:
        self.suspect_nodes.add(node_id)

    def spare_homes(self, n: int) -> tuple[str, ...]:
        return ()  # fake members hold no tp groups

    def take_spare_for(self, rank: int, max_calib_s: float, ping_timeout_s: float, home: str | None = None):
        self.refresh_spares()
        if not self.ready_spares:
            return None
        m = self.ready_spares.pop(0)
        m.rank = rank
        self.members[rank] = m
        return m

    def promote(self, ranks, timeout_s, ping_timeout_s, watch=None) -> dict[int, str]:
        self.calls.append(("promote", tuple(ranks)))
        if self.fail_promote > 0:
            self.fail_promote -= 1
            self.clock.advance(timeout_s)
            raise GroupError(f"no worker could be started for ranks {list(ranks)}", {r: "unavailable" for r in ranks})
        how = {}
        dying, self.die_on_promote = self.die_on_promote, []
        for r in dying:
            self.members[r].dead = True
        freezing, self.freeze_on_promote = self.freeze_on_promote, {}
        for r, freeze_how in freezing.items():
            self.freeze(r, freeze_how)
        if freezing:  # the replacements' start outlasts the silence bound: watched as it goes
            for _ in range(10):
                self.clock.advance(0.2)
                lost = watch(set(self.members)) if watch else {}
                if lost:
                    raise SurvivorsLost(f"members {sorted(lost)} were lost while replacements started", lost)
        self.refresh_spares()
        for r in ranks:
            if self.ready_spares:
                m = self.ready_spares.pop(0)
                how[r] = "warm spare"
            else:
                m = self._new_rank(r, on_demand=True)
                how[r] = "started on demand"
            m.rank = r
            self.members[r] = m
        return how

    def renumber(self, mapping: dict[int, int] | None = None) -> dict[int, int]:
        mapping = mapping if mapping is not None else {old: new for new, old in enumerate(sorted(self.members))}
        for o in [o for o in self.members if o not in mapping]:
            self.kill(o)
        self.members = {mapping[o]: m for o, m in self.members.items()}
        for r, m in self.members.items():
            m.rank = r
        return mapping

    # ---------------------------------------------------------------- group
    def form(self, generation: int, timeout_s: float, ping_timeout_s: float, pp: int = 1) -> float:
        self.calls.append(("form", generation) if pp == 1 else ("form", (generation, pp)))
        dying, self.die_on_form = self.die_on_form, []
        for r in dying:
            self.members[r].dead = True
        if dying:
            bad = {r: "process_died" for r in dying}
            bad.update({r: "error: peer failed during formation" for r in self.members if r not in dying})
            raise GroupError(f"process group formation failed for ranks {sorted(bad)}", bad)
        for m in self.members.values():
            m.generation = generation
        return 0.0  # the slowest ping answer

    def _fire(self, faults: dict | None) -> None:
        """Chaos faults handed out with a restore (`during_restore`): they fire as it starts."""
        for r, f in (faults or {}).items():
            self.calls.append(("restore_fault", r, f["action"]))
            if f["action"] in ("kill_process", "kill_node"):
                self.die_on_restore.append(r)
            else:
                self.freeze_on_restore[r] = "machine" if f["action"] == "freeze_node" else "process"

    def _blocked(self, method: str, timeout_s: float, watch) -> None:
        """A member frozen or dead as a restore starts blocks every rank's restore, as its
        collectives do: waited for as `gather_watched` waits, on the fake clock."""
        for r, how in list(self.freeze_on_restore.items()):
            self.freeze(r, how)
        for r in self.die_on_restore:
            self.members[r].dead = True
        self.freeze_on_restore, self.die_on_restore = {}, []
        if not any(m.frozen_at is not None or m.dead for m in self.members.values()):
            return
        t0, lost = self.clock(), {}
        while not lost and self.clock() - t0 < timeout_s:
            self.clock.advance(0.2)
            lost = watch(set(self.members)) if watch else {}
        lost = lost or {r: "unresponsive" for r in self.members}
        bad = {r: lost.get(r, f"error: {method} was blocked on lost rank(s) {sorted(lost)}") for r in self.members}
        raise GroupError(f"{method} failed for ranks {sorted(bad)}: {bad}", bad)

    def _restored(self, step: int, source: str, uri: str | None = None) -> dict[int, RestoreResult]:
        for m in self.members.values():
            m.step = m.logged = step
            m.holds_state = True
        return {r: RestoreResult(step, source, 0.01, uri) for r in self.members}

    def restore(self, candidates, timeout_s, watch=None) -> dict[int, RestoreResult]:
        self.calls.append(("restore", len(candidates)))
        self._blocked("restore", timeout_s, watch)
        if not candidates:
            return self._restored(0, "init")
        if self.load_failures:
            why = self.load_failures.pop(0)
            return {r: RestoreResult(0, "none loaded", 0.01, skipped=tuple((u, why) for u in candidates))
                    for r in self.members}
        return self._restored(int(candidates[0].rsplit("_", 1)[1]), "storage", candidates[0])

    def restore_from_peer(self, src_rank: int, timeout_s: float, slot_sources: tuple = (),
                          watch=None, faults=None) -> dict[int, RestoreResult]:
        self._fire(faults)
        self.calls.append(("restore_from_peer", src_rank) if not slot_sources else
                          ("restore_from_peer", (src_rank, tuple(slot_sources))))
        self._blocked("restore_from_peer", timeout_s, watch)
        at = self.members[src_rank].step
        lacking = {r for r, m in self.members.items() if not m.holds_state or m.step != at}
        out = self._restored(at, f"peer rank {src_rank}")
        if self.state_bytes is None:
            return out
        self.clock.advance(self.transfer_s)
        return {r: replace(o, phases={"transfer": self.transfer_s}, state_bytes=self.state_bytes,
                           senders=len(out) - len(lacking), receivers=len(lacking),
                           received_bytes=self.state_bytes if r in lacking else 0) for r, o in out.items()}

    def restore_from_shards(self, offers, old_world, timeout_s, old_pp: int = 1,
                            copies_step: int | None = None, watch=None, faults=None) -> dict[int, RestoreResult]:
        self._fire(faults)
        self.calls.append(("restore_from_shards", old_world) if old_pp == 1 else
                          ("restore_from_shards", (old_world, old_pp)))
        self._blocked("restore_from_shards", timeout_s, watch)
        step = max(m.step for m in self.members.values())
        return self._restored(step, f"re-sharded in memory from {old_world} ranks")

    def memory_parts(self, sources: dict[int, int], step: int) -> dict:
        self.calls.append(("memory_parts", step, tuple(sorted(sources.items()))))
        return {r: ("part", h, step) for r, h in sources.items()}

    def keep_copies(self, sources: dict[int, int]) -> None:
        self.calls.append(("keep_copies", tuple(sorted(sources.items()))))

    def offer_shards(self, timeout_s: float, keep: frozenset = frozenset()):
        self.calls.append(("offer_shards", tuple(sorted(keep))))  # the ranks that keep their part
        return {r: object() for r in self.members}, []

    def request_stop(self, generation: int, timeout_s: float) -> dict[int, int]:
        self.calls.append(("request_stop", generation))
        for r, m in self.members.items():
            if r not in self.stop_undelivered:
                m.stop = True
        if self.stop_undelivered:
            bad = {r: "unresponsive" for r in self.stop_undelivered}
            self.stop_undelivered = set()
            raise GroupError(f"request_stop failed for ranks {sorted(bad)}", bad)
        return {r: m.step for r, m in self.members.items()}

    # ---------------------------------------------------------------- run and poll
    def run(self, num_steps: int, faults, skip_steps=(), buddies=None,
            evaluated_through: int = 0) -> dict[int, object]:
        self.calls.append(("run", num_steps))
        self.buddies = dict(buddies or {})
        self._num_steps = num_steps
        self._last_advance = self.clock()
        for m in self.members.values():
            m.running, m.run_out = True, None
        return {r: ("run", r, m.generation) for r, m in self.members.items()}

    def collect_runs(self, refs: dict, timeout_s: float):
        t0 = time.perf_counter()
        self.clock.advance(timeout_s)
        self._advance_training()
        results, died = {}, {}
        for r in list(refs):
            m = self.members.get(r)
            if m is None:
                continue
            if m.dead:
                died[r] = ("process_died", "killed")
                del refs[r]
            elif m.finish_at is not None and self.clock() >= m.finish_at:
                m.finish_at, m.run_out = None, self._done(m)
            if m.run_out is not None:
                results[r] = m.run_out
                del refs[r]
        self.self_s += time.perf_counter() - t0
        return results, died

    @staticmethod
    def _done(m: FakeRank) -> RunResult:
        return RunResult(RunStatus.DONE, m.step, m.generation, digest="d")

    def _answer(self, m: FakeRank) -> PollReport:
        persists, retried = [], []
        if m.rank == 0:
            persists = [PersistResult(m.step, u, committed=True, persist_s=1.0, attempts=1) for u in self.commits]
            self.commits = []
            retried, self.retried = self.retried, []
        compute_log = [StepRecord(s, self.step_s / 2 * (m.slow[1] if m.slow and 0 < s - m.slow[0] <= m.slow[2]
                                                        else 1.0), 1.0,
                                  t_end=self.t_start + s * self.step_s, step_s=self.step_s)
                       for s in range(m.logged + 1, m.step + 1)] if self.report_compute else []
        m.logged = m.step
        status = (RankStatus.STORAGE_WAIT if m.finish_at is not None else RankStatus.RUNNING if m.running
                  else RankStatus.IDLE)
        return PollReport(rank=m.rank, generation=m.generation, status=status, step=m.step, loss=1.0,
                          holds_state=m.holds_state,
                          step_s=self.step_s, compute_s=self.step_s / 2, persisting=self.persisting,
                          persists=tuple(persists), compute_log=tuple(compute_log), retried=tuple(retried))

    def poll_nowait(self, ping_timeout_s: float):
        t0 = time.perf_counter()
        now = self.clock()
        answers, silent = {}, {}
        self._polls_sent += len({m.node_id for m in self.members.values()})
        for r, m in self.members.items():
            if m.dead:
                silent[r] = "process_died"
            elif m.frozen_at is not None:
                if now - m.frozen_at > ping_timeout_s:
                    silent[r] = "unresponsive"
            else:
                answers[r] = self._answer(m)
        self.self_s += time.perf_counter() - t0
        return answers, silent

    def unanswered_s(self) -> dict[int, float]:
        now = self.clock()
        return {r: now - m.frozen_at for r, m in self.members.items() if m.frozen_at is not None and not m.dead}

    def control_traffic(self) -> dict[str, int]:
        return {"agent_polls": self._polls_sent, "direct_polls": 0, "heartbeat_pings": self._pings_sent}

    def beats(self, fresh_within_s: float = 0.0) -> dict:  # always fresh here
        if not self.heartbeats:
            return {}
        t0 = time.perf_counter()
        self._pings_sent += len({m.node_id for m in self.members.values()})
        now, out = self.clock(), _FakeBeats()
        for r, m in self.members.items():
            if m.frozen_at is None:
                out[r] = Beat(0.0, "R")
            elif m.frozen_how == "machine":
                out[r] = Beat(now - m.frozen_at, "R")  # its last answer, from before it stopped
            elif m.frozen_how == "refused":
                out[r] = Beat(now - m.frozen_at, "R", refused=True)
                out.refusing.append(r)
            elif not m.dead:
                out[r] = Beat(0.0, "T" if m.frozen_how == "process" else "S")
        self.self_s += time.perf_counter() - t0
        return out

    def poll(self, timeout_s: float):
        answers, silent = self.poll_nowait(0.0)
        for r in [r for r in answers if self.late_polls.get(r)]:
            self.late_polls[r] -= 1  # busy: its answer comes after this poll's timeout
            del answers[r]
            silent[r] = "unresponsive"
        return answers, silent

    def drain_polls(self, timeout_s: float) -> dict:
        return {}

    # ---------------------------------------------------------------- failure handling
    def kill(self, rank: int) -> None:
        self.calls.append(("kill", rank))
        self.members.pop(rank, None)

    def abort_all(self, generation: int, timeout_s: float, only=None) -> dict[int, str]:
        self.calls.append(("abort_all", generation))
        for r, m in self.members.items():
            if (only is None or r in only) and m.generation == generation and m.running and m.frozen_at is None:
                if self.late_returns.get(r):
                    continue  # it answered, but its run() returns only after that many waits
                m.running, m.run_out = False, RunResult(RunStatus.ABORTED, m.step, generation, error="aborted")
        return {r: "unresponsive" for r, m in self.members.items() if m.frozen_at is not None}

    def wait_runs(self, refs: dict, timeout_s: float) -> dict[int, str]:
        self.calls.append(("wait_runs", sorted(refs)))
        late = [r for r in refs if self.late_returns.get(r) and r in self.members]
        for r in late:
            self.late_returns[r] -= 1
            if not self.late_returns[r]:
                m = self.members[r]
                m.running, m.run_out = False, RunResult(RunStatus.ABORTED, m.step, m.generation, error="aborted")
        if late:
            self.clock.advance(timeout_s)
        return {r: "unresponsive" for r in refs if r in self.members and self.members[r].running}

    def where(self, ranks, timeout_s: float) -> dict[int, str | None]:
        return {r: "step.py:1 in all_reduce" for r in ranks if r in self.members and self.members[r].running}

    def save_again(self, timeout_s: float) -> dict[int, str]:
        tries = 1 + sum(name == "save_again" for name, _ in self.calls)
        self.calls.append(("save_again", tries))
        if self.save_again_s > timeout_s:
            self.clock.advance(timeout_s)
            return {r: "unresponsive" for r in self.members}
        self.clock.advance(self.save_again_s)
        if self.commit_on_save_again and tries >= self.commit_on_save_again:
            self.commits.append(f"memory://fake/step_{self.members[0].step:09d}")
        return {}

    def leave_all(self, timeout_s: float) -> dict[int, str]:
        return {}

    def shutdown(self) -> None:
        self.members.clear()
        self.ready_spares.clear()
        self._pending.clear()
