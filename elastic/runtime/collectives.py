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

Pair sockets are told apart by port: after formation every rank shares its
gloo listener ports over the new group; a pair socket is one accepted on our
listener, or connected to a peer's listener.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field

import torch.distributed as dist

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
    return GroupAbort(pairs, nccl)
