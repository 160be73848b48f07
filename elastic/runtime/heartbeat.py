"""A heartbeat from outside the workers' Python processes: tells a busy rank from a stopped machine.

The controller's polls are answered by the worker's Python, so a rank whose Python is held (user
code in a C extension that keeps the GIL, a checkpoint's writes on a starved node) answers late,
exactly like a machine that stopped. On each node runs one sidecar, started by the node's agent
(elastic/group/node_agent.py): a separate small process (no torch, no Ray, a few MB) that answers
UDP pings from the controller with the state of every worker process on its node as the kernel
sees it (`/proc/<pid>/stat`: R running, S sleeping, D in I/O, T stopped). One ping per node, not
per rank: the controller's heartbeat traffic grows with nodes.

What the controller can then tell apart (`elastic.policies.failure.decide_silence`):
  * sidecar answers, process running or sleeping: the machine is up and the rank is busy. It is
    not replaced for silence; the hang bound still applies.
  * sidecar answers, process stopped (SIGSTOP) or gone: the rank is lost, after ping_timeout_s.
  * sidecar silent too: the machine stopped or is cut off; lost after ping_timeout_s, however
    long the steps are (a poll alone must wait silence_factor x the median step).
  * sidecar never answered (not Linux, UDP filtered between driver and nodes): no evidence, and
    the poll-only rule applies as before.
Once its peers' collectives have failed (a death closes sockets), a rank whose node says its
process is gone or stopped, or whose node is silent as long as its poll for two ping rounds, is
lost without waiting out ping_timeout_s (`elastic.policies.failure.decide_after_peers_failed`).

A ping can also be refused: where the node's machine is up but nothing listens on the sidecar's
port any more, its kernel answers with an ICMP "port unreachable", which the pinger reads from
its socket's error queue (IP_RECVERR). The sidecar exits only with its agent, and an agent's death
is its node's loss, so a refused ping is that loss said at once, where silence must be waited
out (`elastic.policies.failure.decide_refused`). A stopped machine, a partition, or a pod whose
address is gone refuses nothing: those are still found by silence.

A sidecar answers only the controller's address, and only a ping with the token its agent gave
it (elastic/runtime/ping_auth.py): no one else learns the node's pids and process states.

The agent tells the sidecar which pids to watch (a line of pids on its stdin). The sidecar exits
when the agent does (its stdin pipe closes, or it is re-parented). It leaves SCHED_IDLE if it was
started from a process at low priority (runtime/priority.py): a heartbeat that starves would be
taken for a stopped machine.
"""
from __future__ import annotations

import errno
import os
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from elastic.runtime.ping_auth import PingAuth

STOPPED_STATES = frozenset("TtZXx")  # stopped, traced, zombie, dead: the process runs no more code
PING_INTERVAL_S = 0.2  # one ping per node this often
RECEIVE_BUFFER = 8 << 20  # bytes asked for the pinger's socket (the kernel caps it at net.core.rmem_max)
# Linux: a socket option that queues each ICMP error for a datagram sent, with that datagram's
# payload (the ping) and where it went; (level, option) per family: IP_RECVERR, IPV6_RECVERR.
# The numbers are Linux's (elsewhere they name other options): none off Linux.
RECVERR = {socket.AF_INET: (0, 11), socket.AF_INET6: (41, 25)} if sys.platform.startswith("linux") else {}
EXTENDED_ERR = struct.Struct("=IBBBBII")  # struct sock_extended_err: errno, origin, type, code, pad, info, data
# (origin, type, code) of a "port unreachable": ICMP (2) type 3 code 3; ICMPv6 (3) type 1 code 4
PORT_UNREACHABLE = frozenset({(2, 3, 3), (3, 1, 4)})

# Run with `python -I -S -c`: stdlib built-ins only, so it starts in milliseconds and never
# imports elastic (whose import would lower a background spare's priority again).
_SIDECAR = r"""
import hmac, os, select, socket, sys
family, ip = socket.AF_INET6 if sys.argv[1] == "6" else socket.AF_INET, sys.argv[2]
pids = [int(p) for p in sys.argv[3:]]
if hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(0) == os.SCHED_IDLE:
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass
parent = os.getppid()
s = socket.socket(family, socket.SOCK_DGRAM)
s.bind((ip, 0))  # the node's address only, not every interface
sys.stdout.write(f"{s.getsockname()[1]}\n")
sys.stdout.flush()

def stat(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return b"X 0"
    rest = data[data.rindex(b")") + 2:].split()
    return rest[0] + b" " + str(int(rest[11]) + int(rest[12])).encode()  # state, utime + stime

def packed(host):
    try:
        return socket.inet_pton(family, host.split("%")[0])
    except (OSError, ValueError):
        return None

allowed, token = None, None  # who may ping, and with what: nobody until the agent says
pending = b""
while True:
    ready, _, _ = select.select([s, 0], [], [], 2.0)
    if 0 in ready:
        chunk = os.read(0, 4096)
        if not chunk:
            break  # the agent closed our stdin: it exited
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if line.startswith(b"allow "):  # the controller's address and this sidecar's token
                _, host, token = line.split()
                allowed = packed(host.decode())
            else:
                pids = [int(p) for p in line.split()]  # the set to watch from now on
    if s in ready:
        try:
            data, addr = s.recvfrom(128)
            if (allowed is not None and packed(addr[0]) == allowed
                    and hmac.compare_digest(data.rpartition(b":")[0], token)):
                s.sendto(b" ".join([data] + [str(p).encode() + b" " + stat(p) for p in pids]), addr)
        except OSError:
            pass
    if os.getppid() != parent:
        break  # the agent died and we were re-parented
"""


def _family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


class Sidecar:
    """The heartbeat process of one node (started by its agent), for the worker pids it is told,
    answering the pings `auth` allows."""

    def __init__(self, pids: list[int], ip: str, auth: PingAuth, start_timeout_s: float = 10.0):
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _SIDECAR, "6" if _family(ip) == socket.AF_INET6 else "4", ip,
             *map(str, pids)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)
        ready = select.poll()  # not select(): the agent's fds may be past 1,024
        ready.register(self.proc.stdout, select.POLLIN)
        line = self.proc.stdout.readline() if ready.poll(start_timeout_s * 1000) else b""
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"heartbeat sidecar did not start within {start_timeout_s:.0f}s "
                               f"(exit code {self.proc.poll()})")
        self.port = int(line)
        self._tell(b"allow " + auth.ip.encode() + b" " + auth.token(ip, self.port))

    def _tell(self, line: bytes) -> None:
        try:
            self.proc.stdin.write(line + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass  # it exited: its silence says so

    def watch(self, pids: list[int]) -> None:
        """Answer for these pids from now on (the processes of the node's ranks)."""
        self._tell(" ".join(map(str, pids)).encode())

    def close(self) -> None:
        stop_child(self.proc)


def stop_child(proc: subprocess.Popen) -> None:
    """Close a helper process's pipes, kill it and reap it (a sidecar, the pinger)."""
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass
    try:
        proc.kill()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        pass


def start_sidecar(ip: str, auth: PingAuth) -> Sidecar | None:
    """A node's sidecar (told its pids later), or None where none can run (not Linux, or it failed
    to start: the controller then has no heartbeat for the node's ranks and judges them by their
    polls alone)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return Sidecar([], ip, auth)
    except (OSError, RuntimeError):
        return None


@dataclass(frozen=True)
class Beat:
    """What a rank's sidecar last said. `age_s`: how long its oldest unanswered ping has waited
    (0 when none is waiting); `state`: the worker process's state in its last answer; `refused`:
    a ping sent after that answer was refused by the node (its sidecar's port is closed)."""

    age_s: float
    state: str
    cpu_ticks: int = 0
    refused: bool = False  # its node refused the newest pings (nothing listens there: the agent is gone)


class Beats(Mapping):
    """rank -> Beat, as of one moment (see `Heartbeats.beats`)."""

    def __init__(self, targets: dict, tokens: dict, last: dict, pending: dict, now: float, refused: dict = None):
        self._targets, self._tokens, self._last, self._pending, self._now = targets, tokens, last, pending, now
        self._refused = refused or {}  # token -> the newest ping its node refused, after its last answer
        self._procs: dict[bytes, dict[int, tuple[str, int]]] = {}  # token -> its answer, parsed once read

    def _answer(self, token: bytes) -> dict[int, tuple[str, int]]:
        procs = self._procs.get(token)
        if procs is None:
            words = self._last[token][1].split()  # KeyError: its sidecar never answered
            try:
                procs = {int(words[i]): (words[i + 1].decode(errors="replace"), int(words[i + 2]))
                         for i in range(0, len(words) - 2, 3)}
            except ValueError:
                procs = {}  # unreadable: no evidence for any of its ranks
            self._procs[token] = procs
        return procs

    def __getitem__(self, rank: int) -> Beat:
        ip, port, pid = self._targets[rank]  # KeyError: not watched
        token = self._tokens[(ip, port)]
        state, ticks = self._answer(token)[pid]  # KeyError: never answered for this pid
        pending = self._pending.get(token)
        return Beat(0.0 if pending is None else self._now - pending[0], state, ticks, token in self._refused)

    def refused(self) -> list[int]:
        """The watched ranks whose node refused its newest pings and that it had answered for:
        O(ranks), and only while some node refuses (a node just lost)."""
        if not self._refused:
            return []
        return sorted(r for r, (ip, port, _) in self._targets.items()
                      if self._tokens.get((ip, port)) in self._refused and r in self)

    def __contains__(self, rank) -> bool:
        t = self._targets.get(rank)
        if t is None:
            return False
        token = self._tokens.get((t[0], t[1]))
        return token in self._last and t[2] in self._answer(token)

    def __iter__(self):
        return (r for r in self._targets if r in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def refused_ranks(beats: Mapping) -> list[int]:
    """The ranks whose node refuses the heartbeat's pings (`Beat.refused`): from the mapping's
    own `refused()` where it has one (`Beats`: without reading every rank's beat), else by
    reading them (a plain dict: no heartbeat, or a test's)."""
    if hasattr(beats, "refused"):
        return beats.refused()
    return sorted(r for r, b in beats.items() if b.refused)


class Heartbeats:
    """Controller side: pings each node's sidecar every `interval_s`, without blocking, from
    whatever loop calls `tick()` (in a run, the pinger's own process: elastic/runtime/pinger.py).
    Ages count only pings sent: a pinger busy elsewhere that sends none never makes its own pause
    look like a node's silence. Pings go out from `auth.ip`, each with its sidecar's token."""

    def __init__(self, auth: PingAuth, interval_s: float = PING_INTERVAL_S, clock=time.monotonic):
        self.auth, self.interval_s, self.clock = auth, interval_s, clock
        self._socks: dict[int, socket.socket] = {}
        self._targets: dict[int, tuple[str, int, int]] = {}  # rank -> (ip, port, pid)
        self._addrs: set[tuple[str, int]] = set()  # the sidecars pinged: one per node
        self._token: dict[tuple[str, int], bytes] = {}  # sidecar address -> the token it checks and echoes
        # token -> the first ping its answers count from: a sidecar watched again (its address
        # dropped and given back) has the same token, and an answer to a ping from before is stale
        self._floor: dict[bytes, int] = {}
        self._seq = 0  # numbers the pings
        self._last_sent = float("-inf")
        self.pings_sent = 0  # datagrams sent, one per node per interval
        # token -> (sent at, ping number) of its oldest ping not answered by it or a later one
        self._pending_since: dict[bytes, tuple[float, int]] = {}
        # token -> (ping number, b"pid state ticks ..."): its newest answer, as sent
        self._last: dict[bytes, tuple[int, bytes]] = {}
        self._refused: dict[bytes, int] = {}  # token -> the newest ping its node refused since its last answer

    def watch(self, targets: dict[int, tuple[str, int, int]]) -> None:
        """The ranks to watch now: their node's sidecar (ip, port) and their pid; others are
        forgotten. A sidecar keeps its history when its ranks are renumbered or change."""
        if targets is self._targets or targets == self._targets:
            return
        for ip, port, _ in targets.values():
            if (ip, port) not in self._token:
                # Unguessable, and only answers from the sidecar's own address count (`_drain`):
                # nobody else on the network can keep a dead rank alive with a forged answer.
                self._token[(ip, port)] = token = self.auth.token(ip, port)
                self._floor[token] = self._seq + 1
        self._targets = targets  # not copied: the caller gives a new dict when its ranks change
        addrs = self._addrs = {(ip, port) for ip, port, _ in targets.values()}
        self._token = {a: t for a, t in self._token.items() if a in addrs}
        live = set(self._token.values())
        self._pending_since = {t: v for t, v in self._pending_since.items() if t in live}
        self._last = {t: v for t, v in self._last.items() if t in live}
        self._refused = {t: v for t, v in self._refused.items() if t in live}
        self._floor = {t: v for t, v in self._floor.items() if t in live}

    def tick(self, between=None) -> None:
        """Read the answers that arrived, and send a round of pings if one is due; `between()`,
        if given, is called after every 1,024 sends of a round (the pinger's process writes its
        answers to the controller then)."""
        self._drain()
        now = self.clock()
        if now - self._last_sent < self.interval_s or not self._addrs:
            return
        self._last_sent = now
        self._seq += 1
        ping = b":" + str(self._seq).encode()
        for i, (ip, port) in enumerate(self._addrs):
            if between is not None and i and not i % 1024:
                between()
            token = self._token[(ip, port)]
            self._send(self._sock(_family(ip)), token + ping, (ip, port))
            self._pending_since.setdefault(token, (now, self._seq))

    def _send(self, sock: socket.socket, ping: bytes, addr: tuple[str, int]) -> None:
        """One ping. A send can fail with an error that belongs to an earlier ping (with
        IP_RECVERR the kernel reports a pending ICMP error, another node's refusal say, on the
        next send and drops that datagram): tried once more, so one dead node never costs the
        next node its ping. An error of its own (unreachable now: a partition) leaves it unanswered."""
        for _ in range(2):
            try:
                sock.sendto(ping, addr)
                self.pings_sent += 1
                return
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED,
                                   errno.EPERM, errno.ENOBUFS):
                    raise

    def _sock(self, family: socket.AddressFamily) -> socket.socket:
        if family not in self._socks:
            s = socket.socket(family, socket.SOCK_DGRAM)
            s.setblocking(False)
            try:  # a round's answers arrive at once, one per node: room for thousands of them
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            except OSError:
                pass  # the system's default; past net.core.rmem_max the kernel caps it silently
            if family == _family(self.auth.ip):
                try:  # the sidecars answer only the controller's address
                    s.bind((self.auth.ip, 0))
                except OSError:
                    pass  # not this machine's: the sidecars stay silent, and the polls alone judge
            try:  # a refused ping is then read from the error queue (`_read_refusals`)
                s.setsockopt(*RECVERR[family], 1)
            except (OSError, KeyError):
                pass  # not Linux: a dead node's refusals go unread, and its silence still says it
            self._socks[family] = s
        return self._socks[family]

    def _drain(self) -> None:
        for s in self._socks.values():
            while True:
                try:
                    data, sender = s.recvfrom(65536)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # an ICMP error for an earlier ping: read below, from the error queue
                    continue
                # Only the ping it answers is read here; what it says of each process is parsed
                # when a rank's beat is read (`Beats`): the run loop reads the silent ranks' only.
                ping, _, procs = data.partition(b" ")
                token, _, seq = ping.rpartition(b":")
                if seq.isdigit() and not (procs and (procs.count(b" ") + 1) % 3):
                    self._take(token, int(seq), procs, sender)
            self._read_refusals(s)

    def _read_refusals(self, s: socket.socket) -> None:
        """Read the socket's error queue: each entry is one ping the network returned, with the
        ping itself and where it went. A "port unreachable" from the address the ping's token
        was given to marks that node as refusing (`_refused`) until it answers again."""
        while True:
            try:
                data, ancillary, _, addr = s.recvmsg(256, 512, socket.MSG_ERRQUEUE)
            except (OSError, AttributeError):
                return  # the queue is empty (or this system has none)
            for level, kind, raw in ancillary:
                if (level, kind) not in RECVERR.values() or len(raw) < EXTENDED_ERR.size:
                    continue
                err, origin, icmp_type, code = EXTENDED_ERR.unpack_from(raw)[:4]
                token, _, seq = data.rpartition(b":")
                if (err == errno.ECONNREFUSED and (origin, icmp_type, code) in PORT_UNREACHABLE and seq.isdigit()
                        and addr is not None and self._token.get(tuple(addr[:2])) == token
                        and int(seq) > self._last.get(token, (0,))[0]):  # not older than its newest answer
                    self._refused[token] = max(int(seq), self._refused.get(token, 0))

    def _take(self, token: bytes, seq: int, procs: bytes, sender) -> None:
        if (token not in self._pending_since and token not in self._last) or seq < self._floor.get(token, 0):
            return  # a stale answer: for a sidecar no longer watched, or from before it was again
        if self._token.get(tuple(sender[:2])) != token:
            return  # not from the sidecar this token was given to
        if seq >= self._pending_since.get(token, (0.0, seq))[1]:
            self._pending_since.pop(token, None)  # answered that ping or a later one
        if seq >= self._last.get(token, (0,))[0]:
            self._last[token] = (seq, procs)
        if seq > self._refused.get(token, seq):
            del self._refused[token]  # it answered a ping sent after the one refused: it is back

    def beats(self) -> "Beats":
        """Each watched rank's Beat, for those whose node's sidecar has answered for its pid at
        least once: a read-only mapping over a snapshot of the nodes' answers, taken in O(nodes);
        a rank's Beat is made when it is read (the run loop reads only the silent ranks')."""
        self._drain()
        return Beats(self._targets, self._token, dict(self._last), dict(self._pending_since), self.clock(),
                     dict(self._refused))

    def close(self) -> None:
        for s in self._socks.values():
            s.close()
        self._socks.clear()
