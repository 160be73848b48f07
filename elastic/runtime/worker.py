"""One rank: a Ray actor that builds the model, joins a process group, restores
state, runs steps, snapshots checkpoints and reports telemetry.

The actor is threaded: `run()` trains on one thread while `poll()` and
`ping()` answer on others, so the controller can see a rank that is blocked in
a collective (it answers) apart from one that is dead or stopped (it does not).
Workers talk to each other only through torch.distributed.
"""
from __future__ import annotations

import gc
import hashlib
import os
import socket
import threading
import time
import traceback
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import default_collate

from elastic.runtime import chaos, collectives, heartbeat, priority
from elastic.checkpoint import fencing
from elastic.parallel import resharding
from elastic.checkpoint.dcp_io import load_shards
from elastic.checkpoint.persister import AsyncCheckpointer
from elastic.checkpoint.retry import PEER_LOST, describe_failure, owes_retry, retry_wait_s
from elastic.runtime.compute_clock import ComputeClock
from elastic.config import JobConfig, batch_plan
from elastic.data.order import GlobalOrder, cursor_after
from elastic.data.prefetch import Prefetcher, collate
from elastic.storage import Storage
from elastic.parallel.strategies import make_strategy
from elastic.parallel.base import broadcast_tensors, forget_old_meshes
from elastic.parallel.ddp import unhook
from elastic.parallel.topology import Layout


def step_seed(seed: int, step: int, rank: int) -> int:
    """RNG seed for one rank's step. RNG state is a function of (seed, step, rank), so a
    restored run draws exactly what the uninterrupted run drew, with nothing extra to save."""
    return (seed * 1_000_003 + step * 7919 + rank) % (2**63)


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, hung past the backstop, or the group was torn down."""


class BadStep(RuntimeError):
    """A step's loss or gradient was not finite and train.bad_step says stop (the user's to fix)."""


class RollBack(Exception):
    """train.bad_step=rollback: bad_step_limit bad steps in a row; the controller restores."""

    def __init__(self, bad_steps: list[int]):
        super().__init__(f"bad steps {bad_steps}")
        self.bad_steps = bad_steps


LOSS_SCALE_INIT, LOSS_SCALE_GROWTH_INTERVAL = 2.0 ** 16, 2000  # fp16 dynamic loss scaling, as torch's GradScaler


# A lost peer (as the checkpointer recognises it) or any error raised by the transport itself.
_TRANSPORT_ERRORS = PEER_LOST + ("gloo/transport", "nccl", "process group", "processgroup")


def is_collective_failure(e: BaseException) -> bool:
    """A failure of the group rather than of the user's code. FSDP all-gathers and reduce-scatters
    inside forward and backward, so a peer's death surfaces there, as a plain RuntimeError from
    the transport; it must not be mistaken for a bug in the model (which is never retried)."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(m in text for m in _TRANSPORT_ERRORS)


class Worker:
    def __init__(self, job_json: str, checkpoints_root: str, controller=None):
        self.job = JobConfig.model_validate_json(job_json)
        # As many compute threads as CPUs reserved for this rank: more would only fight the others.
        torch.set_num_threads(max(1, int(self.job.scaling.cpus_per_worker)))
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU, so it is always cuda:0 here.
        self.device = torch.device("cuda", 0) if self.job.scaling.use_gpu else torch.device("cpu")
        self.fns = self.job.train.resolve()
        self.dataset = self.fns["dataset"]()
        self.order = GlobalOrder(len(self.dataset), self.job.run.seed)
        self.storage = Storage(self.job.checkpoint.storage_uri, self.job.checkpoint.storage_options)
        self.root = checkpoints_root
        self.controller = controller
        self.rank = self.world_size = -1
        self.layout = Layout(1, 1)
        self._built_for = None  # the strategy layout the model was built for (a pipeline: its stage)
        self.generation = 0  # the controller's group generation this rank last joined
        self._abort: collectives.GroupAbort | None = None
        self._joining = None
        self._running = threading.Event()
        self.step = 0
        self.model = self.optimizer = self.strategy = self.ckpt = None
        self._staging = None  # the last checkpointer's staging buffers, for the next one
        self._lock = threading.Lock()
        self._progress: dict = {"step": 0, "status": "idle", "loss": None, "step_end": None,
                                "step_s": None, "compute_s": None}
        self._persists: list[dict] = []
        # Checkpointers of failed groups whose upload was still running when this rank left them:
        # reported on until done, and waited for by the next persist before it writes.
        self._abandoned: list[AsyncCheckpointer] = []
        self._abandoned_steps: list[int] = []  # their steps, until the next poll
        # (step, own compute seconds, global mean loss) per step, drained by poll()
        self._compute_log: list[tuple[int, float, float]] = []
        self._ledger: list[tuple[int, int, int, list[int]]] = []  # (step, world, rank, sample ids), if enabled
        self.slow_factor = 1.0  # set by the "slow" chaos fault: this process computes slower from then on
        self.stop_requested = False  # a planned stop (straggler swap), agreed on through the next all-reduce
        self._stop_agreed = False
        self._persist_busy = False  # some rank's previous persist was still running at the last step
        self._deferred: list[int] = []  # checkpoint steps skipped because a persist was in flight
        # A persist of this rank failed on storage: a checkpoint is owed from `_owe_at` (monotonic)
        # on, saved again at the first step boundary after it, however far the next checkpoint
        # step is; each failed retry doubles the wait (see retry_wait_s).
        self._owe_at: float | None = None
        self._owe_fails = 0
        self._retry_agreed = False  # some rank owes a checkpoint, agreed through the last all-reduce
        self._retried: list[int] = []  # steps saved again for a failed checkpoint, until the next poll
        self.scheduler = None  # train.scheduler, rebuilt and replayed to the step on every restore
        self.amp: dict[str, torch.Tensor] = {}  # fp16: {"scale", "good_steps"}, saved and restored with the state
        self.skip_steps: set[int] = set()  # steps (1-based) to train without an update (after a rollback)
        self._bad_in_a_row: list[int] = []  # consecutive bad steps so far
        self._skipped: list[tuple[int, str]] = []  # (step, why) since the last poll
        self._pool = None  # train.prefetch: the thread that collates the next step's batches
        self._ahead: dict = {}  # this step's prefetched batches: micro-batch sample ids -> future
        self._upcoming: dict = {}  # the next step's
        self._loader: Prefetcher | None = None  # train.data_workers: processes that read batches ahead
        self._kept_offer: dict | None = None  # this rank's part, kept for a rank-to-rank re-shard
        self._micro = 0  # this run's per-rank micro-batch (0: the rank's whole share at once)
        self._sidecar: heartbeat.Sidecar | None | bool = None  # started by info(); False: could not run
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
    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        ip = ray.util.get_node_ip_address()
        if self._sidecar is None and self.job.failure.heartbeat:
            # Answers the controller's heartbeat from outside this process (elastic/heartbeat.py);
            # None where it cannot run, and the controller then judges this rank by its polls.
            self._sidecar = heartbeat.start_sidecar(os.getpid(), ip) or False
        return {"node_id": ctx.get_node_id(), "ip": ip, "pid": os.getpid(), "actor_id": ctx.get_actor_id(),
                "hb_port": self._sidecar.port if self._sidecar else None}

    def ping(self) -> bool:
        return True

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    # ---------------------------------------------------------------- group
    def join(self, addr: str, port: int, rank: int, world_size: int, generation: int, pp: int = 1) -> None:
        """Form generation `generation` of the group. The rendezvous (a fresh TCP store on rank 0's
        port) waits at most failure.rendezvous_timeout_s; the group's collectives at most
        failure.collective_timeout_s, a backstop: the controller aborts a collective blocked on
        a silent peer long before (see `abort`). `pp`: pipeline stages (elastic.parallel.topology: rank =
        replica x pp + stage); 1 for ddp and fsdp."""
        if self._running.is_set():
            # A run() still blocked in a collective of the old group would, when it finally fails,
            # tear down whatever group is current. Refuse; the controller aborts or replaces us.
            raise RuntimeError("previous run() is still inside a collective of the old group")
        self.leave()
        self.generation = generation
        self.stop_requested = self._stop_agreed = self._persist_busy = self._retry_agreed = False  # one generation's
        fc = self.job.failure
        before = collectives.socket_inodes()
        self._joining = (before, port)
        try:
            store = dist.TCPStore(addr, port, world_size, is_master=rank == 0,
                                  timeout=timedelta(seconds=fc.rendezvous_timeout_s))
            dist.init_process_group(
                "nccl" if self.job.scaling.use_gpu else "gloo", store=store,
                rank=rank, world_size=world_size, timeout=timedelta(seconds=fc.collective_timeout_s))
            self.rank, self.world_size = rank, world_size
            self.layout = Layout(pp, world_size // pp)
            device = "cuda" if self.job.scaling.use_gpu else "cpu"
            if pp == 1:
                self.mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("dp",))
            else:
                self.mesh = init_device_mesh(device, (self.layout.dp, pp), mesh_dim_names=("dp", "pp"))
                # Created now, inside the window whose sockets `capture` records for an abort.
                self.mesh.get_group("dp"), self.mesh.get_group("pp")
            # Checkpoint collectives run on their own group, from the persist thread, concurrently
            # with training collectives on the default group.
            self.ckpt_pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=fc.collective_timeout_s))
        finally:
            self._joining = None
        self._abort = collectives.capture(before, self.ckpt_pg, nccl=self.job.scaling.use_gpu, store_port=port)
        self.strategy = make_strategy(self.job.train, self.mesh, self.layout, rank)
        self._forget_old_meshes()
        self._set(status="joined", generation=generation)

    def abort(self, generation: int) -> dict:
        """Fail this rank's collectives of `generation` now (a peer went silent): run() returns
        "aborted" with the state of the last completed step, and the rank can join a new group.
        A stale request (an older generation) is ignored, so it can never cut a newer group."""
        if generation != self.generation:
            return {"aborted": False, "reason": f"generation {self.generation}, not {generation}"}
        joining = self._joining
        if joining is not None:  # still forming this generation: cut its rendezvous
            return {"aborted": True, "transports": collectives.cut_rendezvous(*joining), "running": False,
                    "step": self.step}
        n = self._abort.abort() if self._abort is not None else 0
        return {"aborted": True, "transports": n, "running": self._running.is_set(), "step": self.step}

    def _forget_old_meshes(self) -> None:
        """Sharded tensors only: see strategies.base.forget_old_meshes (called in each thread)."""
        if self.strategy is not None and self.strategy.sharded:
            forget_old_meshes(self.generation)

    def leave(self) -> None:
        """Drop the process group. A persist in flight is waited for at a planned change (it can
        still commit). Once the group failed it can never commit: its upload to an async
        filesystem (s3fs, gcsfs, adlfs) was cut short when the group failed, and is given up to
        ping_timeout_s to end. One that could not be (a synchronous filesystem, DCP still writing
        a file) may take a minute at 1 GB: waiting for it here held survivors past the controller's
        grace, and they were replaced with their state. So it is left to end on its own, and this
        rank's next persist waits for it before writing (AsyncCheckpointer `after`)."""
        if self.ckpt is not None:
            if not self.ckpt.aborted():
                self.ckpt.wait(timeout_s=self.job.failure.collective_timeout_s)
            elif self.ckpt.cut_pending():
                # Cut short, it ends at its upload's next poll once its thread runs: on a loaded
                # machine that can be after this call (CI saw it), and a persist left behind makes
                # the next one wait for it. Bounded well inside the controller's grace for a leave.
                self.ckpt.wait(timeout_s=self.job.failure.ping_timeout_s)
            if self.ckpt.in_flight():
                with self._lock:
                    self._abandoned.append(self.ckpt)
                    self._abandoned_steps.append(self.ckpt.step_in_flight)
            self._collect_persists()
            self._staging = self.ckpt.spare_buffers()  # for the next group's first checkpoint
            self.ckpt = None
        _destroy_group()

    # ---------------------------------------------------------------- state
    def warm(self, calibrate: bool = True) -> dict:
        """Build model and optimizer from the seed now, so that joining later costs only a
        rendezvous and a state transfer. Spares are warmed before they are needed. A worker
        started for a recovery in progress takes a rank at once: its calibration (a few steps'
        compute, seconds at 100 M parameters) is left for when it is ever weighed for a swap."""
        if self.model is None:
            self._build()
        # Started beside training at the lowest priority (elastic/priority.py): built now, it
        # calibrates and later trains at the priority it had.
        low = priority.restore()
        return {**self.info(), "calib_s": self.calibrate() if calibrate else None, "started_low": low}

    def restore_priority(self) -> bool:
        """A spare still warming at low priority is wanted by a recovery: finish at full priority."""
        return priority.restore()

    def calibrate(self, reps: int = 5) -> float:
        """Best compute time of one rank's share of a step (forward + backward) on this process,
        after one untimed warm-up: how fast a spare can be, measured before it is trusted with a
        rank. The best of several, not the median: other processes on the machine (a group
        restoring, training beside it) only ever add time, and a spare that is slow itself is
        slow in every repetition. None for a pipeline (a stage's compute needs its peers)."""
        tr = self.job.train
        if tr.strategy == "pipeline":
            return None
        per_rank = tr.global_batch_size // self.job.scaling.num_workers
        micro, _ = batch_plan(tr.global_batch_size, self.job.scaling.num_workers, tr.micro_batch_size)
        idx = list(range(min(per_rank, len(self.dataset))))
        times = []
        for _ in range(reps + 1):
            clock = ComputeClock(self.device)  # the work, not its launch (see compute_clock)
            clock.start()
            for i in range(0, len(idx), micro):
                batch = _to(default_collate([self.dataset[j] for j in idx[i:i + micro]]), self.device)
                self.fns["loss"](self.model, batch).backward()
            clock.stop()
            times.append(clock.seconds() * self.slow_factor)
        self.model.zero_grad(set_to_none=True)
        return min(times[1:])  # the first allocates gradients and warms caches: not timed

    def request_stop(self, generation: int) -> int:
        """Ask run() to stop at a step boundary. The request rides on the next step's all-reduce,
        so every rank learns of it in the same step and they all stop after that same step,
        however far behind the controller's view of the step is, and even if the request
        reached only some ranks. It holds until consumed by a stop or a new group."""
        if generation == self.generation:
            self.stop_requested = True
        return self.step

    def _build(self, sync_init: bool = False) -> None:
        """Model and optimizer from the seed; once in a group, prepared for the strategy (FSDP
        shards it over the current mesh, so every world size gets a fresh build)."""
        if self.model is not None:
            # The model being replaced is freed before its successor is built (one model's memory,
            # not two, at the peak); its gradient hooks would otherwise keep it alive for good.
            unhook(self.model)
            self.model = self.optimizer = self.scheduler = None
        torch.manual_seed(self.job.run.seed)
        model = self.fns["model"]().to(self.device)
        make_opt = self.fns["optimizer"] or (lambda p: torch.optim.AdamW(p, lr=1e-3))
        if self.strategy:
            self.strategy.note_optimizer(model, make_opt)
            model = self.strategy.prepare(model, sync_init)
        self.model = model
        self._built_for = self.strategy.layout_key if self.strategy else None
        self.optimizer = make_opt(self.model.parameters())
        self._factory_lrs = [g["lr"] for g in self.optimizer.param_groups]  # where a schedule starts
        if self.job.train.precision == "fp16":
            self.amp = {"good_steps": torch.zeros((), dtype=torch.int64, device=self.device),
                        "scale": torch.full((), LOSS_SCALE_INIT, device=self.device)}

    def _state(self) -> dict:
        """Everything a restore must bring back, keyed by name: model, optimizer and (fp16) the
        loss scale. The learning-rate schedule is a function of the step (see _replay_schedule)."""
        state = self.strategy.state_dict(self.model, self.optimizer)
        if self.amp:
            state["amp"] = self.amp
        return state

    def _load_state(self, state: dict) -> None:
        self.strategy.load_state_dict(self.model, self.optimizer, state)
        if self.amp:
            self.amp = state["amp"]

    def _replay_schedule(self) -> None:
        """The schedule at this step, as an uninterrupted run has it: built on the optimizer with
        each group's initial learning rate and stepped once per step done. Exact for any
        schedule that depends only on the step count, whatever path the state came by."""
        make = self.fns["scheduler"]
        if make is None:
            return
        for g, lr in zip(self.optimizer.param_groups, self._factory_lrs):
            g["lr"] = lr
            g.pop("initial_lr", None)
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": a replay
            self.scheduler = make(self.optimizer)
            for _ in range(self.step):
                self.scheduler.step()

    def _micro_batch(self) -> int:
        """This rank's micro-batch at the current world size (0 for a pipeline: it splits each
        replica's share into train.pipeline.microbatches itself)."""
        tr = self.job.train
        if tr.strategy == "pipeline":
            return 0
        return batch_plan(tr.global_batch_size, self.world_size, tr.micro_batch_size)[0]

    def _start_data(self) -> None:
        """Data workers (train.data_workers) start reading at the restored step during the
        restore: their start is seconds (each imports torch), which the first step must not be
        charged with (the controller would take it for a hang)."""
        tr = self.job.train
        if not tr.data_workers or not self.strategy.needs_data:
            return
        self._micro = self._micro_batch()
        if self._loader is None:
            self._loader = Prefetcher(self.dataset, tr.data_workers, tr.data_prefetch_factor, tr.data_workers_start,
                                      pin_memory=self.device.type == "cuda")
        self._loader.start(self.step, self._batch_keys)

    def _start_checkpointer(self) -> None:
        """The last part of every restore path: the schedule caught up, data workers reading
        from the restored step, checkpoints from here."""
        self._replay_schedule()
        self._start_data()
        self.ckpt = AsyncCheckpointer(
            self.storage, self.root, self.rank, self.world_size, self.strategy.name, self.ckpt_pg,
            self.job.checkpoint.persist_retries, self.job.checkpoint.persist_retry_backoff_s,
            self.job.checkpoint.num_to_keep,
            data_order={"global_batch_size": self.job.train.global_batch_size, "seed": self.job.run.seed,
                        "num_samples": len(self.dataset)},
            may_write=lambda gen=self.generation: fencing.may_write(self.storage, self.root, gen),
            # Half the checkpoint group's collective timeout: a rank that waits the whole bound
            # still meets its peers in the agreement's all-reduce before that times out.
            after=self._still_abandoned(), wait_timeout_s=self.job.failure.collective_timeout_s / 2,
            staged=self._staging)
        self._staging = None
        self._set(step=self.step, status="restored", step_end=None, first_step_end=None)

    def restore(self, candidates: list[str]) -> dict:
        """Storage path. Fresh model and optimizer from the seed, then the newest loadable
        checkpoint among `candidates` (committed folders, newest first). All ranks call this
        with the same list; DCP raises on every rank when any rank fails to read, so they move
        to the next candidate together. With no candidates, rank 0's fresh init is broadcast.
        When there are some but none loads (storage out, or every one unreadable), nothing is
        started: source "none loaded", and the controller decides (it never means step 0).
        Returns what was loaded and what was skipped, and why."""
        t0 = time.monotonic()
        self._kept_offer = None  # a re-shard in memory that fell back to storage
        self._forget_old_meshes()
        self.step = 0
        skipped = []
        loaded = None
        for uri in candidates:
            self._build()
            state = self._state()
            try:
                # DCP reads each saved shard into the current layout: a checkpoint saved at any
                # world size loads at this one.
                load_shards(state, uri, self.storage.options, self.ckpt_pg)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - corrupt or unreadable: try the previous one
                skipped.append((uri, describe_failure(e)))
                continue
            self._load_state(state)
            self.step = int(self.storage.read_bytes(uri + "/COMMITTED").decode())
            loaded = uri
            break
        if loaded is None and candidates:
            return {"step": self.step, "uri": None, "skipped": skipped, "restore_s": time.monotonic() - t0,
                    "source": "none loaded"}
        if loaded is None:
            # Every rank builds the same init from the seed; broadcasting rank 0's copy makes that
            # an invariant rather than an assumption about the user's factory.
            self._build(sync_init=True)
        self._start_checkpointer()
        return {"step": self.step, "uri": loaded, "skipped": skipped, "restore_s": time.monotonic() - t0,
                "source": "storage" if loaded else "init"}

    def restore_from_peer(self, src_rank: int, stage_sources: list[int] | None = None) -> dict:
        """Memory path: take model, optimizer and step from rank `src_rank`, a survivor that
        holds the newest state, through the new group. No storage read. A pipeline names one
        source per stage (`stage_sources[stage]`, a replica of that stage); a rank whose model
        was built for another stage (a spare, a re-numbered survivor) builds its stage first."""
        t0 = time.monotonic()
        self._kept_offer = None
        if self.model is None or self._built_for != self.strategy.layout_key:
            self._build()
        step = torch.tensor([self.step], dtype=torch.int64, device=self.device)
        dist.broadcast(step, src=src_rank)
        self.step = int(step.item())
        src = stage_sources[self.layout.stage_of(self.rank)] if stage_sources else src_rank
        self.strategy.broadcast_state(self.model, self.optimizer, src)
        if self.amp:
            broadcast_tensors([self.amp[k] for k in sorted(self.amp)], src, self.mesh.get_group("dp"))
        self._start_checkpointer()
        return {"step": self.step, "uri": None, "skipped": [], "restore_s": time.monotonic() - t0,
                "source": f"peer rank {src}" if not stage_sources else f"stage replicas {list(stage_sources)}"}

    def offer_shards(self, publish: bool = True) -> dict:
        """This rank's part of the state, for a re-shard in memory at a planned resize. Published
        (returned through Ray), it stays in this node's object store (owned by the caller) after
        this process is gone: for a rank that leaves. A rank that stays in the new group keeps it
        here instead and sends its rows rank to rank (resharding.exchange); it returns only a
        marker."""
        self._forget_old_meshes()
        offer = self.strategy.offer(self._state(), self.rank, self.world_size, self.step)
        if publish:
            return offer
        self._kept_offer = offer
        return {"part": offer["part"], "world": offer["world"], "step": offer["step"], "kept": True}

    def restore_from_shards(self, offers: list, old_world: int, old_pp: int = 1,
                            holders: dict[int, int] | None = None) -> dict:
        """Memory path of a sharded strategy: a fresh sharded build at the new world size, filled
        from the old ranks' offers (`offers[old_rank]`, object refs), reading only the parts
        this rank's new shards overlap. No storage read. `holders` (old part -> new rank): parts
        kept in the memory of ranks of the new group, moved rank to rank instead."""
        t0 = time.monotonic()
        phases: dict[str, float] = {}

        def phase(name: str, since: float) -> float:
            now = time.monotonic()
            phases[name] = round(now - since, 3)
            return now

        self._forget_old_meshes()
        self._build()
        state = self._state()
        t = phase("build", t0)
        holders = holders or {}
        own, self._kept_offer = self._kept_offer, None
        pipeline = self.strategy.name == "pipeline"  # by name, from replica 0 of each old stage (rank = stage)
        if pipeline:
            parts = self.strategy.needed_stages(old_pp)
        else:
            parts = resharding.needed_parts(state, old_world, self.world_size, self.rank, frozenset(holders))
        got = dict(zip(parts, ray.get([offers[p] for p in parts])))
        t = phase("fetch", t)
        if pipeline:
            self.step = self.strategy.assemble(state, got)
        else:
            self.step = resharding.exchange(state, own, got, holders, old_world, self.world_size, self.rank,
                                            self.ckpt_pg)
        del got, own
        t = phase("assemble", t)
        self._load_state(state)
        t = phase("load", t)
        self._start_checkpointer()
        phase("start_checkpointer", t)
        return {"step": self.step, "uri": None, "skipped": [], "restore_s": time.monotonic() - t0, "phases": phases,
                "source": f"re-sharded in memory from {old_world} ranks (read parts {parts}"
                          f"{f', rank to rank from {sorted(holders)}' if holders else ''})"}

    def state_digest(self) -> str:
        """sha256 over the whole (unsharded) model and optimizer state in a fixed order: equal
        digests, equal state. Collective for sharded strategies."""
        h = hashlib.sha256()
        self._forget_old_meshes()
        state = self.strategy.full_state_dict(self.model, self.optimizer)
        for section in ("model", "optim"):
            _hash_into(h, state[section])
        return h.hexdigest()

    # ---------------------------------------------------------------- training
    def run(self, num_steps: int, faults: list[dict], skip_steps: list[int] = ()) -> dict:
        """Train until `num_steps` steps are done. Returns {"status": "done" | "aborted" |
        "user_error" | "rollback", ...}; a collective failure aborts (the controller decides what
        next). `skip_steps`: steps trained without an update (the batches a rollback skips)."""
        tr = self.job.train
        self.skip_steps = set(skip_steps)
        # A pipeline splits each replica's share into train.pipeline.microbatches itself.
        micro = self._micro = self._micro_batch()
        self._set(status="running")
        generation = self.generation
        self._forget_old_meshes()
        saved = self.step  # the restored state is in storage already, or is the fresh init
        self._running.set()
        try:
            while self.step < num_steps:
                if self._stop_agreed:
                    if not self.job.failure.peer_restore and saved != self.step:
                        # State moves through storage at this planned change: checkpoint this
                        # very step, so nothing is redone.
                        self._save(tr)
                    self._wait_persist()
                    self._collect_persists()
                    self.stop_requested = self._stop_agreed = False  # consumed
                    self._set(status="stopped")
                    return {"status": "stopped", "step": self.step, "generation": generation}
                for f in faults:
                    if f["rank"] == self.rank and f["at_step"] == self.step:
                        self._fire(f)
                self._train_step(micro)
                due = self.step % self.job.checkpoint.every_steps == 0
                if not due and self.ckpt.needs_staging():
                    self.ckpt.prestage(self._state())  # once per group, after its first step
                retry = self._retry_agreed and not due and self.step != num_steps
                if self.step == num_steps or ((due or retry) and not self._persist_busy):
                    saved = self._save(tr)
                    if retry and self.rank == 0:
                        with self._lock:
                            self._retried.append(self.step)
                elif due and self.rank == 0:
                    # A persist is still in flight on some rank (storage slow or down): every rank
                    # skips this checkpoint together, rather than block training on storage.
                    with self._lock:
                        self._deferred.append(self.step)
                self._collect_persists()
            self._wait_persist()
            self._collect_persists()
        except RollBack as e:
            self._wait_persist()
            self._collect_persists()
            self._set(status="rollback")
            return {"status": "rollback", "step": self.step, "bad_steps": e.bad_steps, "generation": generation}
        except CollectiveError as e:
            self._set(status="aborted")
            self._teardown_after_failure(generation)
            self._exit_if_fenced(generation)
            return {"status": "aborted", "step": self.step, "error": str(e), "generation": generation}
        except Exception as e:  # noqa: BLE001 - the user's model/loss/data raised
            self._set(status="user_error")
            self._teardown_after_failure(generation)
            return {"status": "user_error", "step": self.step, "generation": generation,
                    "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        finally:
            self._running.clear()
        self._set(status="done")
        return {"status": "done", "step": self.step, "digest": self.state_digest(), "generation": generation}

    def save_again(self) -> dict:
        """The run's last checkpoint did not commit: save the final state again (every rank at
        once, as at any checkpoint step; its group is still formed) and wait for the persist.
        Its result reaches the controller with the next poll, like any other."""
        self._save(self.job.train)
        self._wait_persist()
        self._collect_persists()
        return {"step": self.step}

    def _wait_persist(self) -> None:
        """Wait for the persist in flight. While storage holds us up, say so: the controller must
        not take a stall that storage causes for a hang."""
        if self.ckpt.in_flight():
            self._set(status="storage_wait")
        self.ckpt.wait()
        self._set(status="running")

    def _save(self, tr) -> int:
        if self.ckpt.in_flight():
            self._set(status="storage_wait")  # only at the last step or a planned stop (see run())
        stall_s = self.ckpt.save(self.step, cursor_after(self.step, tr.global_batch_size),
                                 self._state(),
                                 {"loss": self._progress["loss"]})
        self._set(ckpt_stall_s=stall_s, status="running")
        return self.step

    def _train_step(self, micro: int) -> None:
        tr = self.job.train
        t_start = time.perf_counter()
        clock = ComputeClock(self.device)  # the rank's own work, on a GPU too (see compute_clock)
        clock.start()
        seed = step_seed(self.job.run.seed, self.step, self.rank)
        # The CPU generator, and on a GPU this process's one device's: all a step draws from.
        # torch.manual_seed would also queue lazy XPU/MTIA seeding (and on a CPU, CUDA's),
        # formatting the Python stack each time: up to 0.3 ms a step in a Ray actor's deep
        # stack, against 1 us for this (measured on CPU). Ray shows a worker one GPU.
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        # The data slice follows the rank's replica (its dp coordinate): every stage of a pipeline
        # replica works on the same samples; ddp and fsdp ranks are each a replica.
        lay = self.layout
        replica = lay.replica_of(self.rank)
        idx = self.order.rank_indices(self.step, tr.global_batch_size, lay.dp, replica)
        self.optimizer.zero_grad(set_to_none=True)
        self._prefetch_next(micro)
        stop_flag = 1.0 if self.stop_requested else 0.0
        busy_flag = 1.0 if self.ckpt is not None and self.ckpt.in_flight() else 0.0
        loss_fn = self.fns["stage_loss"] if tr.strategy == "pipeline" else self.fns["loss"]
        scale = self.amp["scale"] if self.amp else None
        if scale is not None:  # fp16: scale the loss so small gradients survive; unscaled below
            loss_fn = _scaled(loss_fn, scale)
        try:
            with torch.autocast(self.device.type, dtype=_AUTOCAST[tr.precision], enabled=tr.precision != "fp32"):
                local_loss = self.strategy.train_step(self.model, idx, self._load, loss_fn, micro)
            local_loss = local_loss.float().to(self.device)
        except Exception as e:
            if is_collective_failure(e):
                raise CollectiveError(f"{type(e).__name__}: {e}") from e
            raise
        finally:
            self._ahead, self._upcoming = self._upcoming, {}  # what was not used is not kept
        if scale is not None:
            local_loss = local_loss / scale
        if self.slow_factor > 1.0:
            if self.device.type == "cuda":  # a chaos drill only: slow by the work done, not by its launch
                torch.cuda.synchronize(self.device)
            chaos.busy_wait((self.slow_factor - 1.0) * (time.perf_counter() - t_start))
        clock.stop()
        try:
            # The step's statistics, summed over the whole world: every rank agrees on the stop,
            # whatever its stage. The host's flags join them by fill kernels, not by a copy: a copy
            # from a Python list to a GPU synchronises the stream (PyTorch waits for a pageable
            # copy), so it would hold the host here until backward had finished.
            owe_flag = 1.0 if self._owe_at is not None and time.monotonic() >= self._owe_at else 0.0
            stop, busy, owe = (torch.full((), f, device=self.device) for f in (stop_flag, busy_flag, owe_flag))
            check_grads = tr.clip_grad_norm is not None or scale is not None
            # Where every rank ends with the whole gradient (ddp), its norm needs no collective, and
            # the rest rides on the gradients' own reduction. Otherwise the squared norm of this
            # rank's part joins the statistics in one all-reduce after the reduction.
            flags = torch.stack([local_loss, stop, busy, (~torch.isfinite(local_loss)).float(), owe])
            ride = self.strategy.whole_grads_everywhere or not check_grads
            carried = self.strategy.reduce_gradients(self.model, flags if ride else None) is not None
            grads = self.strategy.local_grads(self.model)
            if scale is not None:
                torch._foreach_mul_(grads, 1.0 / scale)
            sumsq = _sum_of_squares(grads, self.device) if check_grads else torch.zeros((), device=self.device)
            stats = torch.cat([flags[:4], torch.stack([(~torch.isfinite(sumsq)).float(), sumsq]), flags[4:]])
            if not carried:
                dist.all_reduce(stats)
            norm_sq = sumsq if carried else stats[5] / self.strategy.grad_copies
        except (RuntimeError, dist.DistError) as e:
            raise CollectiveError(f"{type(e).__name__}: {e}") from e
        grad_norm = norm_sq.sqrt()
        # Every decision below reads one host copy: on a GPU each read of a device tensor is a
        # synchronisation of its own (on a CPU, `.cpu()` is the same tensor).
        host = stats.cpu()
        compute_s = clock.seconds()  # on a GPU, read now that the host copy has synchronised the stream
        self._update(tr, grads, host, grad_norm)
        self._set(grad_norm=float(grad_norm) if tr.clip_grad_norm is not None or self.amp else None)
        self.step += 1
        if self.scheduler is not None:
            self.scheduler.step()  # once per step, skipped or not: the schedule is a function of the step
        loss = host[0].item() / self.strategy.loss_ranks
        with self._lock:
            self._compute_log.append((self.step, compute_s, loss))
            if self.job.run.sample_ledger and lay.stage_of(self.rank) == 0:
                self._ledger.append((self.step, lay.dp, replica, idx))
        now = time.time()
        self._stop_agreed = bool(host[1].item() > 0)
        self._persist_busy = bool(host[2].item() > 0)  # on any rank: agreed, like the stop
        self._retry_agreed = bool(host[6].item() > 0)  # likewise: every rank saves again at this step
        self._set(step=self.step, loss=loss, step_end=now,
                  step_s=time.perf_counter() - t_start, compute_s=compute_s,
                  first_step_end=self._progress.get("first_step_end") or now)

    def _update(self, tr, grads: list[torch.Tensor], stats: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """The optimizer step of step `self.step + 1`, decided the same way on every rank from the
        all-reduced stats (a host copy): skipped after a rollback, after an fp16 overflow (the loss scale backs
        off), or for a non-finite loss or gradient (train.bad_step); clipped to the global norm."""
        step = self.step + 1
        bad_loss, bad_grads = bool(stats[3] > 0), bool(stats[4] > 0)
        if step in self.skip_steps:
            self._skip(step, "rolled back: this batch is skipped")
            return
        if self.amp and bad_grads and not bad_loss:
            self.amp["scale"].mul_(0.5)
            self.amp["good_steps"].zero_()
            self._skip(step, "fp16 overflow: loss scale halved")
            return
        if bad_loss or bad_grads:
            what = "loss" if bad_loss else "gradient norm"
            if tr.bad_step == "raise":
                raise BadStep(f"step {step}: non-finite {what} on some rank (train.bad_step=raise)")
            self._bad_in_a_row.append(step)
            self._skip(step, f"non-finite {what} (train.bad_step={tr.bad_step})")
            if len(self._bad_in_a_row) >= tr.bad_step_limit:
                if tr.bad_step == "skip":
                    raise BadStep(f"steps {self._bad_in_a_row}: {len(self._bad_in_a_row)} bad steps in a row "
                                  f"(train.bad_step_limit={tr.bad_step_limit}); last: non-finite {what}")
                raise RollBack(list(self._bad_in_a_row))
            return
        self._bad_in_a_row = []
        if tr.clip_grad_norm is not None:
            coef = tr.clip_grad_norm / (grad_norm + 1e-6)
            if coef < 1:
                torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        if self.amp:
            self.amp["good_steps"].add_(1)
            if int(self.amp["good_steps"]) >= LOSS_SCALE_GROWTH_INTERVAL:
                self.amp["scale"].mul_(2.0)
                self.amp["good_steps"].zero_()

    def _skip(self, step: int, why: str) -> None:
        with self._lock:
            self._skipped.append((step, why))

    def _load(self, ids: list[int]):
        """The collated batch of global sample ids, on this rank's device: read ahead if it was
        (by the data workers, or the train.prefetch thread), else read now. A dataset that reads a batch at once (`__getitems__`, as
        torch's DataLoader uses) does."""
        batch = None
        if self._loader is not None:  # train.data_workers (started by the restore)
            batch = self._loader.get(self.step, ids, self._batch_keys)
        else:
            ahead = self._ahead.pop(tuple(ids), None)
            batch = ahead.result() if ahead is not None else None
        if batch is None:
            batch = self._collate(ids)
        return _to(batch, self.device)

    def _batch_keys(self, step: int) -> list[tuple[int, tuple[int, ...]]]:
        """The (step, sample ids) of each batch this rank reads in `step`, in the order it reads
        them (its share of the global order, cut into micro-batches): the data workers' plan."""
        lay, tr = self.layout, self.job.train
        ids = self.order.rank_indices(step, tr.global_batch_size, lay.dp, lay.replica_of(self.rank))
        m = self._micro or len(ids)
        return [(step, tuple(ids[i:i + m])) for i in range(0, len(ids), m)]

    def _collate(self, ids: list[int]):
        return collate(self.dataset, ids)

    def _prefetch_next(self, micro: int) -> None:
        """Start on the next step's samples while this step computes: same ids, same order, only
        earlier. train.prefetch collates them on a background thread (in this step's micro-batch
        chunks); a dataset that can read ahead itself (`prefetch(ids)`, e.g. ParquetDataset)
        is told which rows come next."""
        if not self.strategy.needs_data or self.job.train.data_workers:
            return  # data workers read ahead on their own
        lay, tr = self.layout, self.job.train
        nxt = self.order.rank_indices(self.step + 1, tr.global_batch_size, lay.dp, lay.replica_of(self.rank))
        if tr.prefetch:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="elastic-prefetch")
            self._upcoming = {tuple(c): self._pool.submit(self._collate, c)
                              for c in ([nxt[i:i + micro] for i in range(0, len(nxt), micro)] if micro else [nxt])}
        elif hasattr(self.dataset, "prefetch"):
            self.dataset.prefetch(nxt)

    def _fire(self, fault: dict) -> None:
        # Tell the controller first (it records the fault time and never hands this fault out
        # again), then fault. The report must land before the process dies, hence ray.get.
        uploading = self._await_upload(self.job.failure.collective_timeout_s) if fault.get("during_upload") else None
        if fault.get("after_persist") and self.ckpt is not None:
            self.ckpt.wait(self.job.failure.collective_timeout_s)
        if self.controller is not None:
            ray.get(self.controller.report_fault.remote(fault, self.rank, self.step, time.time(), os.getpid(),
                                                        self.generation, uploading))
        if fault["action"] == "slow":
            self.slow_factor = fault["factor"]  # the process stays slow; the rank may move elsewhere
            return
        if fault["action"] == "hold_gil":
            chaos.hold_gil(fault["hold_s"])  # then trains on: a busy rank, not a lost one
            return
        chaos.inject(fault["action"], fault.get("thaw_after_s"))

    def _await_upload(self, limit_s: float) -> bool:
        """Wait (at most `limit_s`) until this rank's persist in flight writes to storage; True if
        it does now. False at once when no persist is in flight, or when it ends first."""
        ck, deadline = self.ckpt, time.monotonic() + limit_s
        while ck is not None and ck.in_flight() and time.monotonic() < deadline:
            if ck.writing.wait(0.02):
                return ck.in_flight()
        return False

    def _exit_if_fenced(self, generation: int) -> None:
        """A rank whose group failed asks the controller whether its generation is still the
        run's. One that was frozen or cut off while the run moved on (or whose controller is
        gone) holds nothing anyone needs: it exits rather than linger as a zombie."""
        if self.controller is None:
            return
        try:
            current = ray.get(self.controller.is_current.remote(generation), timeout=self.job.failure.ping_timeout_s * 10)
        except Exception:  # noqa: BLE001 - an unreachable controller: the run is over for this process too
            current = False
        if not current:
            os._exit(0)

    def _teardown_after_failure(self, generation: int) -> None:
        # Closing our sockets makes peers still blocked on us fail fast instead of waiting for the
        # collective timeout: the error cascades through the group. Destroying the default group
        # is not enough: sub-groups (a pipeline's pp and dp groups, the checkpoint group) stay
        # open while the mesh and the schedule hold them, and a peer that talks to us only there
        # (a pipeline neighbour) would wait until the settle bound. So shut every pair socket
        # this generation opened, then destroy.
        if self.ckpt is not None:
            self.ckpt.abort()
        if generation == self.generation:
            if self._abort is not None:
                self._abort.abort()
            _destroy_group()

    # ---------------------------------------------------------------- telemetry
    def _set(self, **kv) -> None:
        with self._lock:
            self._progress = {**self._progress, **kv}

    def _still_abandoned(self) -> tuple[AsyncCheckpointer, ...]:
        with self._lock:
            return tuple(self._abandoned)

    def _collect_persists(self) -> None:
        with self._lock:  # poll() runs beside run() and leave()
            running = [ck for ck in self._abandoned if ck.in_flight()]  # before draining: no result missed
            for ck in (*self._abandoned, self.ckpt):
                if ck is not None:
                    results = ck.drain()
                    self._persists.extend(r.__dict__ for r in results)
                    if ck is self.ckpt:
                        for r in results:
                            self._note_persist(r.error)
            self._abandoned = running

    def _note_persist(self, error: str | None) -> None:
        """A persist of this group ended: a storage failure leaves a checkpoint owed, after a wait
        that doubles with each failed retry; a success settles it."""
        if error is None:
            self._owe_at, self._owe_fails = None, 0
        elif owes_retry(error):
            self._owe_at = time.monotonic() + retry_wait_s(self.job.checkpoint.persist_retry_backoff_s,
                                                           self._owe_fails)
            self._owe_fails += 1

    def poll(self) -> dict:
        """Progress and finished persists since the last poll (each persist reported once)."""
        self._collect_persists()
        with self._lock:
            out = dict(self._progress, rank=self.rank, generation=self.generation, persists=self._persists,
                       persisting=self.ckpt is not None and self.ckpt.in_flight(),
                       compute_log=self._compute_log, ledger=self._ledger, deferred=self._deferred,
                       skipped=self._skipped, abandoned=self._abandoned_steps, retried=self._retried)
            self._retried = []
            self._abandoned_steps = []
            self._deferred = []
            self._skipped = []
            self._persists = []
            self._compute_log = []
            self._ledger = []
        return out


_AUTOCAST = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _scaled(loss_fn, scale: torch.Tensor):
    return lambda *args: loss_fn(*args) * scale


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack([n.float() for n in torch._foreach_norm(grads)]).pow(2).sum().to(device)


def _destroy_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may fail to tear down; it is gone either way
            pass


def _to(batch, device: torch.device):
    """Move a collated batch (tensors, possibly nested in tuples/lists/dicts) to the device."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def _hash_into(h, obj) -> None:
    if isinstance(obj, torch.Tensor):
        h.update(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if obj.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            _hash_into(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _hash_into(h, v)
    else:
        h.update(repr(obj).encode())
