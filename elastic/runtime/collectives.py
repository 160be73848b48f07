"""Abortable collectives: cut a collective that is blocked on a silent peer, from outside.

A machine that stops (power, kernel panic, partition) closes no socket, so a
survivor blocked in a collective on it waits for the group's timeout, and its
state would be thrown away with it if we killed it to get out. Instead the
controller asks the survivor (on another actor thread) to abort its group:

* gloo: ProcessGroupGloo.abort() in torch 2.13 returns but does not wake a
  blocked op (measured). What does wake it is its transport failing: we
  record the TCP sockets of the group's gloo pairs when the group forms, and
  abort = shutdown() of those sockets. Every op blocked on them (ours, FSDP's
  internal all-gathers and reduce-scatters, DCP's) raises "Connection closed
  by peer" at once, on this rank only, and the rank keeps its model and
  optimizer at its last completed step. Listening sockets are never touched
  (gloo aborts the process if its listener fails), nor any socket that is not
  a pair of this group (Ray's own connections live in the same process).
* NCCL: ncclCommAbort through torch's `_abort_process_group`.

Cutting the sockets wakes every op blocked on a receive, but not one blocked on a send that
the kernel had not taken in full (a send to the silent peer, larger than the socket's
buffers): gloo fails the pair without failing the send it had queued on it, and the op waits
for its own timeout (failure.collective_timeout_s, 120 s). A survivor that was sending to the
lost rank then stayed in its step, and was replaced with its state (CI saw it; a 3-rank drill
without Ray: 4 stuck of 40). So every wait on a gloo collective in a worker waits in slices and ends
with `GroupAborted` once its generation is aborted (`install_abortable_waits`), and the groups
of an aborted generation are kept from their destructor, which would join the gloo thread still
blocked in that send (`bury`).

Pair sockets are told apart by port: after formation every rank shares its
gloo listener ports over the new group; a pair socket is one accepted on our
listener, or connected to a peer's listener.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import OpType

log = logging.getLogger(__name__)


def socket_inodes() -> dict[int, str]:
    """fd -> 'socket:[inode]' for this process's open sockets (Linux /proc)."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(fd)] = target
    return out


def _inspect(fd: int) -> tuple[bool, tuple | None, tuple | None]:
    """(listening, local (host, port), peer (host, port) or None) of a TCP socket fd; raises OSError."""
    s = socket.socket(fileno=os.dup(fd))
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            raise OSError("not a TCP socket")
        listening = bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        local = s.getsockname()[:2]
        try:
            peer = s.getpeername()[:2]
        except OSError:
            peer = None
        return listening, local, peer
    finally:
        s.close()


def listener_ports(created: dict[int, str]) -> list[int]:
    """Ports of the listening TCP sockets among `created` (gloo's, one per group)."""
    ports = []
    for fd in created:
        try:
            listening, local, _ = _inspect(fd)
        except OSError:
            continue
        if listening:
            ports.append(local[1])
    return ports


@dataclass
class GroupAbort:
    """How to abort this process's collectives of one group generation."""

    sockets: dict[int, str] = field(default_factory=dict)  # fd -> inode of this group's gloo pairs
    nccl: bool = False
    aborted: bool = False
    world: object = None  # the default process group it was captured in

    def abort(self) -> int:
        """Fail every collective of this generation, now, on this rank. Returns the number of
        transports cut. Idempotent; never raises (it runs while things are already broken)."""
        self.aborted = True
        n = 0
        for fd, inode in self.sockets.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != inode:
                    continue  # closed and the number reused: not ours any more
                s = socket.socket(fileno=os.dup(fd))
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
                finally:
                    s.close()
            except OSError:
                continue
        if self.nccl and dist.is_initialized():
            try:
                dist.distributed_c10d._abort_process_group()
                n += 1
            except Exception as e:  # noqa: BLE001 - best effort: the group is being abandoned anyway
                log.warning("NCCL abort failed: %s", e)
        return n


class GroupAborted(RuntimeError):
    """A wait on a collective of a generation whose group was aborted (a peer went silent)."""


# The abort of this process's current group (set by `capture`). A wait reads it when it starts,
# and only while its default group is still the process's: a newer generation never ends an
# older wait early, nor an older abort a newer wait.
_active: GroupAbort | None = None
_SLICE = timedelta(seconds=0.1)  # a completed op wakes its waiter at once; this only bounds the abort's delay
_original_wait = None
# Ops that gloo runs on its own threads, whose wait with a timeout only waits. A send's or a
# receive's wait is gloo's own, and its timeout fails every pair of the group: never sliced.
_SLICED = frozenset(t.value for n, t in OpType.__members__.items()
                    if n not in ("SEND", "RECV", "RECVANYSOURCE", "COALESCED", "UNKNOWN"))
_graveyard: list = []  # process groups of aborted generations, kept from their destructor


def install_abortable_waits() -> None:
    """Make every `Work.wait()` without a timeout on a collective (c10d's blocking calls, FSDP's
    all-gathers and reduce-scatters, DDP's buckets, DCP's object collectives) wait in `_SLICE`s,
    and raise `GroupAborted` when a slice ends with the op still running and its group aborted.
    Idempotent; called by `capture`, so in worker processes only. Not covered: NCCL groups
    (ncclCommAbort ends their ops), point-to-point sends (a pipeline's, the peer copy's: see
    _SLICED), and functional collectives (`wait_tensor`: tensor parallelism's DTensor
    redistributions), which wait in C++."""
    global _original_wait
    if _original_wait is not None:
        return
    _original_wait = original = dist.Work.wait

    def wait(work, timeout: timedelta | None = None):
        ab = _active
        if timeout is not None and timeout != timedelta(0):
            return original(work, timeout)
        # Cheapest first: most waits are on NCCL or in a process with no group abort at all.
        if ab is None or ab.nccl or work._get_op_type() not in _SLICED or ab.world is not dist.group.WORLD:
            return original(work)
        while True:
            try:
                return original(work, _SLICE)
            except RuntimeError:
                if work.is_completed():  # its own result or error, not the slice's timeout
                    return original(work)
            if ab.aborted:
                raise GroupAborted("collective aborted: this rank's process group was aborted (a peer went silent)")

    dist.Work.wait = wait


def bury() -> None:
    """Before the default group of an aborted generation is destroyed: keep its process groups
    alive. Their destructor joins gloo's worker threads, and one may still be blocked in a send
    to the lost peer until collective_timeout_s (destroyed by the garbage collector, a group held
    whatever thread collected it for that long). Each is a few threads and buffers, once per failure."""
    _graveyard.extend(dist.distributed_c10d._world.pg_map)


def fresh_group_names() -> None:
    """Before a process group forms in a process that has none: number its groups from 0 again,
    as every other member's are. torch names a group without an explicit name by a per-process
    counter and keys its rendezvous under that name; it resets the counter when the default
    group is destroyed, but a formation cut short (a peer lost mid-join) raised before there was
    a group to destroy, so the counter stayed up. That member's next formation then published its
    address under "1/" while fresh members waited under "0/": every member alive, none ever
    joined (churn: 30-55 s per formation, until the next fault cut it)."""
    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0


def cut_rendezvous(before: dict[int, str], store_port: int) -> int:
    """Abort a formation in progress: shut this process's connections to the rendezvous store
    opened since `before`, so a join waiting on a silent peer fails now instead of at
    rendezvous_timeout_s. The store is the controller's (elastic/group/rendezvous.py), up for the
    whole run, so a join is connected to it from its first moment: there is always a socket to cut."""
    n = 0
    for fd, ino in socket_inodes().items():
        if before.get(fd) == ino:
            continue
        try:
            listening, local, peer = _inspect(fd)
        except OSError:
            continue
        if listening or peer is None or store_port not in (local[1], peer[1]):
            continue
        n += GroupAbort({fd: ino}).abort()
    return n


def capture(before: dict[int, str], group, nccl: bool, store_port: int) -> GroupAbort:
    """Call right after a group (and its subgroups) formed, on every rank (collective over
    `group`): the gloo pair sockets created since `before` (a `socket_inodes()` taken just
    before formation). The rendezvous store's connections (`store_port`) are not pairs."""
    created = {fd: ino for fd, ino in socket_inodes().items() if before.get(fd) != ino}
    mine = [p for p in listener_ports(created) if p != store_port]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    peer_ports = {p for ports in everyone for p in (ports or [])} - set(mine)
    pairs = {}
    for fd, ino in created.items():
        try:
            listening, local, peer = _inspect(fd)
        except OSError:
            continue
        if listening or peer is None or store_port in (local[1], peer[1]):
            continue
        if local[1] in mine or peer[1] in peer_ports:
            pairs[fd] = ino
    global _active
    install_abortable_waits()
    _active = GroupAbort(pairs, nccl, world=dist.group.WORLD)
    return _active
