"""The controller's heartbeat pinger (`Heartbeats`) in a process of its own.

One round of pings is one `sendto` per node and one `recvfrom` per answer: at 100,000 ranks
(12,500 nodes) about 90 ms of sends and as much again of reads, every 0.2 s. On the run loop
that is half its interval. On a thread of the controller's process it is worse: each `sendto`
releases the GIL, and the thread then waits for the busy run loop to hand it back (up to the
5 ms switch interval), so a round of 125 pings took 0.5 s here (`python -m benchmarks
controller`, 2026-11-28). In a process of its own the pinger has its own interpreter and core;
the run loop only reads its answers.

The controller side (`PingerProcess`) never blocks on it: `beats()` asks for a snapshot and
returns the newest one it has, taken by the pinger at most one call earlier (ages are counted to
the moment the snapshot was taken). A pinger that dies or stops answering leaves the controller
with no heartbeat evidence, as where sidecars cannot run: silence is then judged by the polls
alone. Messages are length-prefixed pickles over the child's stdin and stdout; the first one the
pinger reads is who it pings as (`PingAuth`: the key stays off its command line).
"""
from __future__ import annotations

import fcntl
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import time

from elastic.runtime.heartbeat import PING_INTERVAL_S, Beats, Heartbeats, stop_child
from elastic.runtime.ping_auth import PingAuth

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<Q")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIPE_BYTES = 1 << 20  # asked for each pipe (Linux; the default fs.pipe-max-size)
WRITE_TIMEOUT_S = 5.0  # a pinger that takes no message for this long is taken for dead


def _frame(msg) -> bytes:
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _read_exactly(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_frame(fd: int):
    """One message from `fd`, read to its last byte and no further; None at the end of input."""
    head = _read_exactly(fd, _HEADER.size)
    body = None if head is None else _read_exactly(fd, _HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _take_frames(buf: bytearray) -> list:
    """The complete messages at the front of `buf`, removed from it."""
    out = []
    while len(buf) >= _HEADER.size:
        (n,) = _HEADER.unpack_from(buf)
        if len(buf) < _HEADER.size + n:
            break
        out.append(pickle.loads(bytes(buf[_HEADER.size:_HEADER.size + n])))
        del buf[:_HEADER.size + n]
    return out


class PingerProcess:
    """`Heartbeats` run by a child process: the same `watch`, `beats`, `pings_sent` and `close`."""

    def __init__(self, auth: PingAuth, interval_s: float = PING_INTERVAL_S):
        self.interval_s = interval_s
        self.pings_sent = 0
        self.rounds = 0  # rounds of pings sent (each one ping per node)
        self._targets: dict = {}
        self._tokens: dict = {}  # the pinger's, as of its last change of targets
        self._latest = Beats({}, {}, {}, {}, time.monotonic())
        self._asked = False  # a snapshot asked for and not yet read
        self._inbox = bytearray()
        self._dead: str | None = None
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
        code = f"import sys; sys.path.insert(0, {_ROOT!r}); from elastic.runtime.pinger import serve; serve({interval_s!r})"
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)
        except OSError as e:
            self.proc = None
            self._gone(f"did not start: {e}")
            return
        for f in (self.proc.stdin, self.proc.stdout):  # a snapshot in one piece where the system allows
            try:
                fcntl.fcntl(f.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except (OSError, AttributeError):
                pass
        self._send(("auth", auth))

    def _gone(self, why: str) -> None:
        if self._dead is None:
            self._dead = why
            log.warning("heartbeat pinger %s; silence is judged by the polls alone from now on", why)
            self._latest = Beats({}, {}, {}, {}, time.monotonic())
            self.close()

    def _send(self, msg) -> None:
        if self._dead is not None:
            return
        data, fd = memoryview(_frame(msg)), self.proc.stdin.fileno()
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        ready = select.poll()  # not select(): a controller's fds may be past 1,024
        ready.register(fd, select.POLLOUT)
        try:
            while data:
                if not ready.poll(max(0.0, deadline - time.monotonic()) * 1000):
                    return self._gone(f"took no message for {WRITE_TIMEOUT_S:g} s")
                data = data[os.write(fd, data[:1 << 16]):]
        except OSError as e:
            self._gone(f"exited ({e})")

    def watch(self, targets: dict[int, tuple[str, int, int]]) -> None:
        """As `Heartbeats.watch`; sent to the pinger only when the targets change."""
        if targets is self._targets or targets == self._targets:
            return
        self._targets = targets
        self._send(("watch", targets))

    def beats(self, fresh_within_s: float = 0.0) -> Beats:
        """The newest snapshot of the pinger's beats (rank -> Beat), without waiting for it; with
        `fresh_within_s`, one taken after this call, waited for up to that long. A snapshot is
        the answer to the previous call's request: after a long wait elsewhere (a blocking poll
        in a recovery), it describes the moment that wait began, and a node that went silent
        during it still looks alive in it."""
        t0 = time.monotonic()
        self._read()
        deadline = t0 + fresh_within_s
        while self._dead is None and self._latest._now < t0 and time.monotonic() < deadline:
            if not self._asked:
                self._asked = True
                self._send(("beats",))
            ready = select.poll()
            ready.register(self.proc.stdout.fileno(), select.POLLIN)
            if ready.poll(max(0.0, min(0.05, deadline - time.monotonic())) * 1000):
                self._read()
        if not self._asked:
            self._asked = True
            self._send(("beats",))
        return self._latest

    def _read(self) -> None:
        """Take the snapshots the pinger has written, the newest into `_latest`."""
        if self._dead is not None:
            return
        fd = self.proc.stdout.fileno()
        ready = select.poll()
        ready.register(fd, select.POLLIN)
        try:
            while ready.poll(0):
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return self._gone(f"exited (code {self.proc.poll()})")
                self._inbox += chunk
        except OSError as e:
            return self._gone(f"exited ({e})")
        for tokens, last, pending, now, sent, rounds, refused in _take_frames(self._inbox):
            self._tokens = self._tokens if tokens is None else tokens
            self._latest = Beats(self._targets, self._tokens, last, pending, now, refused)
            self._asked, self.pings_sent, self.rounds = False, sent, rounds

    def close(self) -> None:
        if self.proc is not None:
            stop_child(self.proc)


def serve(interval_s: float) -> None:
    """The pinger's loop: ping as due, read answers, take messages from the controller. Its
    answers are written without blocking, also between a round's sends (a controller that reads
    late never holds the pings up). Exits when its stdin closes or its stdout breaks: the
    controller exited or closed it."""
    first = _read_frame(0)
    if not first or first[0] != "auth":
        return
    hb, inbox, outbox, tokens_sent = Heartbeats(first[1], interval_s), bytearray(), bytearray(), False
    os.set_blocking(1, False)

    def flush() -> None:
        if outbox:
            try:
                del outbox[:os.write(1, outbox)]
            except BlockingIOError:
                pass

    while True:
        try:
            hb.tick(between=flush)
            wait = max(0.0, hb._last_sent + interval_s - time.monotonic()) if hb._addrs else None
            ready, writable, _ = select.select([0, *hb._socks.values()], [1] if outbox else [], [], wait)
            if writable:
                flush()
        except OSError:
            return  # the controller is gone (its end of stdout closed)
        if 0 not in ready:
            continue
        chunk = os.read(0, 1 << 20)
        if not chunk:
            return
        inbox += chunk
        for msg in _take_frames(inbox):
            if msg[0] == "watch":
                hb.watch(msg[1])
                tokens_sent = False
            elif msg[0] == "beats" and not outbox:
                hb._drain()
                # The tokens once per change of targets: a snapshot at 12,500 nodes is then ~1.8 MB.
                outbox += _frame((None if tokens_sent else dict(hb._token), dict(hb._last),
                                  dict(hb._pending_since), hb.clock(), hb.pings_sent, hb._seq,
                                  dict(hb._refused)))
                tokens_sent = True
                flush()
