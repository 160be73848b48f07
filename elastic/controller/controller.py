"""The controller actor: schedule -> run -> detect -> decide -> recover.

It holds no tensors. Every transition and every decision goes to the event
log with its reason. This module is the loop: `step_once()` runs exactly one
iteration, dispatching on the state to its handler; the handlers live one
concern per module:

    lifecycle.py   Starting, Forming; the fence, generations, background care of spares
    restoring.py   Restoring: from a peer's memory, every rank's offered shards, or storage
    running.py     Running: one poll per iteration, detection, rollbacks
    recovery.py    Recovering: who is lost, what the policy decides, replacements
    resize.py      Swapping, Growing, Dropping, Trading, and one apply_resize() for every change of size
    stragglers.py  the straggler window and its decisions
    finish.py      the end of a run: the final checkpoint, digests, ledger
    reports.py     folding the ranks' poll reports into progress, checkpoints and events

Run state lives in typed records (records.py). The controller never names a
strategy: what differs between them it asks of the strategy's `Shape`
(elastic/parallel/shape.py) and the restore policies (elastic/policies/restore.py).

Detection, fastest signal first:
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

import logging
import threading
import time

import ray

from elastic.checkpoint.fencing import FenceWriter
from elastic.checkpoint.lease import Lease
from elastic.checkpoint.layout import checkpoints_root
from elastic.config import JobConfig
from elastic.config.secrets import job_secrets, scrub
from elastic.controller import lifecycle, recovery, resize, restoring, running
from elastic.controller.finish import logged_through
from elastic.controller.records import Checkpoints, Housekeeping, Progress, RecoveryRecord, ResizeRecord, RunLog
from elastic.controller.states import (
    TERMINAL, Dropping, Errored, Finished, Forming, Growing, Recovering, Restoring, Running, Starting, State, Swapping,
    Trading)
from elastic.observability import export as run_metrics
from elastic.observability.events import EventLog
from elastic.observability.loggers import RunLoggers
from elastic.parallel.shape import shape_for
from elastic.policies.restore import FromStorage, RestoreSource
from elastic.policies.straggler import StragglerState
from elastic.protocol import WorkerGroupProtocol
from elastic.storage import Storage, join

log = logging.getLogger(__name__)

HANDLERS = {
    Starting: lifecycle.on_starting,
    Forming: lifecycle.on_forming,
    Restoring: restoring.on_restoring,
    Running: running.on_running,
    Recovering: recovery.on_recovering,
    Swapping: resize.on_swapping,
    Growing: resize.on_growing,
    Dropping: resize.on_dropping,
    Trading: resize.on_trading,
}


class Controller:
    def __init__(self, job_json: str, runtime_env: dict | None = None, *, group: WorkerGroupProtocol | None = None,
                 clock=None, wall=None):
        """`group`, `clock` (monotonic seconds) and `wall` (epoch seconds) are for tests: a fake
        worker group and a fake clock drive the controller without Ray."""
        self.now = clock or time.monotonic
        self.wall = wall or time.time
        self.sleep = getattr(clock, "advance", None) or time.sleep  # a fake clock moves instead
        self.job = JobConfig.model_validate_json(job_json)
        ck = self.job.checkpoint
        self.storage = Storage(ck.storage_uri, ck.storage_options)
        self.run_dir = join(self.storage.uri, self.job.run.name)
        self.root = checkpoints_root(self.storage.uri, self.job.run.name)
        # Prometheus metrics (elastic.observability.metrics, export) are derived from every event as it is
        # emitted, plus the progress of each poll and each straggler window, which are not events.
        self.metrics = run_metrics.for_run(self.job.run.name, clock=self.now)
        self.secrets = job_secrets(self.job)  # scrubbed from every event and from the run's error
        self.lease = Lease(self.storage, self.run_dir, self.job.run.lease_ttl_s, wall=self.wall)
        # Nothing lands in the run folder from a driver whose lease is not fresh (lease.py): not
        # an event, not a fence, not metrics; once taken over, never again.
        self.events = EventLog(self.storage, self.run_dir, echo=self.metrics.on_event, secrets=self.secrets,
                               may_write=self.lease.fresh, writer_id=lambda: self.lease.number)
        self.fence = FenceWriter(self.storage, self.root, allowed=self.lease.fresh)
        if group is None:
            from elastic.group.worker_group import WorkerGroup
            group = WorkerGroup(self.job, job_json, self.root, ray.get_runtime_context().current_actor, runtime_env)
        self.group: WorkerGroupProtocol = group
        self.state: State = Starting()
        self.generation = 0  # bumped by every group formation
        self.failures = 0
        self.copies_fallbacks = 0  # faults of sharded state that found no complete in-memory copies
        self.pending_faults = [f.model_dump() for f in self.job.chaos]
        self.fault_lock = threading.Lock()
        self.last_fault: dict | None = None  # set by report_fault, consumed by recovery bookkeeping
        # Run state, in typed records (elastic/controller/records.py).
        self.training = Progress(last_progress_at=self.now())
        self.checkpoints = Checkpoints()
        self.run_log = RunLog()
        # TensorBoard, MLflow: each step once a committed checkpoint covers it (loggers.py says why)
        self.loggers = RunLoggers(self.job.loggers, self.job.run.name, self.lease.fresh,
                                  self.events.emit)
        self.house = Housekeeping(grow_checked_at=self.now())
        self.recovery: RecoveryRecord | None = None  # a recovery in progress until a step completes
        self.resize: ResizeRecord | None = None  # a resize in progress until the first step at the new size
        self.run_refs: dict = {}
        self.restore_plan: RestoreSource = FromStorage()
        self.offers: dict = {}  # a sharded state's parts, by old rank, taken at a planned stop
        self.survivor_steps: dict[int, int] = {}  # old rank -> step, of the survivors of the last failure
        self.stragglers = StragglerState()
        self.compute_log: dict[int, dict[int, float]] = {}  # rank -> {step: own compute seconds}
        self.next_straggler_step = 0  # the next step to fold into the straggler state
        self.swap_healthy_s = 0.0  # healthy ranks' median compute at the last Swap decision
        self.slow_nodes: set[str] = set()  # nodes a straggler was found on (no uncalibrated spare regroups there)
        self.grow_deferred = None  # a GrowDeferral while a grow waits for a persist
        # Where ranks sit (elastic.parallel.topology), and how that changes as capacity comes and
        # goes: the strategy's shape says (flat: (pp=1, dp=world); staged: the chain below `top`).
        self.shape = shape_for(self.job)
        self.world_size = self.job.scaling.num_workers  # changes on shrink and growth
        self.top = self.shape.layout(self.job.scaling.max_size)
        self.layout = self.shape.layout(self.world_size)

    # ---------------------------------------------------------------- public (called from the driver / workers)
    @property
    def step(self) -> int:
        return self.training.step

    @property
    def loss(self) -> float | None:
        return self.training.loss

    @property
    def last_committed(self) -> str | None:
        return self.checkpoints.last_committed

    def run(self) -> dict:
        try:
            while not isinstance(self.state, TERMINAL):
                self.step_once()
        except Exception as e:  # noqa: BLE001 - a controller bug must still end the run with a reason
            log.exception("controller failed")
            self.set_state(Errored(f"controller error: {type(e).__name__}: {e}"))
        finally:
            self.group.shutdown()
            if self.holds_run:
                self.run_log.write_metrics(self.storage, self.run_dir, self.fence.holds)
                self.run_log.write_steps(self.storage, self.run_dir, self.fence.holds)
                ok = isinstance(self.state, Finished)
                self.loggers.close(logged_through(self, ok), self.run_log, self.wall, ok,
                                   self.fence.holds)
        st = self.state
        if self.holds_run:  # a driver refused the run, or one that lost it, writes nothing into its folder
            self.events.emit("run_finished" if isinstance(st, Finished) else "run_failed",
                             step=self.step, loss=self.loss, error=getattr(st, "error", None),
                             checkpoint=self.last_committed,
                             slowest_poll_answer_s=round(self.group.slowest_poll_answer_s, 2),
                             control_traffic=self.group.control_traffic(),
                             heartbeat_ranks=sorted(self.house.beats))
            self.events.flush()
        self.lease.release()
        return {"status": "finished" if isinstance(st, Finished) else "error",
                "error": scrub(getattr(st, "error", None), self.secrets), "step": self.step, "loss": self.loss,
                "checkpoint": self.last_committed, "digests": getattr(st, "digests", {}),
                "losses": {s: x for s, (x, _) in sorted(self.run_log.loss_curve.items())},
                "evaluations": {s: ev.metrics for s, ev in sorted(self.run_log.evaluations.items())},
                "user_metrics": dict(sorted(self.run_log.user_metrics.items())),
                "events": self.events.events, "run_dir": self.run_dir}

    @property
    def holds_run(self) -> bool:
        """This controller took the run's lease and still has it: it may write the run's files."""
        return self.lease.number is not None and self.lease.lost is None

    def step_once(self) -> tuple[str, str]:
        """Exactly one iteration of the state machine; returns (previous state, new state) names.
        In every state once the lease is ours: a stale lease is renewed first, and a lost one ends
        the run before the handler acts (forms, restores, judges anyone)."""
        prev = self.state
        if self.lease.number is not None and not isinstance(prev, TERMINAL):
            self.check_lease()
            if self.lease.lost:
                self.set_state(Errored(f"this driver no longer owns the run: {self.lease.lost}"))
                return type(prev).__name__, type(self.state).__name__
        self.set_state(HANDLERS[type(prev)](self, prev))
        return type(prev).__name__, type(self.state).__name__

    def check_lease(self, force: bool = False) -> None:
        """A lease found stale by this driver's own clock (it was frozen, or cut off from storage)
        is renewed at once, before anything is judged: a renewal that finds the lease taken over
        marks it lost. `force`: fresh or not (the loop itself stalled). At most once per
        run.lease_ttl_s / 4 unless forced, so an outage, where
        the renewal cannot land, costs the loop one bounded call per interval, not one per
        iteration."""
        if self.lease.lost or (not force and self.lease.fresh()[0]):
            return
        now, every_s = self.now(), self.job.run.lease_ttl_s / 4
        if not force and now - self.house.lease_checked_at < every_s:
            return
        self.house.lease_checked_at = now
        self.lease.check_now(min(every_s, self.grace_s))

    def progress(self, since_event: int = 0, steps_after: int | None = None) -> dict:
        """Where the run stands, the events from `since_event` on and, with `steps_after`, each
        rank's step records past that step (`[step, end, seconds, compute seconds]`, as in
        steps.json; for a driver that traces a run as it goes, as the churn benchmark does)."""
        out = {"state": type(self.state).__name__, "step": self.step, "num_steps": self.job.run.num_steps,
               "loss": self.loss, "world_size": len(self.group.members), "failures": self.failures,
               "events": self.events.events[since_event:]}
        if steps_after is not None:
            out["steps"] = {r: [row for row in rows if row[0] > steps_after]
                            for r, rows in list(self.run_log.step_times.items())}
        return out

    def is_current(self, generation: int) -> bool:
        """Whether `generation` is the run's newest group (a worker asks after its group failed)."""
        return generation == self.generation and not isinstance(self.state, TERMINAL)

    def report_fault(self, fault: dict, rank: int, step: int, t: float, pid: int | None = None,
                     generation: int | None = None, uploading: bool | None = None) -> None:
        with self.fault_lock:
            if fault in self.pending_faults:
                self.pending_faults.remove(fault)
        self.last_fault = {"action": fault["action"], "rank": rank, "step": step, "t": t}
        # The rank's own word on the step it reached, as good as a poll answer, and often newer
        # than the last poll: a resize measures its lost steps from the furthest step seen.
        self.training.max_step_seen = max(self.training.max_step_seen, step)
        self.events.emit("fault_injected", action=fault["action"], rank=rank, step=step, fault_t=t, pid=pid,
                         generation=generation, thaw_after_s=fault.get("thaw_after_s"), uploading=uploading,
                         hold_s=fault.get("hold_s"))

    # ---------------------------------------------------------------- for the handlers
    @property
    def grace_s(self) -> float:
        """How long an answer that should come at once may take (a rank leaving its group, a stop
        reaching every rank, storage during a recovery) before the controller goes on without it."""
        return self.job.failure.ping_timeout_s * 3

    def set_state(self, new: State) -> None:
        # A driver refused the run, or one that lost it, writes no event into the run's log.
        if self.holds_run and (type(new) is not type(self.state) or isinstance(new, Recovering)):
            self.events.emit("state", old=type(self.state).__name__, new=type(new).__name__)
        self.state = new

