"""One rank: a Ray actor that builds the model, joins a process group, restores
state, runs steps, snapshots checkpoints and reports telemetry.

The actor is threaded: `run()` trains on one thread while `poll()` and
`ping()` answer on others, so the controller can see a rank that is blocked in
a collective (it answers) apart from one that is dead or stopped (it does not).
Workers talk to each other only through torch.distributed.

This module holds the actor's remote methods and its run loop; the rest is composed in:
the training step (elastic/runtime/step.py), the state and how it is built
(elastic/runtime/state.py), the three restore paths (elastic/runtime/restore.py), the
checkpoint bookkeeping (elastic/runtime/checkpoint_book.py) and the chaos faults it fires
(elastic/runtime/faults.py).
"""
from __future__ import annotations

import gc
import os
import sys
import threading
import traceback
from dataclasses import replace

import ray
import torch

from elastic.runtime import collectives, determinism, priority, restore, state
from elastic.checkpoint.persister import AsyncCheckpointer
from elastic.runtime.checkpoint_book import CheckpointBook
from elastic.runtime.evaluation import Evaluator
from elastic.runtime.faults import fire_fault
from elastic.runtime.memory_copies import MemoryCopies
from elastic.runtime.memory_watch import MemoryWatch
from elastic.runtime.membership import GroupMembership
from elastic.runtime.step import BadStep, CollectiveError, RollBack, StepRunner
from elastic.config import JobConfig
from elastic.data.fingerprint import fingerprint_or_none
from elastic.data.order import GlobalOrder, cursor_after
from elastic.protocol import PollReport, RankStatus, RestoreResult, RunResult, RunStatus, WorkerInfo
from elastic.storage import Storage
from elastic.parallel.topology import Layout


class Worker(GroupMembership):
    def __init__(self, job_json: str, checkpoints_root: str, controller=None):
        self.job = JobConfig.model_validate_json(job_json)
        # As many compute threads as CPUs reserved for this rank: more would only fight the others.
        torch.set_num_threads(max(1, int(self.job.scaling.cpus_per_worker)))
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU, so it is always cuda:0 here.
        self.device = torch.device("cuda", 0) if self.job.scaling.use_gpu else torch.device("cpu")
        if self.device.type == "cuda":  # before any mesh: NCCL and DeviceMesh take the current device
            torch.cuda.set_device(self.device)
        if self.job.train.deterministic:  # before the job's modules are imported: they may start CUDA
            determinism.make_deterministic(self.device)
        self.fns = self.job.train.resolve()
        self.dataset = self.fns["dataset"]()
        # Recorded in every manifest for the resume check (elastic/data/fingerprint.py); taken once.
        self.dataset_fingerprint = fingerprint_or_none(self.dataset)
        self.order = GlobalOrder(len(self.dataset), self.job.run.seed)
        self.storage = Storage(self.job.checkpoint.storage_uri, self.job.checkpoint.storage_options)
        self.root = checkpoints_root
        self.controller = controller
        self.rank = self.world_size = -1
        self.layout = Layout(1, 1)
        self.built_for = None  # the strategy layout the model was built for (a pipeline: its stage)
        self.built_generation = None  # the group the model was built in (tensor parallelism binds it there)
        self.generation = 0  # the controller's group generation this rank last joined
        self._abort: collectives.GroupAbort | None = None
        self._joining = None
        self._join_phase: tuple[str, float] | None = None  # (what a join in progress is doing, since)
        self._join_lock = threading.Lock()
        self._join_pending: int | None = None  # the generation a join in progress is for
        self._join_cut: int | None = None  # a generation whose formation was cut while this rank left the old
        self._running = threading.Event()
        self._run_thread: int | None = None  # the thread in run(), for `where`
        self.memory_watch = MemoryWatch()
        self.step = 0
        self.model = self.optimizer = self.strategy = None
        self.ckpt: AsyncCheckpointer | None = None
        self.staging = None  # the last checkpointer's staging buffers, for the next one
        self._lock = threading.Lock()
        # What poll() reports of the rank's progress; the step runner writes it too (set_progress).
        self._progress: dict = {"step": 0, "status": RankStatus.IDLE, "loss": None, "step_end": None,
                                "step_s": None, "compute_s": None, "first_step_end": None, "grad_norm": None,
                                "ckpt_stall_s": None, "holds_state": False}
        self.book = CheckpointBook(self._lock, self.job.checkpoint.persist_retry_backoff_s)
        self.runner = StepRunner(self, self._lock)
        self.evals = Evaluator(self, self._lock)  # train.eval_dataset (elastic/runtime/evaluation.py)
        self.slow_factor = 1.0  # set by the "slow" chaos fault: this process computes slower from then on
        self.stop_requested = False  # a planned stop (straggler swap), agreed on through the next all-reduce
        # Agreed through the last step's all-reduce (StepStats), so every rank acts on them at the
        # same step: stop; skip a checkpoint due now (some rank's previous persist still runs);
        # save again (some rank owes a checkpoint).
        self._stop_agreed = False
        self._persist_busy = False
        self._retry_agreed = False
        self.scheduler = None  # train.scheduler, rebuilt and replayed to the step on every restore
        self.factory_lrs: list[float] = []  # each param group's learning rate as built: where a schedule starts
        self.amp: dict[str, torch.Tensor] = {}  # fp16: {"scale", "good_steps"}, saved and restored with the state
        self.kept_offer: dict | None = None  # this rank's part, kept for a rank-to-rank re-shard
        self.copies = MemoryCopies(self.job.checkpoint.memory_every_steps, self.job.checkpoint.memory_max_overhead,
                                   self.job.checkpoint.memory_sync)  # sharded state's in-memory copies
        # What is alive now (imported modules, the job's functions, the dataset) lives as long as the
        # worker: moved out of the cyclic collector's reach, so that a full collection scans only
        # what training creates. Without this, a full collection of this process's ~300,000
        # objects held a rank for about 180 ms every few hundred steps, at a random step on each
        # rank, and the whole group waited (10 steps of the 1.3 M MLP here). The young generations
        # are collected first (the set-up's fresh garbage, which is never collected once frozen;
        # 0.5 ms): a full collection here found 10 objects more, and cost 130-190 ms of a spare's
        # start, which runs on the CPU training leaves idle.
        gc.collect(1)
        gc.freeze()

    # ---------------------------------------------------------------- identity
    def info(self) -> WorkerInfo:
        ctx = ray.get_runtime_context()
        ip = ray.util.get_node_ip_address()
        return WorkerInfo(node_id=ctx.get_node_id(), ip=ip, pid=os.getpid(), actor_id=ctx.get_actor_id())

    def ping(self) -> bool:
        return True

    def where(self, depth: int = 4) -> str | None:
        """Where run() is now: its innermost `depth` frames, "file:line in function", innermost
        last. None when no run() is in progress. For the event that says why a survivor was
        replaced: one whose run() did not return after an abort names what it was stuck in."""
        frame = sys._current_frames().get(self._run_thread) if self._running.is_set() else None
        if frame is None:
            return None
        stack = traceback.extract_stack(frame)[-depth:]
        return " > ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in stack)

    # ---------------------------------------------------------------- state
    def warm(self, calibrate: bool = True) -> WorkerInfo:
        """Build model and optimizer from the seed now, so that joining later costs only a
        rendezvous and a state transfer. Spares are warmed before they are needed. A worker
        started for a recovery in progress takes a rank at once: its calibration (a few steps'
        compute, seconds at 100 M parameters) is left for when it is ever weighed for a swap, and
        its model is allocated without its init (`state.build(fill=False)`: NaN where a load must
        write), as every way into a group loads a state over it. Calibrated later, it times the
        same compute on those values."""
        if self.model is None:
            state.build(self, fill=calibrate)
        # Started beside training at the lowest priority (runtime/priority.py): built now, it
        # calibrates and later trains at the priority it had.
        low = priority.restore()
        info = self.info()
        calib_s = self.calibrate() if calibrate else None
        if calibrate:  # a spare: ready for a copy before it is needed (a worker started on demand
            state.ready_for_a_copy(self)  # is needed now: the copy may as well touch its pages)
        return replace(info, calib_s=calib_s, started_low=low)

    def restore_priority(self) -> bool:
        """A spare still warming at low priority is wanted by a recovery: finish at full priority."""
        return priority.restore()

    def calibrate(self, reps: int = 5) -> float | None:
        """Best compute time of one rank's share of a step on this process (see StepRunner.calibrate).
        None for a model kept on the meta device (train.meta_init: it has no values to run yet)."""
        if self.built_for == state.META:
            return None
        return self.runner.calibrate(reps)

    def request_stop(self, generation: int) -> int:
        """Ask run() to stop at a step boundary. The request rides on the next step's all-reduce,
        so every rank learns of it in the same step and they all stop after that same step,
        however far behind the controller's view of the step is, and even if the request
        reached only some ranks. It holds until consumed by a stop or a new group."""
        if generation == self.generation:
            self.stop_requested = True
        return self.step

    # ---------------------------------------------------------------- restore (elastic/runtime/restore.py)
    def restore(self, candidates: list[str]) -> RestoreResult:
        """From storage: the newest of `candidates` that loads, or the fresh init if there are none."""
        self.set_progress(holds_state=False)  # until the whole state is loaded (start_checkpointer)
        return restore.from_storage(self, candidates)

    def restore_from_peer(self, src_rank: int, slot_sources: list[int] | None = None,
                          fault: dict | None = None) -> RestoreResult:
        """From the memory of survivor `src_rank` (several slots: of `slot_sources[slot]`).
        `fault`: a chaos fault (`during_restore`) fired first."""
        if fault is not None:
            fire_fault(self, fault)
        held = bool(self._progress["holds_state"])  # a survivor: it may hold the source's state already
        if self.rank not in (slot_sources or [src_rank]):  # until the copy is done
            self.set_progress(holds_state=False)
        return restore.from_peer(self, src_rank, slot_sources, held)

    def offer_shards(self, publish: bool = True) -> dict:
        """This rank's part of the state, for a re-shard in memory (kept here unless `publish`)."""
        return restore.offer(self, publish)

    def restore_from_shards(self, offers: list, old_world: int, old_pp: int = 1,
                            holders: dict[int, int] | None = None, copies_step: int | None = None,
                            fault: dict | None = None) -> RestoreResult:
        """Re-sharded in memory from the old ranks' offers (`holders`: parts moved rank to rank;
        `copies_step`: the in-memory copies of that step are those parts). `fault`: a chaos
        fault (`during_restore`) fired first."""
        if fault is not None:
            fire_fault(self, fault)
        self.set_progress(holds_state=False)  # the offers hold the state until this one is whole
        return restore.from_shards(self, offers, old_world, old_pp, holders, copies_step)

    def hold_copy(self, rank: int, generation: int, part: dict) -> bool:
        """As `rank`'s buddy: keep its part (memory_copies.py). False: from an older group."""
        return self.copies.hold(rank, generation, part)

    def memory_part(self, rank: int, step: int, own: bool) -> dict:
        """Old rank `rank`'s part at `step`, for a restore: this rank's own (`own`), or the copy it
        holds as that rank's buddy."""
        return self.copies.part(rank, step, own)

    def state_digest(self) -> str:
        """sha256 over the whole model and optimizer state: equal digests, equal state."""
        return state.digest(self)

    # ---------------------------------------------------------------- training
    def run(self, num_steps: int, faults: list[dict], skip_steps: list[int] = (), buddy=None,
            holds_for: tuple[int, ...] = (), evaluated_through: int = 0) -> RunResult:
        """Train until `num_steps` steps are done. Returns how it ended (`RunStatus`: done,
        stopped, aborted, user_error, rollback); a collective failure aborts (the controller
        decides what next). `skip_steps`: steps trained without an update (the batches a
        rollback skips). `buddy`: (rank, handle) that keeps this rank's in-memory copies;
        `holds_for`: the ranks whose copies this rank keeps. `evaluated_through`: the last step
        whose evaluation the controller has (one after it that is due is done, or done again)."""
        tr = self.job.train
        self.copies.start(self.generation, buddy, holds_for)
        self.evals.start(evaluated_through)
        self.runner.start_run(skip_steps)
        # A pipeline splits each replica's share into train.pipeline.microbatches itself.
        micro = self.runner.data.micro = self.runner.data.micro_batch()
        self.set_progress(status=RankStatus.RUNNING)
        generation = self.generation
        self.forget_old_meshes()
        saved = self.step  # the restored state is in storage already, or is the fresh init
        self._run_thread = threading.get_ident()
        self._running.set()
        try:
            while self.step < num_steps:
                if self._stop_agreed:
                    if not self.job.failure.peer_restore and saved != self.step:
                        # State moves through storage at this planned change: checkpoint this
                        # very step, so nothing is redone.
                        self._save(tr, saved)
                    self._wait_persist()
                    self.book.collect(self.ckpt)
                    self.stop_requested = self._stop_agreed = False  # consumed
                    self.set_progress(status=RankStatus.STOPPED)
                    return RunResult(RunStatus.STOPPED, self.step, generation)
                now = [f for f in faults if f["rank"] == self.rank and f["at_step"] == self.step]
                if self.evals.due(self.step, num_steps):  # the step's weights, before any fault
                    self.evals.evaluate([f for f in now if f.get("during_eval")])  # fired inside
                    now = [f for f in now if not f.get("during_eval")]
                for f in now:
                    fire_fault(self, f)
                self.ckpt.expire()  # a persist past checkpoint.persist_timeout_s is given up: never waited on forever
                agreed = self.runner.train_step(micro)
                if self.runner.unsettled and self._acts_now(agreed, num_steps):
                    agreed = self.runner.settle()  # this step's own flags, for what acts on them
                if self._progress["step_s"] is not None:
                    self.copies.note_step(self._progress["step_s"])
                if self.copies.holds_report(self.step):
                    self._copy_before_report()
                elif self.copies.due(self.step, agreed.copying):
                    self.copies.take(self)
                self._stop_agreed = agreed.stop
                self._persist_busy = agreed.persist_busy  # on any rank: agreed, like the stop
                self._retry_agreed = agreed.owe  # likewise: every rank saves again at this step
                due = self.step % self.job.checkpoint.every_steps == 0
                if not due and self.ckpt.needs_staging():
                    self.ckpt.prestage(state.state_dict(self))  # once per group, after its first step
                retry = self._retry_agreed and not due and self.step != num_steps
                if self.step == num_steps or ((due or retry) and not self._persist_busy):
                    saved = self._save(tr, saved)
                    if retry and self.rank == 0:
                        self.book.note_retried(self.step)
                elif due and self.rank == 0:
                    # A persist is still in flight on some rank (storage slow or down): every rank
                    # skips this checkpoint together, rather than block training on storage.
                    self.book.note_deferred(self.step)
                self.book.collect(self.ckpt)
            if self.evals.due(self.step, num_steps):  # the last step's
                self.evals.evaluate()
            self._wait_persist()
            self.book.collect(self.ckpt)
        except RollBack as e:
            self._wait_persist()
            self.book.collect(self.ckpt)
            self.set_progress(status=RankStatus.ROLLBACK)
            return RunResult(RunStatus.ROLLBACK, self.step, generation, bad_steps=tuple(e.bad_steps))
        except BadStep as e:  # every rank agreed on it (one all-reduce): a verdict on the data, not a bug
            self.set_progress(status=RankStatus.BAD_STEP)
            self._teardown_after_failure(generation)
            return RunResult(RunStatus.BAD_STEP, e.step, generation, error=str(e))
        except CollectiveError as e:
            self.set_progress(status=RankStatus.ABORTED)
            self._teardown_after_failure(generation)
            self._exit_if_fenced(generation)
            return RunResult(RunStatus.ABORTED, self.step, generation, error=str(e))
        except Exception as e:  # noqa: BLE001 - the user's model/loss/data raised
            self.set_progress(status=RankStatus.USER_ERROR)
            self._teardown_after_failure(generation)
            return RunResult(RunStatus.USER_ERROR, self.step, generation, error=f"{type(e).__name__}: {e}",
                             traceback=traceback.format_exc())
        finally:
            self._running.clear()
        self.set_progress(status=RankStatus.DONE)
        return RunResult(RunStatus.DONE, self.step, generation, digest=self.state_digest())

    def _acts_now(self, late, num_steps: int) -> bool:
        """Whether this step's own agreed flags are needed now, where the step's statistics are
        read a step late (`late`: the step before's): a checkpoint or an in-memory copy may be
        due, the run ends, or the step before saw a stop or a checkpoint owed (both hold until
        acted on, so this step's flags carry them too). Otherwise nothing acts on them, and the
        next step reads them without waiting."""
        step = self.step
        due = step % self.job.checkpoint.every_steps == 0
        return step == num_steps or due or late.stop or late.owe or self.copies.due(step, False)

    def _copy_before_report(self) -> None:
        """checkpoint.memory_sync: this step's copy at its buddy, then every rank's (one small
        all-reduce: none passes it before all are in), then the step reported. A failure on the
        way leaves the step unreported: the restore takes the copies before it, none redone."""
        try:
            self.copies.take(self, aborted=lambda: self._abort is not None and self._abort.aborted,
                             timeout_s=self.job.failure.collective_timeout_s)
            torch.distributed.all_reduce(torch.zeros(1, device=self.device))
        except (RuntimeError, torch.distributed.DistError) as e:
            raise CollectiveError(f"{type(e).__name__}: {e}") from e
        self.runner.report_held()

    def save_again(self) -> int:
        """The run's last checkpoint did not commit: save the final state again (every rank at
        once, as at any checkpoint step; its group is still formed) and wait for the persist.
        Its result reaches the controller with the next poll, like any other. Returns the step."""
        self._save(self.job.train, None)
        self._wait_persist()
        self.book.collect(self.ckpt)
        return self.step

    def _wait_persist(self) -> None:
        """Wait for the persist in flight, within its bound: checkpoint.persist_timeout_s from its
        start, then it is given up (its upload cut short, reported "timed out:", the checkpoint
        owed) and training goes on; a wait without a bound held a run whose storage hung forever.
        While storage holds us up, say so: the controller must not take a stall that storage
        causes for a hang (nor wait on it past the same bound: running.py)."""
        if self.ckpt.in_flight():
            self.set_progress(status=RankStatus.STORAGE_WAIT)
        self.ckpt.wait_within_bound(grace_s=self.job.failure.ping_timeout_s)
        self.set_progress(status=RankStatus.RUNNING)

    def _save(self, tr, saved: int | None) -> int | None:
        """Checkpoint this step; the step saved (`saved`, the last one, if this save could not start)."""
        if self.ckpt.in_flight():  # only at the last step or a planned stop (see run())
            self._wait_persist()
        if self.ckpt.in_flight():
            # Given up past its bound, and still not ended (a call that cannot be cut short): a
            # second persist must not run beside it on the checkpoint group. Reported as failed.
            self.book.note_not_saved(self.step, self.root, f"timed out: the persist of step "
                                     f"{self.ckpt.step_in_flight} still runs past checkpoint.persist_timeout_s="
                                     f"{self.job.checkpoint.persist_timeout_s:g} s; step {self.step} not saved")
            return saved
        stall_s = self.ckpt.save(self.step, cursor_after(self.step, tr.global_batch_size),
                                 state.state_dict(self),
                                 {"loss": self._progress["loss"],
                                  **(self.runner.last_metrics or {})}, self.runner.skip_steps)
        self.set_progress(ckpt_stall_s=stall_s, status=RankStatus.RUNNING)
        return self.step

    # ---------------------------------------------------------------- telemetry
    def set_progress(self, **kv) -> None:
        with self._lock:
            self._progress = {**self._progress, **kv}

    def poll(self) -> PollReport:
        """Progress, and what happened since the last poll: persists that ended, steps trained,
        skipped, saved again or deferred (each reported once)."""
        self.book.collect(self.ckpt)
        with self._lock:
            persists, deferred, retried, abandoned = self.book.take()
            compute_log, ledger, skipped = self.runner.take()
            memory_steps, copies_held = self.copies.report()
            return PollReport(rank=self.rank, generation=self.generation, **self._progress,
                              persisting=self.ckpt is not None and self.ckpt.in_flight(), persists=persists,
                              compute_log=compute_log, ledger=ledger, skipped=skipped, abandoned=abandoned,
                              retried=retried, deferred=deferred, memory_steps=memory_steps,
                              copies_held=copies_held, memory=self.memory_watch.sample(),
                              evaluations=self.evals.take())
