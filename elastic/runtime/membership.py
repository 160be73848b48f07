"""The worker's membership of a group generation: joining it (rendezvous, process group, device
mesh, the checkpoint group, the transports an abort cuts), aborting its collectives when a peer
goes silent, leaving it, and tearing it down after a failure. A mixin of `Worker`
(elastic/runtime/worker.py), whose state it reads and sets: the generation, rank, layout, mesh,
strategy and checkpointer."""
from __future__ import annotations

import os
import time
from datetime import timedelta

import ray
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from elastic.group import rendezvous
from elastic.parallel.base import forget_old_meshes
from elastic.parallel.strategies import make_strategy
from elastic.parallel.topology import Layout
from elastic.protocol import AbortResult, RankStatus
from elastic.runtime import collectives


class GroupMembership:
    # ---------------------------------------------------------------- group
    def join(self, addr: str, port: int, rank: int, world_size: int, generation: int, pp: int = 1) -> None:
        """Form generation `generation` of the group. The rendezvous (the controller's store at
        `addr:port`, elastic/group/rendezvous.py, under this generation's prefix) waits at most
        failure.rendezvous_timeout_s; the group's collectives at most
        failure.collective_timeout_s, a backstop: the controller aborts a collective blocked on
        a silent peer long before (see `abort`). `pp`: pipeline stages (elastic.parallel.topology: rank =
        replica x pp x tp + stage x tp + tp index); 1 for ddp and fsdp. train.tp.size is the run's."""
        if self._running.is_set():
            # A run() still blocked in a collective of the old group would, when it finally fails,
            # tear down whatever group is current. Refuse; the controller aborts or replaces us.
            raise RuntimeError("previous run() is still inside a collective of the old group")
        self._join_phase = (f"leaving generation {self.generation}", time.monotonic())
        self._join_pending = generation
        self.leave()
        with self._join_lock:  # an abort that came while leaving is seen here, or cuts the rendezvous
            if self._join_cut == generation:
                self._join_phase = None
                raise RuntimeError(f"the formation of generation {generation} was cut before this rank "
                                   f"reached its rendezvous")
            self.generation = generation
            before = collectives.socket_inodes()
            self._joining = (before, port)
        self.stop_requested = self._stop_agreed = self._persist_busy = self._retry_agreed = False  # one generation's
        fc = self.job.failure
        try:
            self._join_phase = ("waiting for the others at the rendezvous", time.monotonic())
            store = dist.PrefixStore(rendezvous.prefix(generation), dist.TCPStore(
                addr, port, is_master=False, timeout=timedelta(seconds=fc.rendezvous_timeout_s)))
            collectives.fresh_group_names()  # after a cut formation: the same names as every other member
            dist.init_process_group(
                "nccl" if self.job.scaling.use_gpu else "gloo", store=store,
                rank=rank, world_size=world_size, timeout=timedelta(seconds=fc.collective_timeout_s))
            self._join_phase = ("building the device mesh and the checkpoint group", time.monotonic())
            self.rank, self.world_size = rank, world_size
            tp, shards = self.job.train.tp.size, self.job.hsdp_shards
            self.layout = Layout(pp, world_size // (pp * shards * tp), tp, shards)
            device = "cuda" if self.job.scaling.use_gpu else "cpu"
            # Axes of size 1 are left out (a 1-D "dp" mesh for ddp and fsdp without tp; HSDP's "shard").
            axes = [(n, k) for n, k in (("dp", self.layout.dp), ("shard", shards), ("pp", pp), ("tp", tp))
                    if n == "dp" or k > 1]
            self.mesh = init_device_mesh(device, tuple(k for _, k in axes), mesh_dim_names=tuple(n for n, _ in axes))
            for name, _ in axes[1:]:
                # Created now, inside the window whose sockets `capture` records for an abort.
                self.mesh.get_group("dp"), self.mesh.get_group(name)
            # Checkpoint collectives run on their own group, from the persist thread, concurrently
            # with training collectives on the default group.
            self.ckpt_pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=fc.collective_timeout_s))
            # checkpoint.memory_sync's copies go rank to rank over gloo: on CPUs the training
            # group (the training thread waits for them), beside NCCL a gloo group of their own.
            self.copies_pg = (dist.new_group(backend="gloo", timeout=timedelta(seconds=fc.collective_timeout_s))
                              if self.job.scaling.use_gpu and self.job.checkpoint.memory_sync else None)
        finally:
            self._joining = None
        self._join_phase = ("sharing its transports for an abort", time.monotonic())
        self._abort = collectives.capture(before, self.ckpt_pg, nccl=self.job.scaling.use_gpu, store_port=port)
        self.strategy = make_strategy(self.job.train, self.mesh, self.layout, rank, self.job.run.seed)
        self.forget_old_meshes()
        self._join_phase = None
        self.set_progress(status=RankStatus.JOINED)

    def abort(self, generation: int) -> AbortResult:
        """Fail this rank's collectives of `generation` now (a peer went silent): run() returns
        "aborted" with the state of the last completed step, and the rank can join a new group.
        A stale request (an older generation) is ignored, so it can never cut a newer group."""
        phase = self._join_phase  # where a join of this rank is, for the formation's failure report
        where = f"{phase[0]} for {time.monotonic() - phase[1]:.1f} s" if phase else None
        with self._join_lock:
            if generation != self.generation:
                if generation == self._join_pending:  # still leaving the old group: it never enters this one
                    self._join_cut = generation
                    return AbortResult(aborted=True, running=False, step=self.step, joining=where)
                return AbortResult(aborted=False, reason=f"generation {self.generation}, not {generation}",
                                   joining=where)
            joining = self._joining
            if joining is not None:  # still forming this generation: cut its rendezvous
                return AbortResult(aborted=True, transports=collectives.cut_rendezvous(*joining), running=False,
                                   step=self.step, joining=where)
        n = self._abort.abort() if self._abort is not None else 0
        return AbortResult(aborted=True, transports=n, running=self._running.is_set(), step=self.step)

    def forget_old_meshes(self) -> None:
        """Sharded and tensor-parallel tensors only: see parallel.base.forget_old_meshes (called
        in each thread)."""
        if self.strategy is not None and (self.strategy.sharded or self.strategy.tp > 1):
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
                self.book.abandon(self.ckpt)
            self.book.collect(self.ckpt)
            self.staging = self.ckpt.spare_buffers()  # for the next group's first checkpoint
            self.ckpt = None
        _destroy_group(self._abort)


    # ---------------------------------------------------------------- faults and failures
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
            _destroy_group(self._abort)


def _destroy_group(abort: collectives.GroupAbort | None) -> None:
    if dist.is_initialized():
        if abort is not None and abort.aborted:
            collectives.bury()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may fail to tear down; it is gone either way
            pass
