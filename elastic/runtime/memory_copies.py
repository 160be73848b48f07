"""In-memory copies of sharded state on another node (checkpoint.memory_every_steps).

Every k steps each rank of a sharded strategy takes its part of the state (the same offer a
planned re-shard uses: its local rows of every sharded tensor, everything else whole, CPU copies)
and keeps it; a background thread sends the same part to its buddy, a rank on another node
(elastic/policies/buddies.py), which keeps it in its own process memory. A fault then finds, for
the newest step every part was copied at, the survivors' own parts in their memory and each lost
rank's part at its buddy: the controller re-shards the new group from them (restore.from_shards)
with no storage read.

Which steps are copied is agreed: a copy due while some rank's last one is still on its way, or
before the steps since its last copy have earned that copy's measured cost within
checkpoint.memory_max_overhead, is skipped by every rank (the step statistics' COPYING slot), so
every rank holds parts of the same steps, and copies cost at most that share of the time. A
copy's cost is what it takes from training: the time taking it holds the training thread, plus
what the steps run while its send is on its way took beyond the steps without one (their
median). Where sending competes with training for the CPU that is most of the send; where it
does not (a GPU trains, spare cores serialise) it is little, and copies come more often. Each
keeps its last two parts and its buddies' last two: the newer may not have reached every buddy
when a fault comes, the older has (its sends had ended before the newer began).
A copy being received never replaces the last complete one: it is kept beside it until whole.

With checkpoint.memory_sync the copy is on the critical path instead: every rank sends its part
to its buddy rank to rank over gloo and receives the parts it keeps (copy_exchange.py), and the
step counts as done only then (the worker holds the step's report until every rank's copies are
in: one small all-reduce), so a step the controller has seen done always has every part at a
buddy, and a fault redoes none of them at memory_every_steps 1.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import ray
import torch
from torch.distributed.tensor import DTensor

from elastic.parallel.resharding import map_leaves
from elastic.runtime.copy_exchange import exchange_parts
from elastic.runtime import state

if TYPE_CHECKING:
    from elastic.runtime.worker import Worker

KEEP = 2  # parts kept per rank: the newest, and the one before it (complete at every buddy)
BASE_STEPS = 3  # steps without a send measured before the first copy: what a step costs without one


# ---------------------------------------------------------------- on the wire: NumPy, not pickled tensors
class _Array:
    """A CPU tensor on its way to a buddy as a NumPy array: Ray serialises NumPy out of band (one
    copy into its object store), where a pickled tensor is copied through pickle's bytes (8 MB:
    10 ms to pickle and 5 ms to unpickle here, measured)."""

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        raw = t.contiguous()
        if raw.dtype == torch.bfloat16:  # NumPy has no bfloat16: the same bits as int16
            raw = raw.view(torch.int16)
        self.array = raw.numpy()

    def tensor(self) -> torch.Tensor:
        """A tensor of the receiver's own (copied out of the object store's read-only buffer)."""
        t = torch.from_numpy(self.array.copy())
        return t.view(self.dtype) if self.dtype == torch.bfloat16 else t


def to_wire(part: dict) -> dict:
    return map_leaves(part, lambda v: _Array(v) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v)


def from_wire(part: dict) -> dict:
    return map_leaves(part, lambda v: v.tensor() if isinstance(v, _Array) else v)


def as_snapshot(tree, part: dict, path: tuple = ()):
    """`tree` (the state the offer `part` was taken from, at the same step in the same group) with
    every tensor replaced by the part's copy of it, as a checkpoint's snapshot: a shard as a
    DTensor over the part's rows (its mesh, placements and global shape), any other tensor as
    the part's copy. None where some tensor has no copy of the same shape (no snapshot then)."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out[k] = as_snapshot(v, part, path + (k,))
            if out[k] is None and v is not None:
                return None
        return out
    if isinstance(tree, list):
        out = [as_snapshot(v, part, path + (i,)) for i, v in enumerate(tree)]
        return None if any(o is None and v is not None for o, v in zip(out, tree)) else out
    if isinstance(tree, DTensor):
        rows = part["sharded"].get(path)
        if rows is None or rows.shape != tree.to_local().shape or rows.dtype != tree.dtype:
            return None
        return DTensor.from_local(rows, tree.device_mesh, tree.placements, run_check=False,
                                  shape=tree.shape, stride=tree.stride())
    if isinstance(tree, torch.Tensor):
        copy = part["other"].get(path)
        ok = isinstance(copy, torch.Tensor) and copy.shape == tree.shape
        return copy if ok and copy.dtype == tree.dtype else None
    if isinstance(tree, (tuple, set)) and any(isinstance(v, torch.Tensor) for v in tree):
        return None  # tensors the offer kept by reference, not copied
    return tree


class MemoryCopies:
    """One rank's own parts by step, and the parts it holds for other ranks (its buddies')."""

    def __init__(self, every_steps: int, max_overhead: float = 0.03, sync: bool = False):
        self.every = every_steps
        self.max_overhead = max_overhead
        self.sync = sync  # checkpoint.memory_sync: take() exchanges the copies rank to rank before it returns
        self.delay_s = 0.0  # the slow_copies chaos fault: each send held back this long (a slow link)
        self.cost_s = 0.0  # what the last copy cost training: taking it, and its send's slowdown of steps
        self.last_step: int | None = None  # the step of the last copy taken
        self._base = deque(maxlen=9)  # times of the latest steps run with no send on its way
        self._extra_s: float | None = None  # while a send is on its way: the time its steps took beyond those
        self._lock = threading.Lock()
        self.own: dict[int, dict] = {}  # step -> this rank's part
        self.held: dict[int, dict[int, dict]] = {}  # rank -> step -> that rank's part
        self._held_gen: dict[int, int] = {}  # rank -> the group its held parts belong to
        self.generation: int | None = None  # the group the parts belong to
        self.buddy = None  # (rank, actor handle) that holds this rank's parts, or None
        self.holds_for: tuple[int, ...] = ()  # the ranks whose buddy this rank is (memory_sync receives their parts)
        self._sender: threading.Thread | None = None
        self._sender_gen: int | None = None  # the group whose part the sender carries

    # ---------------------------------------------------------------- in a group
    def start(self, generation: int, buddy, holds_for: tuple[int, ...] = ()) -> None:
        """A new group's run: parts of an older group are dropped (their layout is gone)."""
        with self._lock:
            if generation != self.generation:
                self.own = {}
                self.held = {r: s for r, s in self.held.items() if self._held_gen.get(r) == generation}
            self.generation, self.buddy, self.holds_for = generation, buddy, tuple(holds_for)

    def clear(self) -> None:
        """After a restore: the state is the restored one; copies start again from it (and the
        step time without one is measured again: the group may have changed)."""
        with self._lock:
            self.own, self.held, self._held_gen = {}, {}, {}
            self.generation, self.last_step = None, None
            self._base.clear()
            self._extra_s = None

    def sending(self) -> bool:
        """A send of this group's is on its way; one of an older group (its buddy may be the
        frozen rank the group re-formed without) holds nothing back: its part is of no use now."""
        return (self._sender is not None and self._sender.is_alive()
                and self._sender_gen is not None and self._sender_gen == self.generation)

    def holding_back(self, step: int, step_s: float | None) -> bool:
        """This rank's vote against a copy at the step after `step` (the step statistics' COPYING
        slot; one vote skips it on every rank): its last send is still on its way (or its cost is
        not counted yet), fewer than BASE_STEPS steps without one have been timed, or the steps
        since its last copy have not yet earned that copy's cost within the budget
        (cost <= max_overhead x steps x step time: copies spaced so they cost at most that share).
        Never with memory_sync: its copies are never spaced (and never on their way between steps)."""
        if self.sync:
            return False
        if self.sending() or self._extra_s is not None or len(self._base) < BASE_STEPS:
            return True
        if self.last_step is None or not step_s or not self.cost_s:
            return False
        return (step + 1 - self.last_step) * step_s * self.max_overhead < self.cost_s

    def note_step(self, step_s: float) -> None:
        """After every step (before a copy is taken at it): a step run with no send on its way
        joins the baseline; one run while a send was on its way adds what it took beyond the
        baseline's median to that copy's cost, which is complete at the first step after the send
        ended."""
        if self._extra_s is None:
            self._base.append(step_s)
            return
        self._extra_s += max(0.0, step_s - statistics.median(self._base)) if self._base else step_s
        if not self.sending():
            self.cost_s += self._extra_s
            self._extra_s = None

    def due(self, step: int, copying: bool) -> bool:
        return bool(self.every) and self.buddy is not None and step % self.every == 0 and not copying

    def holds_report(self, step: int) -> bool:
        """With memory_sync, whether `step`'s report waits for its copies (a copy is due at it)."""
        return self.sync and self.due(step, False)

    def take(self, w: Worker, aborted=lambda: False, timeout_s: float = 120.0) -> None:
        """This rank's part at its current step, kept, and sent to its buddy in the background;
        with memory_sync, exchanged here rank to rank (its own sent, its buddies' received and
        kept). That exchange ends with GroupAborted once `aborted()` (the group was aborted: a
        peer went silent) or after `timeout_s`; the controller then restores from the copies
        before."""
        t0 = time.perf_counter()
        # memory_sync: the oldest part kept (never needed again once this one is in) is reused
        # as this one's memory, here and at the buddies (a send in the background may still read it).
        ckpt = getattr(w, "ckpt", None)
        into = self._evict_oldest(self.own, ckpt) if self.sync else None
        tree = state.state_dict(w)
        part = w.strategy.offer(tree, w.rank, w.world_size, w.step, into=into)
        self.cost_s = time.perf_counter() - t0  # on the training thread; the send's share follows (note_step)
        self._extra_s = 0.0
        self.last_step = w.step
        with self._lock:
            self.own[w.step] = part
            for old in sorted(self.own)[:-KEEP]:
                del self.own[old]
        if self.sync and ckpt is not None:
            self._share_with_checkpoint(w, ckpt, tree, part)
        _, handle = self.buddy
        gen = self.generation
        delay_s = self.delay_s
        if self.sync:
            if delay_s:
                time.sleep(delay_s)
            reuse = {r: self._evict_oldest(self.held.get(r, {})) for r in self.holds_for
                     if self._held_gen.get(r) == gen}
            got = exchange_parts(part, self.buddy[0], list(self.holds_for), w.copies_pg, aborted, timeout_s,
                                 reuse={r: p for r, p in reuse.items() if p is not None})
            for rank, held in got.items():
                self.keep(rank, gen, held)
            self.cost_s, self._extra_s = time.perf_counter() - t0, None  # the whole of it held the step
            return

        # A buddy frozen with its node (Ray still lists it alive) never answers: without a bound
        # this send would stay "on its way" for good, and this rank would vote against every copy.
        bound_s = w.job.failure.collective_timeout_s

        def send() -> None:
            try:
                if delay_s:
                    time.sleep(delay_s)
                ray.get(handle.hold_copy.remote(w.rank, gen, to_wire(part)), timeout=bound_s)
            except Exception:  # noqa: BLE001 - the buddy is gone or frozen: the copy is lost, the polls say why
                pass

        self._sender = threading.Thread(target=send, name="memory-copy", daemon=True)
        self._sender_gen = gen
        self._sender.start()

    def _evict_oldest(self, parts: dict[int, dict], ckpt=None) -> dict | None:
        """Remove and return the oldest of `parts` (step -> part) when KEEP are kept: the newer
        one is complete everywhere, so the oldest is never needed again once the next is in.
        None (its memory not reused) while `ckpt`'s persist reads it as its snapshot."""
        with self._lock:
            old = parts.pop(min(parts)) if len(parts) >= KEEP else None
        return None if ckpt is not None and ckpt.reads(old) else old

    def _share_with_checkpoint(self, w: Worker, ckpt, tree: dict, part: dict | None) -> None:
        """memory_sync takes a copy at every due step: a checkpoint at that step takes the copy as
        its snapshot (the same bytes), so while every checkpoint step is a copy step the
        checkpointer keeps no staging copy of its own (weights and optimizer moments: 0.75 x
        state/N less per rank)."""
        flat = part is not None and "sharded" in part  # (a pipeline stage's part: by name)
        ckpt.shares_copies = flat and w.job.checkpoint.every_steps % self.every == 0
        ckpt.share(w.step, as_snapshot(tree, part) if flat else None, part)

    # ---------------------------------------------------------------- as a buddy
    def hold(self, rank: int, generation: int, part: dict) -> bool:
        """Keep `rank`'s part as sent through Ray (already whole: Ray hands it over complete)."""
        return self.keep(rank, generation, from_wire(part))

    def keep(self, rank: int, generation: int, part: dict) -> bool:
        """Keep `rank`'s part (tensors of this process's own); its last KEEP only."""
        with self._lock:
            if self.generation is not None and generation < self.generation:
                return False  # a send from an older group, arriving late
            if self._held_gen.get(rank) != generation:  # (this rank's run() may not have started yet)
                self.held[rank], self._held_gen[rank] = {}, generation
            mine = self.held[rank]
            mine[part["step"]] = part
            for old in sorted(mine)[:-KEEP]:
                del mine[old]
        return True

    def part(self, rank: int, step: int, own: bool) -> dict:
        """The part of `rank` at `step`: this rank's own (`own`), or the one held for it. KeyError
        if absent (the restore then fails and falls back to storage)."""
        with self._lock:
            return self.own[step] if own else self.held[rank][step]

    def parts_at(self, step: int, parts: list[int]) -> dict[int, dict]:
        """The parts of old ranks `parts` at `step` that this rank keeps (its own, or held for a
        buddy), for a restore rank to rank. KeyError if one is absent (the restore then fails and
        falls back to storage)."""
        with self._lock:
            mine = self.own.get(step)
            return {p: mine if mine is not None and mine["part"] == p else self.held[p][step] for p in parts}

    def report(self) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]]]:
        """(steps of this rank's own parts, {rank: steps of the parts held for it})."""
        with self._lock:
            return tuple(sorted(self.own)), {r: tuple(sorted(s)) for r, s in self.held.items() if s}
