"""The controller actor: schedule -> run -> detect -> decide -> recover.

It holds no tensors. Every transition and every decision goes to the event
log with its reason. Detection, fastest signal first:
  * a survivor's collective fails the moment a peer's sockets close (process
    or node death), so its `run()` returns "aborted" at once;
  * Ray reports the dead actor (its `run()` or `poll()` raises);
  * a rank that answers no poll for `ping_timeout_s` while the group makes no
    progress is lost: a machine that stopped or was cut off, which closes no
    socket (Ray lists its node as alive for many seconds more). Its peers are
    blocked on it in a collective: the controller aborts their collectives,
    so they leave with their state (the memory path) instead of being killed;
  * no step completed for max(floor, k x median step): a hang; the ranks that
    do not answer are the culprits.

Every group formation is a new generation. Workers stamp their answers with
the generation they joined; an answer from an older one (a worker that was
frozen and came back) is ignored, and it may not write checkpoints (fence).
"""
from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections import deque

import ray

from elastic.observability import metrics as run_metrics
from elastic.checkpoint.persister import abandon_after, checkpoints_root, committed_checkpoints, latest_committed
from elastic.config import JobConfig
from elastic.checkpoint.fencing import FenceWriter, current_generation
from elastic.controller.states import (
    TERMINAL, Dropping, Errored, Finished, Forming, Growing, Recovering, Restoring, Running, RunWatch, Starting, State,
    Swapping)
from elastic.policies.failure import (
    FailureObservation, FromPeer, FromShards, FromStorage, LostRank, Raise, choose_restore, decide_failure,
    decide_none_loaded, decide_silence, detect_hang, excused_by_heartbeat)
from elastic.policies.straggler import (Drop, Report, StragglerState, Swap, decide_straggler, flagged, observe,
                                        slow_steps, span, window_ratios)
from elastic.storage import Storage, call_within, join
from elastic.parallel.strategies import STRATEGIES
from elastic.observability.events import EventLog
from elastic.parallel.topology import Layout, grow_to, reassign, shrink_to, stage_sources
from elastic.group.worker_group import GroupError, WorkerGroup, cause_of

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2


class Controller:
    def __init__(self, job_json: str, runtime_env: dict | None = None, *, group=None, clock=None, wall=None):
        """`group`, `clock` (monotonic seconds) and `wall` (epoch seconds) are for tests: a fake
        worker group and a fake clock drive the controller without Ray."""
        self.now = clock or time.monotonic
        self.wall = wall or time.time
        self._sleep = getattr(clock, "advance", None) or time.sleep  # a fake clock moves instead
        self.job = JobConfig.model_validate_json(job_json)
        ck = self.job.checkpoint
        self.storage = Storage(ck.storage_uri, ck.storage_options)
        self.run_dir = join(self.storage.uri, self.job.run.name)
        self.root = checkpoints_root(self.storage.uri, self.job.run.name)
        # Prometheus metrics (elastic.observability.metrics) are derived from every event as it is emitted, plus
        # the progress of each poll and each straggler window, which are not events.
        self.metrics = run_metrics.for_run(self.job.run.name, clock=self.now)
        self.events = EventLog(self.storage, self.run_dir, echo=self.metrics.on_event)
        self.fence = FenceWriter(self.storage, self.root)
        self.group = group or WorkerGroup(self.job, job_json, self.root, ray.get_runtime_context().current_actor,
                                          runtime_env)
        self.state: State = Starting()
        self.failures = 0
        self.pending_faults = [f.model_dump() for f in self.job.chaos]
        self._fault_lock = threading.Lock()
        self.last_fault: dict | None = None  # set by report_fault, consumed by recovery bookkeeping
        self._excused: set[int] = set()  # silent ranks kept alive by their heartbeat, this silent spell
        self._beats: dict = {}  # rank -> Beat at the run loop's last look (run_finished: heartbeat_ranks)
        self.step = 0
        self.max_step_seen = 0
        self.loss: float | None = None
        self.step_times: deque[float] = deque(maxlen=50)  # recent step times, for the hang bound
        self.last_progress_at = self.now()
        self.awaiting_first_step: dict | None = None  # recovery in progress until a step completes
        self.last_committed: str | None = None
        self.committed_steps: set[int] = set()  # steps whose checkpoint a rank reported committed
        self.run_refs: dict = {}
        self.restore_plan: FromPeer | FromShards | FromStorage = FromStorage()
        self.sharded = STRATEGIES[self.job.train.strategy].sharded
        self.offers: dict = {}  # a sharded state's parts, by old rank, taken at a planned stop
        self.resizing: dict | None = None  # a resize in progress until the first step at the new size
        self.stragglers = StragglerState()
        self.compute_log: dict[int, dict[int, float]] = {}  # rank -> {step: own compute seconds}
        self.loss_curve: dict[int, tuple[float, int]] = {}  # step -> (global mean loss, world size)
        self.next_straggler_step = 0  # the next step to fold into the straggler state
        self.world_size = self.job.scaling.num_workers  # changes on shrink and growth
        # Where ranks sit (elastic.parallel.topology): ddp and fsdp are (pp=1, dp=world); a pipeline's layout
        # walks the chain below `top` (replicas dropped, then stages) as capacity comes and goes.
        tr = self.job.train
        self.pipeline = tr.strategy == "pipeline"
        stages = tr.pipeline.stages if self.pipeline else 1
        self.top = Layout(stages, self.job.scaling.max_size // stages)
        self.layout = Layout(stages, self.world_size // stages)
        self._survivor_steps: dict[int, int] = {}  # old rank -> step, of the survivors of the last failure
        self.skip_steps: set[int] = set()  # steps whose batches a rollback skips (no update)
        self.skipped: dict[int, str] = {}  # step -> why it made no update (train.bad_step, fp16 overflow, rollback)
        # step -> (world size, {rank: sample ids}); a redone step replaces what the lost attempt wrote
        self.ledger: dict[int, tuple[int, dict[int, list[int]]]] = {}
        self._grow_checked_at = self.now()
        self.persisting: dict[int, bool] = {}  # rank -> a checkpoint persist of its was in flight at its last poll
        self._grow_deferred: tuple[str | None] | None = None  # (last committed checkpoint) while a grow waits for a persist
        self._swap_healthy_s = 0.0  # healthy ranks' median compute at the last Swap decision
        self._spares_checked_at = 0.0
        self.generation = 0  # bumped by every group formation
        self.rank_status: dict[int, str | None] = {}  # each rank's last reported status
        self._stale: set[tuple[int, int]] = set()  # (rank, generation) of stale answers already logged

    # ---------------------------------------------------------------- public (called from the driver / workers)
    def run(self) -> dict:
        self.events.emit("run_started", run=self.job.run.name, num_workers=self.job.scaling.num_workers,
                         num_steps=self.job.run.num_steps, run_dir=self.run_dir)
        try:
            while not isinstance(self.state, TERMINAL):
                self.step_once()
        except Exception as e:  # noqa: BLE001 - a controller bug must still end the run with a reason
            log.exception("controller failed")
            self._set_state(Errored(f"controller error: {type(e).__name__}: {e}"))
        finally:
            self.group.shutdown()
            self._write_metrics()
        st = self.state
        self.events.emit("run_finished" if isinstance(st, Finished) else "run_failed",
                         step=self.step, loss=self.loss, error=getattr(st, "error", None),
                         checkpoint=self.last_committed, slowest_poll_answer_s=round(self.group.slowest_poll_answer_s, 2),
                         heartbeat_ranks=sorted(self._beats))
        self.events.flush()
        return {"status": "finished" if isinstance(st, Finished) else "error",
                "error": getattr(st, "error", None), "step": self.step, "loss": self.loss,
                "checkpoint": self.last_committed, "digests": getattr(st, "digests", {}),
                "losses": {s: x for s, (x, _) in sorted(self.loss_curve.items())},
                "events": self.events.events, "run_dir": self.run_dir}

    def step_once(self) -> tuple[str, str]:
        """Exactly one iteration of the state machine; returns (previous state, new state) names."""
        prev = self.state
        handler = getattr(self, f"_on_{type(prev).__name__.lower()}")
        self._set_state(handler(prev))
        return type(prev).__name__, type(self.state).__name__

    def progress(self, since_event: int = 0) -> dict:
        return {"state": type(self.state).__name__, "step": self.step, "num_steps": self.job.run.num_steps,
                "loss": self.loss, "world_size": len(self.group.members), "failures": self.failures,
                "events": self.events.events[since_event:]}

    def is_current(self, generation: int) -> bool:
        """Whether `generation` is the run's newest group (a worker asks after its group failed)."""
        return generation == self.generation and not isinstance(self.state, TERMINAL)

    def report_fault(self, fault: dict, rank: int, step: int, t: float, pid: int | None = None,
                     generation: int | None = None, uploading: bool | None = None) -> None:
        with self._fault_lock:
            if fault in self.pending_faults:
                self.pending_faults.remove(fault)
        self.last_fault = {"action": fault["action"], "rank": rank, "step": step, "t": t}
        # The rank's own word on the step it reached, as good as a poll answer, and often newer
        # than the last poll: a resize measures its lost steps from the furthest step seen.
        self.max_step_seen = max(self.max_step_seen, step)
        self.events.emit("fault_injected", action=fault["action"], rank=rank, step=step, fault_t=t, pid=pid,
                         generation=generation, thaw_after_s=fault.get("thaw_after_s"), uploading=uploading,
                         hold_s=fault.get("hold_s"))

    @property
    def _grace_s(self) -> float:
        """How long an answer that should come at once may take (a rank leaving its group, a stop
        reaching every rank, storage during a recovery) before the controller goes on without it."""
        return self.job.failure.ping_timeout_s * 3

    # ---------------------------------------------------------------- states
    def _set_state(self, new: State) -> None:
        if type(new) is not type(self.state) or isinstance(new, Recovering):
            self.events.emit("state", old=type(self.state).__name__, new=type(new).__name__)
        self.state = new

    def _on_starting(self, _: Starting) -> State:
        self._continue_generations()
        n = self.job.scaling.num_workers
        try:
            self.group.start(list(range(n)), self.job.failure.replacement_timeout_s)
        except GroupError as e:
            return Errored(str(e))
        self.events.emit("workers_started", ranks=list(range(n)),
                         nodes={r: m.node_id[:12] for r, m in self.group.members.items()})
        self.group.add_spares(self.job.scaling.num_spares)
        if self.job.scaling.wait_for_spares and self.job.scaling.num_spares:
            t0 = self.now()
            ok = self.group.wait_spares_ready(self.job.failure.replacement_timeout_s)
            self.events.emit("spares_ready" if ok else "spares_not_ready", num_ready=len(self.group.ready_spares),
                             wait_s=self.now() - t0)
        return Forming()

    def _on_forming(self, _: Forming) -> State:
        t0 = self.now()
        cfg = self.job.failure
        self.generation += 1
        self._write_fence()
        try:
            slowest_ping_s = self.group.form(self.generation, cfg.rendezvous_timeout_s, cfg.ping_timeout_s,
                                             self.layout.pp)
        except GroupError as e:
            return self._lost_from(e, "group formation")
        extra = {"stages": self.layout.pp, "replicas": self.layout.dp} if self.pipeline else {}
        self.events.emit("group_formed", world_size=len(self.group.members), form_s=self.now() - t0,
                         generation=self.generation, slowest_ping_s=slowest_ping_s, **extra)
        return Restoring()

    def _on_restoring(self, _: Restoring) -> State:
        plan, self.restore_plan = self.restore_plan, FromStorage()
        if isinstance(plan, FromShards):
            try:
                out = self.group.restore_from_shards(plan.offers, plan.old_world, self.job.failure.collective_timeout_s,
                                                     plan.old_pp)
            except GroupError as e:
                return self._reshard_failed(e)
            return self._restored(out)
        if isinstance(plan, FromPeer):
            try:
                out = self.group.restore_from_peer(plan.src_rank, self.job.failure.collective_timeout_s,
                                                   plan.stage_sources)
            except GroupError as e:
                return self._lost_from(e, "restore from peer")
            return self._restored(out)
        return self._restore_from_storage(plan)

    def _restore_from_storage(self, plan: FromStorage) -> State:
        """List the committed checkpoints, then every rank loads the newest that loads. Both wait
        for storage, within checkpoint.restore_wait_s; a restore never starts over from step 0
        while committed checkpoints exist (the workers report "none loaded", not a fresh init)."""
        t0, delay, last_reasons = self.now(), 1.0, None
        while True:
            skipped: list[tuple[str, str]] = []
            candidates = self._committed_for_restore(skipped, t0)
            if isinstance(candidates, str):
                return Errored(candidates)
            if plan.max_step is not None:  # a rollback: nothing from the abandoned timeline
                candidates = [c for c in candidates if c.step <= plan.max_step]
            for uri, why in skipped:
                self.events.emit("checkpoint_skipped", uri=uri, reason=why)
            try:
                out = self.group.restore([c.uri for c in candidates], self.job.failure.collective_timeout_s)
            except GroupError as e:
                return self._lost_from(e, "restore")
            failed = out[0]["skipped"]
            for uri, why in failed:
                self.events.emit("checkpoint_skipped", uri=uri, reason=f"load failed: {why}")
            if out[0]["uri"] or not candidates:
                break
            reasons = [why for _, why in failed]
            waited = self.now() - t0
            verdict = decide_none_loaded(reasons, last_reasons, waited, self.job.checkpoint.restore_wait_s)
            if verdict is not None:
                newest = candidates[0].uri
                return Errored(f"none of the {len(candidates)} committed checkpoints loaded ({verdict}); the newest "
                               f"is {newest}, which failed with: {reasons[0][:300] if reasons else 'no reason given'}. "
                               f"The run does not start over from step 0 while they exist: run the job again once "
                               f"they load, or under a new run.name to start afresh")
            last_reasons = reasons
            delay = self._wait_for_storage("load a committed checkpoint", waited, reasons[0] if reasons else None,
                                           delay)
        if out[0]["uri"]:
            self.last_committed = out[0]["uri"]
        return self._restored(out)

    def _committed_for_restore(self, skipped: list, t0: float) -> list | str:
        """The committed checkpoints a restore from storage may load, newest first. The state
        can come from nowhere else, so a storage outage is waited out (`storage_unanswered`, with
        backoff), until checkpoint.restore_wait_s after `t0`; then why not, for the run's error."""
        limit = self.job.checkpoint.restore_wait_s
        delay = 1.0
        while True:
            found: list = []
            left = limit - (self.now() - t0)
            answered, out, error = call_within(
                lambda: committed_checkpoints(self.storage, self.root, on_skip=lambda u, r: found.append((u, r))),
                max(left, self._grace_s))
            if answered and error is None:
                skipped.extend(found)
                return out
            waited = self.now() - t0
            if waited >= limit:
                return (f"the state must be restored from storage, which did not answer for {waited:.0f} s "
                        f"(checkpoint.restore_wait_s): {str(error)[:300] if error else 'no answer'}; the newest "
                        f"committed checkpoint reported is {self.last_committed or 'none'}: run the job again "
                        f"once storage answers, to resume from it")
            delay = self._wait_for_storage("list committed checkpoints to restore from", waited,
                                           str(error) if error else None, delay)

    def _wait_for_storage(self, op: str, waited: float, error: str | None, delay: float) -> float:
        """One wait of a restore that can only come from storage: said (`storage_unanswered`), then
        slept, within checkpoint.restore_wait_s; returns the next wait (doubled, at most 15 s)."""
        self.events.emit("storage_unanswered", op=op, waited_s=round(waited, 1),
                         error=error[:300] if error else None,
                         using=f"nothing: the state can only come from storage; asking again in {delay:.0f} s")
        self._sleep(min(delay, max(0.0, self.job.checkpoint.restore_wait_s - waited)))
        return min(2 * delay, 15.0)

    def _reshard_failed(self, e: GroupError) -> State:
        """The in-memory re-shard could not read every part (a holder's node died) or a rank
        failed: dead ranks go through recovery; otherwise re-form and load from storage."""
        self.events.emit("reshard_failed", error=str(e)[:500], fallback="storage")
        self.offers = {}
        if any(cause_of(w) != "error" for w in e.ranks.values()):
            return self._lost_from(e, "re-shard")
        bad = self.group.leave_all(self._grace_s)
        if bad:
            return Recovering(tuple(LostRank(r, cause_of(w), w) for r, w in bad.items()), self.wall())
        if self.resizing is not None:
            self.resizing["path"] = "storage (after a failed re-shard in memory)"
        return Forming()

    def _restored(self, out: dict[int, dict]) -> State:
        r0 = out[0]
        assert all(o["step"] == r0["step"] for o in out.values()), f"ranks restored different steps: {out}"
        reached = self.max_step_seen  # the furthest any rank had trained before this restore
        self.step = self.max_step_seen = r0["step"]
        self.offers = {}
        slowest = max(out.values(), key=lambda o: o["restore_s"])
        restore_s = slowest["restore_s"]
        extra = {"phases": slowest["phases"]} if "phases" in slowest else {}  # the slowest rank's, where timed
        self.events.emit("restored", step=r0["step"], source=r0["source"], uri=r0["uri"], restore_s=restore_s,
                         world_size=len(out), **extra)
        if self.resizing is not None:
            self.resizing.update(restore_s=restore_s, source=r0["source"], resumed_step=r0["step"])
            self.resizing.setdefault("reached_step", reached)
        if self.awaiting_first_step is not None:
            self.awaiting_first_step["resumed_step"] = r0["step"]
        self.compute_log = {}
        self.stragglers.clear()
        self.next_straggler_step = r0["step"] + 1
        # Keep num_spares warm: replace the ones just used, drop extras started on demand, except
        # those that can bring a shrunk world back up (they wait for capacity, then we grow).
        headroom = self.job.scaling.max_size - self.world_size
        self.group.trim_spares(self.job.scaling.num_spares + headroom)
        # Refills start beside the training group: at low CPU priority until built.
        self.group.add_spares(self.job.scaling.num_spares - self.group.num_spares(), background=True)
        return Running()

    def _on_running(self, st: Running) -> State:
        """Start every rank's run(), then one observe -> decide iteration per call: the state
        machine steps through a run one poll at a time (and tests can drive it that way)."""
        if st.watch is None:
            with self._fault_lock:
                faults = list(self.pending_faults)
            self.run_refs = self.group.run(self.job.run.num_steps, faults, sorted(self.skip_steps))
            self.rank_status = {}
            self.last_progress_at = self.now()
            return Running(RunWatch(dict(self.run_refs)))
        return self._tick(st.watch) or st

    def _tick(self, w: RunWatch) -> State | None:
        """One iteration of the run loop: collect run() results and polls, then decide. None: go on."""
        cfg = self.job.failure
        results, died = self.group.collect_runs(w.refs, POLL_INTERVAL_S)
        for rank, (cause, detail) in died.items():
            w.lost[rank] = LostRank(rank, cause, detail)
        for rank, out in results.items():
            if out["status"] == "done":
                w.done[rank] = out
            elif out["status"] == "stopped":
                w.stopped.add(rank)
                self.max_step_seen = max(self.max_step_seen, out["step"])  # where a planned stop left training
            elif out["status"] == "rollback":
                w.rollback[rank] = out
            elif out["status"] == "user_error":
                self.events.emit("user_error", rank=rank, step=out["step"], error=out["error"],
                                 traceback=out.get("traceback"))
                return Recovering((), self.wall(), user_error=f"rank {rank} at step {out['step']}: {out['error']}")
            else:
                w.aborted.add(rank)
                self.events.emit("collective_failed", rank=rank, step=out["step"], error=out["error"][:300])
        answers, silent = self.group.poll_nowait(cfg.ping_timeout_s)
        self._absorb(answers)
        self._tend()
        for r, why in silent.items():
            if why != "unresponsive" and r not in w.lost:  # Ray says it is dead: no need to wait
                w.lost[r] = LostRank(r, cause_of(why), why)
        if w.failing_since is None:
            unanswered = self.group.unanswered_s()
            beats = self._beats = self.group.beats() if cfg.heartbeat else {}
            idle = self.now() - self.last_progress_at
            decision = decide_silence(silent, unanswered, idle, cfg, list(self.step_times), beats)
            self._note_excused(silent, unanswered, idle, beats)
            if decision is not None:
                # Silence while the others wait: a stopped or cut-off machine. Its peers are blocked on
                # it and will never see an error of their own; the recovery aborts their collectives.
                quiet, why = decision
                self.events.emit("silence_detected", ranks=list(quiet), reason=why,
                                 unanswered_s={r: round(unanswered[r], 2) for r in quiet},
                                 heartbeat={r: ({"age_s": round(beats[r].age_s, 2), "state": beats[r].state}
                                                if r in beats else None) for r in quiet})
                for r in quiet:
                    w.lost[r] = LostRank(r, "unresponsive", why)
                return Recovering(tuple(w.lost[r] for r in sorted(w.lost)), self.wall())
        members = set(self.group.members)
        # A stop is agreed in one all-reduce, so either every rank stopped or none did.
        if w.stopped and w.stopped == members and w.failing_since is None:
            if w.planned is not None:
                self._collect_reports()
                return w.planned
            # A stop nobody planned any more (the request reached only some ranks, and the plan
            # was dropped): carry on training.
            self.events.emit("stop_without_plan", step=self.step)
            return Running()
        if members and set(w.done) == members:
            return self._finish(w.done)
        if members and set(w.rollback) == members and w.failing_since is None:
            return self._rollback(next(iter(w.rollback.values()))["bad_steps"])
        if (w.lost or w.aborted) and w.failing_since is None:
            w.failing_since = self.now()
            # Start a replacement now, while we settle exactly who is lost: the slow part of a new
            # worker (process start, imports, model build) overlaps with detection.
            self.group.add_spares(max(len(w.lost), 1) - self.group.num_spares(), on_demand=True)
        if w.failing_since is not None:
            for r, why in silent.items():
                w.lost.setdefault(r, LostRank(r, cause_of(why), why))
            unaccounted = members - w.aborted - w.stopped - set(w.done) - set(w.lost)
            # Settled: every rank has failed its collective, finished, or is lost. Or the bound
            # passed: a rank that still answers pings but never aborts is dealt with as stuck.
            if not unaccounted or self.now() - w.failing_since > cfg.ping_timeout_s + 1.0:
                return Recovering(tuple(w.lost[r] for r in sorted(w.lost)), self.wall())
            return None
        if w.planned is None and self.job.stragglers.enabled:
            w.planned = self._check_stragglers()
        if w.planned is None:
            w.planned = self._check_growth()
        # Ranks that are done are waiting for nobody: at the last step DDP's rank 0 commits alone,
        # after the others' part of the persist ended and they returned.
        waiting = members - set(w.done)
        if waiting and all(self.rank_status.get(r) == "storage_wait" for r in waiting):
            # Every rank waits for a persist (storage slow or down): not a hang. Persists retry with
            # backoff and then fail, reported; training never pays for storage with a step.
            if not w.storage_wait_logged:
                w.storage_wait_logged = True
                self.events.emit("storage_wait", step=self.step,
                                 reason="every rank waits for a checkpoint persist; not counted as a hang")
            self.last_progress_at = self.now()
        hung, reason = detect_hang(self.last_progress_at, list(self.step_times), cfg, self.now())
        if hung:
            culprits = silent or {r: "no progress" for r in members}
            self.events.emit("hang_detected", reason=reason, ranks=sorted(culprits),
                             heartbeat={r: {"age_s": round(b.age_s, 2), "state": b.state, "cpu_ticks": b.cpu_ticks}
                                        for r, b in sorted(beats.items()) if r in culprits})
            return Recovering(tuple(LostRank(r, "hang", reason) for r in culprits), self.wall())
        return None

    def _note_excused(self, silent: dict[int, str], unanswered: dict[int, float], idle: float, beats: dict) -> None:
        """Once per silent spell: a rank the poll-only rule would have called lost, kept because its
        heartbeat says the process runs (its Python is held, its machine is up)."""
        self._excused &= {r for r, why in silent.items() if why == "unresponsive"}
        excused = excused_by_heartbeat(silent, unanswered, idle, self.job.failure, list(self.step_times), beats)
        for r, state in sorted(excused.items()):
            if r not in self._excused:
                self._excused.add(r)
                self.events.emit("silence_excused", rank=r, step=self.step, unanswered_s=round(unanswered[r], 2),
                                 idle_s=round(idle, 2), state=state, heartbeat_age_s=round(beats[r].age_s, 2))

    def _rollback(self, bad_steps: list[int]) -> State:
        """train.bad_step=rollback: bad_step_limit steps in a row made no update. Every rank stopped
        at the same step; back to the newest checkpoint committed before the first of them, and
        skip every batch from there to the last (a replay of the same batches would go bad
        again). The checkpoints of the abandoned timeline are un-committed."""
        self._collect_reports()
        first, last = min(bad_steps), max(bad_steps)
        before = [c for c in committed_checkpoints(self.storage, self.root) if c.step < first]
        to_step = before[0].step if before else 0
        abandoned = abandon_after(self.storage, self.root, to_step)
        self.committed_steps = {st for st in self.committed_steps if st <= to_step}
        self.skip_steps |= set(range(to_step + 1, last + 1))
        self.events.emit("rolled_back", to_step=to_step, bad_steps=bad_steps, skip_from=to_step + 1, skip_to=last,
                         abandoned=abandoned,
                         reason=f"{len(bad_steps)} bad steps in a row (train.bad_step_limit="
                                f"{self.job.train.bad_step_limit}): back to step {to_step}, skipping the batches of "
                                f"steps {to_step + 1}..{last}")
        self.restore_plan = FromStorage(max_step=to_step)
        self.run_refs = {}
        return Restoring()

    def _finish(self, done: dict[int, dict]) -> Finished:
        # Every run() waited for its last persist: collect those reports. Storage has the last
        # word on what is committed.
        self._collect_reports()
        self.step = max(o["step"] for o in done.values())
        if self.job.run.sample_ledger:
            self._write_ledger()
        missing = self._final_checkpoint()
        digests = {r: o["digest"] for r, o in done.items()}
        # Replicas of the same stage hold the same state (ddp: every rank; a pipeline: per stage).
        by_stage = {s: {d for r, d in digests.items() if self.layout.stage_of(r) == s} for s in range(self.layout.pp)}
        self.events.emit("final_state", step=self.step, digests=digests,
                         replicas_identical=all(len(ds) <= 1 for ds in by_stage.values()))
        return Errored(missing) if missing else Finished(digests)

    def _final_checkpoint(self) -> str | None:
        """The run's last checkpoint is what a user takes away: if it did not commit (storage out
        for longer than the persist's retries, or the new generation's fence not landed after a
        recovery), the ranks still hold the final state, so they save it again until it commits,
        within checkpoint.final_wait_s. Returns None once it is committed, else why not."""
        cfg = self.job.checkpoint
        t0 = self.now()
        attempts = 0
        while True:
            answered, latest, error = call_within(lambda: latest_committed(self.storage, self.root), self._grace_s)
            if answered and error is None and latest is not None:
                self.last_committed = latest.uri
            if self.step in self.committed_steps or (answered and latest is not None and latest.step >= self.step):
                if attempts:
                    self.events.emit("final_checkpoint_committed", step=self.step, attempts=attempts,
                                     waited_s=round(self.now() - t0, 2), uri=self.last_committed)
                return None
            left = cfg.final_wait_s - (self.now() - t0)
            if left <= 0:
                why = (f"trained all {self.step} steps, but the final checkpoint did not commit "
                       f"({attempts} more save(s) in {self.now() - t0:.0f} s, checkpoint.final_wait_s="
                       f"{cfg.final_wait_s:g}); the newest committed checkpoint is "
                       f"{self.last_committed or 'none'}: resume from it once storage answers, or raise "
                       f"checkpoint.final_wait_s")
                self.events.emit("final_checkpoint_missing", step=self.step, attempts=attempts,
                                 waited_s=round(self.now() - t0, 2), newest=self.last_committed)
                return why
            attempts += 1
            self.events.emit("final_checkpoint_retry", step=self.step, attempt=attempts,
                             newest=self.last_committed, left_s=round(left, 1))
            bad = self.group.save_again(left)
            self._collect_reports()
            if bad and self.now() - t0 < cfg.final_wait_s:  # else: the time ran out during the save
                return (f"trained all {self.step} steps, but the final checkpoint did not commit, and rank(s) "
                        f"{sorted(bad)} did not finish saving it again ({'; '.join(set(bad.values()))[:300]}); "
                        f"the newest committed checkpoint is {self.last_committed or 'none'}")

    def _on_recovering(self, st: Recovering) -> State:
        cfg = self.job.failure
        self.resizing = None  # a planned resize cut short by a failure: the recovery decides the size
        fault = self.last_fault
        # Storage, not what polls happened to report before the fault, says what is committed,
        # when it answers: an outage at the same time must not hold up a recovery that may not
        # need storage at all (from the survivors' memory). Else the last commit reported stands.
        answered, latest, error = call_within(lambda: latest_committed(self.storage, self.root), self._grace_s)
        if answered and error is None:
            self.last_committed = latest.uri if latest else None
        else:
            self.events.emit("storage_unanswered", op="list committed checkpoints", waited_s=self._grace_s,
                             error=str(error)[:300] if error else None,
                             using=f"the last commit reported: {self.last_committed or 'none'}")
        obs = FailureObservation(st.lost, len(self.group.members), self.failures, st.user_error, self.last_committed)
        decision, reason = decide_failure(obs, cfg, self.wall())
        self.events.emit("failure_detected", lost=[x.__dict__ for x in st.lost], step=self.step,
                         detect_s=(st.detected_at - fault["t"]) if fault else None)
        self.events.emit("decision", decision=type(decision).__name__, ranks=list(getattr(decision, "ranks", ())),
                         reason=reason)
        if isinstance(decision, Raise):
            return Errored(decision.error)
        self.failures += 1
        if self.awaiting_first_step is None:  # a failure during a recovery keeps the original fault
            fault_step = fault["step"] if fault else self.max_step_seen
            self.awaiting_first_step = {"fault_t": fault["t"] if fault else st.detected_at,
                                        "detected_t": st.detected_at, "fault_step": fault_step}
        self.last_fault = None
        t0 = self.now()
        causes = {x.rank: x.cause for x in st.lost}
        for x in decision.ranks:
            m = self.group.members.get(x)
            if m is not None and causes.get(x) != "process_died":
                # Its machine may be stopped or cut off while Ray still lists it as alive: place
                # nothing new there until it answers again.
                self.group.suspect(m.node_id)
            self.group.kill(x)
        # A survivor blocked in a collective on a silent peer never sees an error of its own: abort
        # its collectives (a stale abort is ignored), so run() returns with the state of its last
        # completed step. One that still does not return cannot safely join a new group: replace it.
        grace_s = self._grace_s
        unanswered = self.group.abort_all(self.generation, grace_s)
        # Which of the two a survivor missed goes into the event: they fail for different reasons.
        stuck = {r: (why, "its run() did not return after the abort")
                 for r, why in self.group.wait_runs(self.run_refs, grace_s).items()}
        for r, why in self.group.leave_all(grace_s).items():
            stuck.setdefault(r, (why, "it did not leave its group"))
        self.run_refs = {}
        if self.group.suspect_nodes or unanswered:
            self.events.emit("collectives_aborted", generation=self.generation,
                             ranks=sorted(r for r in self.group.members if r not in unanswered),
                             unanswered=unanswered, suspect_nodes=sorted(n[:12] for n in self.group.suspect_nodes))
        for rank, (why, what) in stuck.items():
            self.events.emit("worker_replaced", rank=rank, reason=f"{what} within {grace_s:g} s: {why}")
            if cause_of(why) != "process_died" and rank in self.group.members:
                self.group.suspect(self.group.members[rank].node_id)
            self.group.kill(rank)
        answers, silent = self._collect_reports(cfg.ping_timeout_s, progress=False)
        for rank in silent:
            self.group.kill(rank)
        self._survivor_steps = {r: a["step"] for r, a in answers.items()}
        self.restore_plan, why = choose_restore(self._survivor_steps, cfg, self.sharded, self.layout)
        self.events.emit("restore_plan", source=type(self.restore_plan).__name__, reason=why)
        sc = self.job.scaling
        missing = [r for r in range(self.world_size) if r not in self.group.members]
        may_shrink = sc.min_size <= len(self.group.members) < self.world_size
        try:
            how = self.group.promote(missing, sc.shrink_after_s if may_shrink else cfg.replacement_timeout_s,
                                     cfg.ping_timeout_s)
        except GroupError as e:
            if len(self.group.members) < sc.min_size:
                return Errored(f"{e}; scaling.min_workers={sc.min_size}; "
                               f"last committed checkpoint: {self.last_committed or 'none'}")
            return self._shrink(str(e), t0)
        self.events.emit("workers_replaced", ranks=missing, start_s=self.now() - t0, how=how,
                         nodes={r: self.group.members[r].node_id[:12] for r in missing})
        return Forming()

    def _check_stragglers(self) -> Swapping | None:
        """Fold every step all ranks have reported into the straggler state, one at a time (the
        policy's window slides by one step); log the window every `window_steps` steps; on a
        Swap decision, ask all ranks to stop at a common step boundary a few steps ahead."""
        sc = self.job.stragglers
        ranks = list(self.group.members)
        while all(self.next_straggler_step in self.compute_log.get(r, {}) for r in ranks):
            step = self.next_straggler_step
            self.next_straggler_step += 1
            observe(self.stragglers, {r: self.compute_log[r].pop(step) for r in ranks}, sc)  # folded in once
            if step % sc.window_steps == 0:
                ratios = window_ratios(self.stragglers, sc)
                self.metrics.on_window(ratios)
                recent = slow_steps(self.stragglers, sc, sc.window_steps)
                slow = [r for r in ranks if 2 * recent.get(r, 0) > sc.window_steps]
                if slow:
                    total = slow_steps(self.stragglers, sc)
                    self.events.emit("slow_window", step=step, ratios={r: round(x, 2) for r, x in ratios.items()},
                                     slow_steps={r: total[r] for r in slow}, of=span(sc))
            suspects = flagged(self.stragglers, sc)
            if not suspects:
                continue
            healthy = [statistics.median(list(self.stragglers.compute_s[r])) for r in ranks
                       if r not in suspects and self.stragglers.compute_s.get(r)]
            healthy_s = statistics.median(healthy) if healthy else 0.0
            self.group.refresh_spares()
            # A spare started on demand for a recovery and kept has not been calibrated yet: six
            # computes of a rank's share; a spare that needs more than ten healthy ones is no use.
            self.group.lost_spares += self.group.calibrate_spares(
                max(self.job.failure.ping_timeout_s * 5, 10 * healthy_s))
            decision, reason = decide_straggler(self.stragglers, sc, self.now(),
                                                [m.calib_s for m in self.group.ready_spares if m.calib_s],
                                                healthy_s, may_shrink=self.world_size > self.job.scaling.min_size)
            if isinstance(decision, Report) and decision.rank not in self.stragglers.reported:
                self.stragglers.reported.add(decision.rank)
                self.events.emit("decision", decision="Report", ranks=[decision.rank], reason=reason, step=step)
            if isinstance(decision, (Swap, Drop)):
                self.stragglers.last_action_t = self.now()
                self.events.emit("decision", decision=type(decision).__name__, ranks=[decision.rank],
                                 reason=reason, healthy_compute_s=healthy_s, step=step)
                if not self._request_stop():
                    return None
                if isinstance(decision, Swap):
                    self._swap_healthy_s = healthy_s
                    return Swapping(decision.rank, reason)
                self._begin_resize(self.world_size - 1, reason)
                return Dropping(decision.rank, reason)
        return None

    def _request_stop(self) -> bool:
        """Ask every rank to stop at a common step boundary. False when a rank cannot be asked:
        it is failing anyway, and the failure path takes over."""
        try:
            self.group.request_stop(self.generation, self._grace_s)
        except GroupError:
            return False
        return True

    def _begin_resize(self, new_world: int, reason: str) -> None:
        self.resizing = {"decided_t": self.wall(), "old_world_size": self.world_size,
                         "new_world_size": new_world, "reason": reason}

    def _planned_plan(self, old_world: int, src_rank: int = 0,
                      old_layout: Layout | None = None) -> FromPeer | FromShards | FromStorage:
        """How state reaches the new group after a planned stop (every old rank alive, all at
        the same step): rank `src_rank`'s broadcast (ddp), a re-shard of every rank's offered
        part (fsdp), or, with failure.peer_restore off, the checkpoint taken at the stop. A
        pipeline that keeps its stages copies each stage from replica 0 (ranks 0..pp-1, which
        keep their numbers); one re-partitioned moves every unit's state by name."""
        if not self.job.failure.peer_restore:
            return FromStorage()
        if self.pipeline and old_layout is not None:
            if old_layout.pp == self.layout.pp:
                return FromPeer(0, self.step, tuple(range(self.layout.pp)))
            return FromShards(self.offers, old_world, self.step, old_layout.pp)
        if self.sharded:
            return FromShards(self.offers, old_world, self.step)
        return FromPeer(src_rank, self.step)

    def _path(self, plan) -> str:
        return "storage" if isinstance(plan, FromStorage) else "memory"

    def _leave_for_planned_change(self, leaving: int | None = None) -> Recovering | None:
        """Every rank stopped at the same boundary; a sharded state's parts are offered before the
        ranks drop the group: kept in memory by the ranks that stay (moved rank to rank at the
        restore), put in the object store by the one `leaving` and by a pipeline's ranks (whose
        re-partition moves state by name). A rank that cannot turns the planned change into a
        recovery."""
        self.run_refs = {}
        self.offers = {}
        if (self.sharded or self.pipeline) and self.job.failure.peer_restore:
            keep = frozenset() if self.pipeline else frozenset(r for r in self.group.members if r != leaving)
            self.offers, late = self.group.offer_shards(self.job.failure.collective_timeout_s, keep)
            if late:
                return Recovering(tuple(LostRank(r, "unresponsive", "did not offer its shards") for r in late),
                                  self.wall())
        bad = self.group.leave_all(self._grace_s)
        if bad:
            return Recovering(tuple(LostRank(r, cause_of(w), w) for r, w in bad.items()), self.wall())
        return None

    def _on_swapping(self, st: Swapping) -> State:
        """A planned replacement at a step boundary: nothing is lost, the spare gets state from a
        healthy rank's memory."""
        cfg = self.job.failure
        t0 = self.now()
        failed = self._leave_for_planned_change(leaving=st.rank)
        if failed:
            return failed
        max_calib = self.job.stragglers.threshold * self._swap_healthy_s
        old = self.group.members[st.rank]
        self.group.kill(st.rank)
        spare = self.group.take_spare_for(st.rank, max_calib, cfg.ping_timeout_s)
        how = "warm spare"
        if spare is None:
            self.group.promote([st.rank], cfg.replacement_timeout_s, cfg.ping_timeout_s)
            how = "started on demand"
        src = min(r for r in self.group.members if r != st.rank)
        self.restore_plan = self._planned_plan(self.world_size, src)
        self.events.emit("swapped", rank=st.rank, how=how, old_node=old.node_id[:12],
                         new_node=self.group.members[st.rank].node_id[:12], swap_s=self.now() - t0,
                         spare_calib_s=spare.calib_s if spare else None)
        return Forming()

    def _continue_generations(self) -> None:
        """A resubmitted run (same name: a new `ray job submit`, or the driver rerun after a head
        loss) numbers its generations on from the fence an earlier submission left, so a zombie
        of that submission (a frozen node that comes back) holds an older generation than every
        group of this one and can never pass the fence."""
        answered, prior, error = call_within(lambda: current_generation(self.storage, self.root), self._grace_s)
        if not answered or error is not None:
            self.events.emit("storage_unanswered", op="read the fence", waited_s=self._grace_s,
                             error=str(error)[:300] if error else None,
                             using="generation 1 (an earlier submission's zombie is then fenced only "
                                   "until this run reaches its generation)")
        elif prior:
            self.generation = prior
            self.events.emit("generations_continued", after=prior)

    def _write_fence(self) -> None:
        """The fence: the newest generation, in storage beside the checkpoints. A worker may write
        checkpoints only while the fence shows its own generation (a frozen worker that comes back
        finds itself fenced off). Written before the group forms when storage answers within 3 x
        ping_timeout_s; else (an outage) the group forms anyway, the write goes on in the
        background until it lands, and until then this generation writes no checkpoint."""
        wait_s = self._grace_s
        if not self.fence.announce(self.generation, wait_s):
            why = f"failed: {self.fence.last_error}" if self.fence.last_error else "no answer"
            self.events.emit("fence_not_written", generation=self.generation,
                             error=f"storage did not take the fence within {wait_s:.1f} s ({why})"[:300],
                             then="written in the background until it lands; no checkpoint of this "
                                  "generation is written before")

    def _write_metrics(self) -> None:
        """metrics.json: the loss of every step and the world size it ran at (redone steps: the
        attempt that counted)."""
        body = {str(s): {"loss": x, "world_size": w} for s, (x, w) in sorted(self.loss_curve.items())}
        try:
            self.storage.write_bytes(join(self.run_dir, "metrics.json"), json.dumps(body).encode())
        except Exception as e:  # noqa: BLE001 - metrics are best effort; the run's outcome is not
            log.warning("metrics.json not written: %s", e)

    def _write_ledger(self) -> None:
        """ledger.json: for every step, the world size it ran at and each rank's sample ids."""
        body = {str(s): {"world_size": w, "ranks": {str(r): ids for r, ids in sorted(by_rank.items())},
                         **({"skipped": self.skipped[s]} if s in self.skipped else {})}
                for s, (w, by_rank) in sorted(self.ledger.items())}
        self.storage.write_bytes(join(self.run_dir, "ledger.json"), json.dumps(body).encode())

    def _shrink(self, why: str, t0: float) -> State:
        """Go on with the ranks we have: renumber them 0..k-1 and re-form. The global batch and the
        sample order do not change; each rank's share of the batch grows."""
        old = self.world_size
        reason = (f"no replacement within scaling.shrink_after_s={self.job.scaling.shrink_after_s}s "
                  f"({why.splitlines()[0][:200]}); scaling.min_workers={self.job.scaling.min_size}")
        if self.pipeline:
            return self._replan(reason, t0)
        self._begin_resize(len(self.group.members), reason)
        mapping = self.group.renumber()
        self.world_size = len(self.group.members)
        self.layout = Layout(1, self.world_size)
        if isinstance(self.restore_plan, FromPeer):
            self.restore_plan = FromPeer(mapping[self.restore_plan.src_rank], self.restore_plan.step)
        self.resizing["path"] = self._path(self.restore_plan)
        self.events.emit("resized", old_world_size=old, new_world_size=self.world_size, path=self.resizing["path"],
                         reason=reason, decide_s=self.now() - t0)
        return Forming()

    def _replan(self, reason: str, t0: float) -> State:
        """A pipeline short of ranks: the largest layout the survivors fill (elastic.parallel.topology).
        Whole replicas go first, each stage keeping a survivor that holds it, whose memory the
        new group copies; with one replica left the model is re-partitioned over fewer stages,
        and the lost stage's layers come from the latest committed checkpoint (DCP reads them
        by name into the new stages)."""
        old, old_world = self.layout, self.world_size
        new = shrink_to(self.top, len(self.group.members), self.job.scaling.min_size)
        mapping = reassign(old, sorted(self.group.members), new)
        self.group.renumber(mapping)
        self.layout, self.world_size = new, new.world_size
        sources = stage_sources(old, mapping, new, self._survivor_steps) if self.job.failure.peer_restore else None
        if sources:
            self.restore_plan = FromPeer(sources[0], max(self._survivor_steps.values()), sources)
        else:
            self.restore_plan = FromStorage()
        self._begin_resize(new.world_size, reason)
        self.resizing["path"] = self._path(self.restore_plan)
        self.events.emit("resized", old_world_size=old_world, new_world_size=self.world_size,
                         path=self.resizing["path"], reason=reason, decide_s=self.now() - t0,
                         old_layout=str(old), new_layout=str(new))
        return Forming()

    def _defer_for_persist(self, n: int) -> bool:
        """A planned stop waits for the persist in flight with every rank idle. So while one runs,
        the grow waits instead and training goes on; once that persist is over (committed or
        failed), the stop is requested even if the next one has started, so frequent checkpoints
        cannot put a grow off for more than one persist."""
        busy = any(self.persisting.get(r) for r in self.group.members)
        if self._grow_deferred is None:
            if not busy:
                return False
            self._grow_deferred = (self.last_committed,)
            self.events.emit("grow_deferred", ranks=list(range(self.world_size, self.world_size + n)),
                             reason="a checkpoint persist is in flight: training goes on until it is over, "
                                    "then the group stops at a step boundary and grows")
            return True
        if busy and (self.last_committed,) == self._grow_deferred:
            return True
        self._grow_deferred = None
        return False

    def _check_growth(self) -> Growing | None:
        """Below max_workers, keep workers waiting for capacity; once some are warm, plan a stop
        at a step boundary and grow (never in the middle of a step or of a checkpoint persist)."""
        sc = self.job.scaling
        now = self.now()
        if self.world_size >= sc.max_size or now - self._grow_checked_at < sc.grow_check_s:
            return None
        self._grow_checked_at = now
        want = sc.max_size - self.world_size
        # Queued until capacity exists. Not calibrated first: a worker wanted to grow the world takes a
        # rank as soon as it is built (calibration cost 4.4 s of a 1 GB grow here); one that stays a
        # spare is calibrated when a straggler decision first weighs it.
        self.group.add_spares(sc.num_spares + want - self.group.num_spares(), calibrate=False)
        self.group.refresh_spares()
        extra = len(self.group.ready_spares) - sc.num_spares
        if extra < 1:
            return None
        n = min(extra, want)
        if self.pipeline:  # whole layouts only: a stage more, or a replica more
            target = grow_to(self.top, self.layout, n)
            if target is None:
                return None
            n = target.world_size - self.world_size
        if self._defer_for_persist(n):
            return None
        if not self._request_stop():
            return None
        reason = (f"{n} warm worker(s) available and world size {self.world_size} < "
                  f"scaling.max_workers={sc.max_size}: grow at the next step boundary")
        self.events.emit("decision", decision="Grow", ranks=list(range(self.world_size, self.world_size + n)),
                         reason=reason)
        self._begin_resize(self.world_size + n, reason)
        return Growing(n)

    def _on_growing(self, st: Growing) -> State:
        t0 = self.now()
        failed = self._leave_for_planned_change()
        if failed:
            return failed
        old = self.world_size
        old_layout = self.layout
        new_ranks = list(range(old, old + st.num_new))
        try:
            self.group.promote(new_ranks, self.job.failure.replacement_timeout_s, self.job.failure.ping_timeout_s)
        except GroupError:
            if self.pipeline:  # whole layouts only: back to the old one
                for r in new_ranks:
                    self.group.kill(r)
            else:
                self.group.renumber()  # whatever joined keeps consecutive ranks
        self.world_size = len(self.group.members)
        if self.pipeline:
            self.layout = grow_to(self.top, old_layout, self.world_size - old) or old_layout
        else:
            self.layout = Layout(1, self.world_size)
        self.restore_plan = self._planned_plan(old, old_layout=old_layout)
        self.resizing.update(new_world_size=self.world_size, path=self._path(self.restore_plan))
        self.events.emit("resized", old_world_size=old, new_world_size=self.world_size, path=self.resizing["path"],
                         reason="capacity appeared", decide_s=self.now() - t0)
        return Forming()

    def _on_dropping(self, st: Dropping) -> State:
        """A straggler with no spare to take its place, and the world may shrink: stop at a
        step boundary, let it hand over its part of the state, and go on without it."""
        t0 = self.now()
        failed = self._leave_for_planned_change(leaving=st.rank)
        if failed:
            return failed
        old = self.world_size
        node = self.group.members[st.rank].node_id[:12]
        self.group.kill(st.rank)  # a sharded state's offer outlives the process (object store)
        self.group.renumber()
        self.world_size = len(self.group.members)
        self.layout = Layout(1, self.world_size)
        self.restore_plan = self._planned_plan(old)
        self.resizing.update(new_world_size=self.world_size, path=self._path(self.restore_plan))
        self.events.emit("resized", old_world_size=old, new_world_size=self.world_size, path=self.resizing["path"],
                         reason=f"rank {st.rank} dropped (node {node}): {st.reason}", decide_s=self.now() - t0)
        return Forming()

    def _tend(self) -> None:
        """Background care, every 2 s: suspect nodes that answer again become usable; spares that
        finished warming are noticed, dead ones replaced."""
        now = self.now()
        if now - self._spares_checked_at < 2.0:
            return
        self._spares_checked_at = now
        for node in self.group.probe_suspects():
            self.events.emit("node_cleared", node=node[:12], reason="answers again, or Ray declared it dead")
        if self.job.scaling.num_spares == 0:
            return
        lost = self.group.refresh_spares() + self.group.check_spares(self.job.failure.ping_timeout_s)
        lost += self.group.lost_spares
        self.group.lost_spares = []
        for node, pid, low in self.group.newly_ready:
            self.events.emit("spare_ready", node=node, pid=pid, num_ready=len(self.group.ready_spares),
                             started_low=low)
        self.group.newly_ready.clear()
        for why in lost:
            self.events.emit("spare_lost", reason=why)
        if lost:
            self.group.add_spares(self.job.scaling.num_spares - self.group.num_spares(), background=True)

    # ---------------------------------------------------------------- helpers
    def _lost_from(self, e: GroupError, during: str) -> State:
        """Only ranks that are gone or silent are lost. A rank whose join or restore raised because
        a peer failed is a survivor: it keeps its state, which may be the newest there is."""
        gone = {r: w for r, w in e.ranks.items() if cause_of(w) != "error"}
        survivors = sorted(r for r in e.ranks if r not in gone)
        self.events.emit("group_error", during=during, error=str(e)[:500], lost=sorted(gone), survivors=survivors)
        return Recovering(tuple(LostRank(r, cause_of(w), _last_line(w)) for r, w in gone.items()), self.wall())

    def _collect_reports(self, timeout_s: float | None = None, progress: bool = True):
        """Before the group changes: the polls in flight and one more carry the last reports.
        Returns the fresh poll's (answers, silent). During a recovery only the reports are folded
        in: progress from before the fault must not count as a step of the recovered group."""
        timeout_s = timeout_s or self.job.failure.ping_timeout_s * 5
        absorb = self._absorb if progress else (lambda a: self._absorb_reports(self._current(a)))
        absorb(self.group.drain_polls(timeout_s))
        answers, silent = self.group.poll(timeout_s)
        absorb(answers)
        return answers, silent

    def _absorb(self, answers: dict[int, dict]) -> None:
        """Fold polled progress into run-level progress and events."""
        answers = self._current(answers)
        self._absorb_reports(answers)
        self._absorb_progress(answers)

    def _current(self, answers: dict[int, dict]) -> dict[int, dict]:
        """Answers of the current generation only: one from an older generation comes from a
        worker that was cut off (a frozen machine that came back) and describes a group that no
        longer exists."""
        out = {}
        for r, a in answers.items():
            g = a.get("generation")
            if g is None or g == self.generation:
                out[r] = a
            elif (r, g) not in self._stale:
                self._stale.add((r, g))
                self.events.emit("stale_report_ignored", rank=r, generation=g, current_generation=self.generation)
        return out

    def _absorb_reports(self, answers: dict[int, dict]) -> None:
        """Persist results, compute times and the sample ledger: each is reported once, so every
        answer that carries them must be folded in, also those polled during a recovery."""
        for rank, a in answers.items():
            for p in a.get("persists", []):
                if p["committed"]:
                    self.last_committed = p["uri"]
                    self.committed_steps.add(p["step"])
                    self.events.emit("checkpoint_committed", step=p["step"], uri=p["uri"],
                                     persist_s=p["persist_s"], stall_s=p.get("stall_s"), attempts=p["attempts"],
                                     loss=p["metrics"].get("loss"))
                elif p.get("error"):
                    self.events.emit("checkpoint_failed", rank=rank, step=p["step"], error=p["error"][:300])
            for step in a.get("abandoned", []):
                self.events.emit("persist_abandoned", rank=rank, step=step,
                                 reason="its group failed, so it can never commit, and its write could not be "
                                        "cut short (a synchronous filesystem, or a file still being written): "
                                        "the rank left it to end on its own, and its next persist waits for it "
                                        "before writing")
        for step, why in sorted({(s, w) for a in answers.values() for s, w in a.get("skipped", [])}):
            if self.skipped.get(step) != why:
                self.skipped[step] = why
                self.events.emit("step_skipped", step=step, reason=why)
        for step in sorted({s for a in answers.values() for s in a.get("retried", [])}):
            self.events.emit("checkpoint_retry", step=step,
                             reason="a checkpoint failed on storage: saved again at this step, the first after "
                                    "its wait, not left to the next checkpoint step")
        for step in sorted({s for a in answers.values() for s in a.get("deferred", [])}):
            self.events.emit("checkpoint_deferred", step=step,
                             reason="the previous persist is still running (storage slow or down); training goes "
                                    "on, and the next checkpoint step saves again")
        for rank, a in answers.items():
            for step, compute_s, loss in a.get("compute_log", []):
                if self.job.stragglers.enabled:
                    self.compute_log.setdefault(rank, {})[step] = compute_s
                self.loss_curve[step] = (loss, self.world_size)  # a redone step replaces the lost attempt
            for step, world, r, ids in a.get("ledger", []):
                entry = self.ledger.get(step)
                if entry is None or entry[0] != world or r in entry[1]:  # a new attempt at this step
                    entry = self.ledger[step] = (world, {})
                entry[1][r] = ids

    def _absorb_progress(self, answers: dict[int, dict]) -> None:
        self.rank_status.update({r: a.get("status") for r, a in answers.items()})
        self.persisting.update({r: bool(a.get("persisting")) for r, a in answers.items()})
        steps = [a["step"] for a in answers.values()]
        if not steps:
            return
        new_step = min(steps)
        if new_step > self.step:
            self.last_progress_at = self.now()
            step_s = [a["step_s"] for a in answers.values() if a.get("step_s")]
            if step_s:
                self.step_times.append(max(step_s))
            losses = [a["loss"] for a in answers.values() if a.get("loss") is not None and a["step"] == new_step]
            if losses:
                self.loss = losses[0]
            if self.awaiting_first_step is not None:
                self._recovered(answers)
            if self.resizing is not None and "restore_s" in self.resizing:  # restored at the new size
                self._resized(answers)
        self.step = max(self.step, new_step)
        self.max_step_seen = max(self.max_step_seen, max(steps))
        self.metrics.on_progress(self.step, self.loss, answers)

    def _resized(self, answers: dict[int, dict]) -> None:
        """The first step at the new world size completed: how long the resize took."""
        rz, self.resizing = self.resizing, None
        ends = [a["first_step_end"] for a in answers.values() if a.get("first_step_end")]
        first_step_t = max(ends) if ends else self.wall()
        self.events.emit("resize_completed", old_world_size=rz["old_world_size"],
                         new_world_size=len(self.group.members), path=rz.get("path"), source=rz.get("source"),
                         resize_s=first_step_t - rz["decided_t"], restore_s=rz.get("restore_s"),
                         first_step_t=first_step_t, reached_step=rz.get("reached_step"),
                         resumed_step=rz.get("resumed_step"),
                         lost_steps=max(0, rz.get("reached_step", 0) - rz.get("resumed_step", 0)),
                         reason=rz["reason"])

    def _recovered(self, answers: dict[int, dict]) -> None:
        rec = self.awaiting_first_step
        self.awaiting_first_step = None
        ends = [a["first_step_end"] for a in answers.values() if a.get("first_step_end")]
        first_step_t = max(ends) if ends else self.wall()
        resumed = rec.get("resumed_step", 0)
        self.events.emit("recovered", recover_s=first_step_t - rec["fault_t"],
                         detect_s=rec["detected_t"] - rec["fault_t"], resumed_step=resumed,
                         fault_step=rec["fault_step"], lost_steps=max(0, rec["fault_step"] - resumed),
                         world_size=len(self.group.members))


def _last_line(text: str) -> str:
    lines = [x for x in str(text).strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else ""
