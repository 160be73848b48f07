"""The three ways a rank's state comes back after a group (re)forms, and what each ends with.

- storage (`from_storage`): the newest loadable committed checkpoint, or rank 0's fresh init;
- a peer (`from_peer`): a survivor's state broadcast through the new group, no storage read;
- shards (`offer` then `from_shards`): a sharded strategy's parts re-sharded in memory at a
  planned resize, through Ray's object store or rank to rank.

Each returns a `RestoreResult` and ends in `start_checkpointer`: the schedule caught up, data
workers reading from the restored step, checkpoints from there. Functions of the worker (`w`).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import ray
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elastic.checkpoint import fencing
from elastic.checkpoint.dcp_io import UploadBound
from elastic.checkpoint.loading import load_shards, verify_shards
from elastic.checkpoint.persister import AsyncCheckpointer
from elastic.checkpoint.retry import describe_failure
from elastic.data.fingerprint import KEY as FINGERPRINT_KEY
from elastic.parallel import resharding
from elastic.parallel.broadcast import broadcast_tensors
from elastic.protocol import RankStatus, RestoreResult
from elastic.runtime import state

if TYPE_CHECKING:
    from elastic.runtime.worker import Worker


def from_storage(w: Worker, candidates: list[str]) -> RestoreResult:
    """Storage path. Fresh model and optimizer from the seed, then the newest loadable
    checkpoint among `candidates` (committed folders, newest first). Each candidate's files
    are first checked against its manifest's digests (`verify_shards`: each file read once
    across the group): one whose bytes changed since its commit is skipped, its reason naming
    the file. The load then checks every byte it reads against the same manifest, so bytes that
    changed after the verification fail the load too, and are never loaded. The step restored is
    the verified manifest's (checked against the folder's name there, and against COMMITTED by
    the listing): no further read, whose storage blip would fail the rank outside any retry.
    All ranks call this with the same list; the verification and DCP raise on every
    rank when any rank fails, so they move to the next candidate together. With no candidates,
    rank 0's fresh init is broadcast.
    When there are some but none loads (storage out, or every one unreadable), nothing is
    started: source "none loaded", and the controller decides (it never means step 0).
    Returns what was loaded and what was skipped, and why."""
    t0 = time.monotonic()
    w.kept_offer = None  # a re-shard in memory that fell back to storage
    w.forget_old_meshes()
    w.step = 0
    skipped = []
    loaded = None
    for uri in candidates:
        try:
            manifest = verify_shards(uri, w.storage.options, w.ckpt_pg)
        except Exception as e:  # noqa: BLE001 - corrupt or unreadable: try the previous one
            skipped.append((uri, describe_failure(e)))
            continue
        state.build(w, fill=False)  # DCP's load is strict: every tensor of the state dict is read
        st = state.state_dict(w)
        if manifest.world_size != w.world_size:  # rank-private state of another layout: starts at zero
            st.pop("compression_own", None)
        try:
            # DCP reads each saved shard into the current layout: a checkpoint saved at any
            # world size loads at this one.
            load_shards(st, uri, w.storage.options, w.ckpt_pg, manifest=manifest)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - corrupt or unreadable: try the previous one
            skipped.append((uri, describe_failure(e)))
            continue
        state.load_state(w, st)
        w.step = manifest.step
        loaded = uri
        break
    if loaded is None and candidates:
        return RestoreResult(step=w.step, source="none loaded", restore_s=time.monotonic() - t0, uri=None,
                             skipped=tuple(skipped))
    if loaded is None:
        # Every rank builds the same init from the seed; broadcasting rank 0's copy makes that
        # an invariant rather than an assumption about the user's factory.
        state.build(w, sync_init=True)
        if w.job.train.init_from:  # a fine-tune's fresh start: the pretrained weights over the init
            state.load_pretrained(w)
    start_checkpointer(w)
    return RestoreResult(step=w.step, source="storage" if loaded else "init", restore_s=time.monotonic() - t0,
                         uri=loaded, skipped=tuple(skipped))


def from_peer(w: Worker, src_rank: int, slot_sources: list[int] | None = None, held: bool = False) -> RestoreResult:
    """Memory path: take model, optimizer and step from rank `src_rank`, a survivor that
    holds the newest state, through the new group. No storage read. A layout of several slots
    (pipeline stages, tensor slices) names one source per slot (`slot_sources[slot]`, a replica
    of that slot); a rank whose model was built for another stage (a spare, a re-numbered
    survivor) builds its stage first. `held`: this rank held state before the restore; at the
    source's step, built for its slot, it holds the source's state, sends and receives nothing."""
    t0 = time.monotonic()
    w.kept_offer = None
    own_step = w.step
    if w.model is None or w.built_for != w.strategy.layout_key:
        held = False
        state.build(w, fill=False, copied=True)  # every tensor comes from the source next
    elif (w.strategy.tp > 1 or w.strategy.sharded) and w.built_generation != w.generation:
        state.rebind(w)  # its DTensors (HSDP: its FSDP groups) are bound to the old group's mesh
    t_build = time.monotonic()
    step = torch.tensor([w.step], dtype=torch.int64, device=w.device)
    dist.broadcast(step, src=src_rank)
    w.step = int(step.item())
    src = slot_sources[w.layout.slot_of(w.rank)] if slot_sources else src_rank
    t_move = time.monotonic()
    moved = w.strategy.broadcast_state(w.model, w.optimizer, src, holds=held and own_step == w.step)
    if w.amp:
        broadcast_tensors([w.amp[k] for k in sorted(w.amp)], src, w.mesh.get_group("dp"))
    t_moved = time.monotonic()
    start_checkpointer(w)
    # Where a restore's seconds go besides the copy: the build (a spare's model on meta made
    # real), the step's broadcast (the first collective: the new group's connections), the
    # checkpointer and data workers started again.
    phases = {"build": round(t_build - t0, 3), "agree_step": round(t_move - t_build, 3),
              "transfer": t_moved - t_move, "start_checkpointer": round(time.monotonic() - t_moved, 3)}
    # A broadcast (on GPU) reaches every rank of the slot's group but its source, held or not.
    p2p = (dict(received_bytes=0 if w.rank == src else state.local_bytes(w)) if moved is None else
           dict(senders=len(moved.holders), receivers=len(moved.receivers),
                received_bytes=moved.received_bytes))
    return RestoreResult(step=w.step, restore_s=time.monotonic() - t0,
                         source=f"peer rank {src}" if not slot_sources else f"slot replicas {list(slot_sources)}",
                         phases=phases, state_bytes=state.local_bytes(w), **p2p)


def offer(w: Worker, publish: bool = True) -> dict:
    """This rank's part of the state, for a re-shard in memory at a planned resize. Published
    (returned through Ray), it stays in this node's object store (owned by the caller) after
    this process is gone: for a rank that leaves. A rank that stays in the new group keeps it
    here instead and sends its rows rank to rank (resharding.exchange); it returns only a
    marker."""
    w.forget_old_meshes()
    part = w.strategy.offer(state.state_dict(w), w.rank, w.world_size, w.step)
    if publish:
        return part
    w.kept_offer = part
    return {"part": part["part"], "world": part["world"], "step": part["step"], "kept": True}


def from_shards(w: Worker, offers: list, old_world: int, old_pp: int = 1,
                holders: dict[int, int] | None = None, copies_step: int | None = None) -> RestoreResult:
    """Memory path of a sharded strategy: a fresh sharded build at the new world size, filled
    from the old ranks' offers (`offers[old_rank]`, object refs), reading only the parts
    this rank's new shards overlap. No storage read. `holders` (old part -> new rank): parts
    kept in the memory of ranks of the new group, moved rank to rank instead: at a planned
    resize a rank's own offer; after a fault (`copies_step`) the in-memory copies of that step,
    each survivor's own and those it holds as a buddy (memory_copies.py)."""
    t0 = time.monotonic()
    phases: dict[str, float] = {}

    def phase(name: str, since: float) -> float:
        now = time.monotonic()
        phases[name] = round(now - since, 3)
        return now

    w.forget_old_meshes()
    state.build(w, fill=False)  # every tensor is filled from the offers next (assembly checks it)
    st = state.state_dict(w)
    t = phase("build", t0)
    holders = holders or {}
    own, w.kept_offer = w.kept_offer, None
    kept = {own["part"]: own} if own is not None else {}
    if copies_step is not None:
        kept.update(w.copies.parts_at(copies_step, [p for p, r in holders.items() if r == w.rank]))
    pipeline = w.strategy.name == "pipeline"  # by name, from replica 0 of each old stage (rank = stage)
    if pipeline:
        parts = w.strategy.needed_stages(old_pp)
    else:
        parts = resharding.needed_parts(st, old_world, w.world_size, w.rank, frozenset(holders), w.strategy.tp)
    # Within the restore's backstop: an old rank's node frozen with its part in its object store
    # would hold this read for good (the heartbeat finds the node; this rank then fails here).
    got = dict(zip(parts, ray.get([offers[p] for p in parts], timeout=w.job.failure.collective_timeout_s)))
    t = phase("fetch", t)
    received = None
    if pipeline:
        w.step = w.strategy.assemble(st, got)
    else:
        moved = resharding.exchange(st, kept, got, holders, old_world, w.world_size, w.rank, w.ckpt_pg,
                                    w.strategy.tp)
        w.step, received = moved.step, moved.received_bytes or None
    del got, own, kept
    t = phase("assemble", t)
    state.load_state(w, st)
    t = phase("load", t)
    start_checkpointer(w)
    phase("start_checkpointer", t)
    return RestoreResult(step=w.step, restore_s=time.monotonic() - t0, phases=phases, received_bytes=received,
                         source=f"re-sharded in memory from {old_world} ranks (read parts {parts}"
                                f"{f', rank to rank from {sorted(holders)}' if holders else ''}"
                                f"{f', copies of step {copies_step}' if copies_step is not None else ''})")


def start_checkpointer(w: Worker) -> None:
    """The last part of every restore path: the schedule caught up, data workers reading
    from the restored step, checkpoints from here."""
    state.replay_schedule(w)
    w.runner.forget_bad_run()
    w.runner.data.start()
    w.ckpt = AsyncCheckpointer(
        w.storage, w.root, w.rank, w.world_size, w.strategy.name, w.ckpt_pg,
        w.job.checkpoint.persist_retries, w.job.checkpoint.persist_retry_backoff_s,
        w.job.checkpoint.num_to_keep,
        data_order={"global_batch_size": w.job.train.global_batch_size, "seed": w.job.run.seed,
                    "num_samples": len(w.dataset),
                    **({FINGERPRINT_KEY: w.dataset_fingerprint} if w.dataset_fingerprint else {})},
        may_write=fencing.Fence(w.storage, w.root, w.generation),
        # Half the checkpoint group's collective timeout: a rank that waits the whole bound
        # still meets its peers in the agreement's all-reduce before that times out.
        after=w.book.still_abandoned(), wait_timeout_s=w.job.failure.collective_timeout_s / 2,
        staged=w.staging,
        # A rollback goes back past a run of up to bad_step_limit - 1 bad steps: retention keeps
        # the newest checkpoint before such a run (see apply_retention).
        rollback_window=w.job.train.bad_step_limit - 1 if w.job.train.bad_step == "rollback" else 0,
        upload_bound=UploadBound(w.job.checkpoint.upload_timeout_s, w.job.checkpoint.upload_min_mb_per_s),
        persist_timeout_s=w.job.checkpoint.persist_timeout_s)
    w.staging = None
    w.copies.clear()  # the restored state is the new starting point; copies begin again from it
    w.set_progress(step=w.step, status=RankStatus.RESTORED, step_end=None, first_step_end=None, holds_state=True)
