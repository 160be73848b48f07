"""A thin upload link to a TCP server, for tests: a relay on 127.0.0.1 that passes what each
client sends at most `bytes_per_s` per connection, and the server's replies at full speed, or
`latency_s` late.

Put in front of the S3 endpoint, it makes a checkpoint upload as slow as a gigabyte's is on a
busy cluster while small requests (listing, the fence, a commit marker) still answer at once:
the storage is slow, not down. `bytes_per_s=None` passes everything at full speed.

`cut()` takes the storage down the way a lost route or a dead load balancer does: every open
connection is shut and new ones are closed as soon as they are accepted, so requests fail at
once (unlike a paused server, where they hang); `mend()` brings it back.

`latency_s` delays everything the server sends by that long (a delay line, not a sleep per
chunk: data keeps its spacing, however it is cut into reads). Each request then waits at least
that long for its answer, as one to a remote object store does; the local server's own time
comes on top.
"""
from __future__ import annotations

import queue
import socket
import threading
import time


class SlowLink:
    def __init__(self, host: str, port: int, bytes_per_s: float | None, latency_s: float = 0.0):
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        self.target = (host, port)
        self.bytes_per_s = bytes_per_s
        self.latency_s = latency_s
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._down = False
        threading.Thread(target=self._accept, name="slow-link", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._down = True
        self._shut_open()

    def mend(self) -> None:
        self._down = False

    def close(self) -> None:
        self._closed = True
        self._server.close()
        self._shut_open()

    def _shut_open(self) -> None:
        with self._lock:
            for s in self._open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._open = []

    def __enter__(self) -> "SlowLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed
                return
            if self._down:
                client.close()
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:  # the server is down: so is the link
                client.close()
                continue
            for sock in (client, server):  # no Nagle wait on small replies: the delay is latency_s alone
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, self.bytes_per_s), daemon=True).start()
            if self.latency_s:
                threading.Thread(target=self._delay_line, args=(server, client, self.latency_s), daemon=True).start()
            else:
                threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()

    @staticmethod
    def _delay_line(src: socket.socket, dst: socket.socket, latency_s: float) -> None:
        """Pass src's data to dst latency_s after it arrived: a reader stamps each chunk, a
        writer sends it when its time comes."""
        chunks: queue.SimpleQueue = queue.SimpleQueue()

        def send() -> None:
            try:
                while (item := chunks.get()) is not None:
                    due, data = item
                    if (wait := due - time.monotonic()) > 0:
                        time.sleep(wait)
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                _shut(src, dst)

        threading.Thread(target=send, daemon=True).start()
        try:
            while data := src.recv(65536):
                chunks.put((time.monotonic() + latency_s, data))
        except OSError:
            pass
        chunks.put(None)  # what arrived is still delivered, then both ends shut

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, bytes_per_s: float | None) -> None:
        try:
            while data := src.recv(16384):
                dst.sendall(data)
                if bytes_per_s:  # no credit saved up while idle: a keep-alive connection stays slow
                    time.sleep(len(data) / bytes_per_s)
        except OSError:
            pass
        finally:
            _shut(src, dst)


def _shut(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
