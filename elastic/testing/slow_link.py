"""A thin upload link to a TCP server, for tests: a relay on 127.0.0.1 that passes what each
client sends at most `bytes_per_s` per connection, and the server's replies at full speed.

Put in front of the S3 endpoint, it makes a checkpoint upload as slow as a gigabyte's is on a
busy cluster while small requests (listing, the fence, a commit marker) still answer at once:
the storage is slow, not down. `bytes_per_s=None` passes everything at full speed.

`cut()` takes the storage down the way a lost route or a dead load balancer does: every open
connection is shut and new ones are closed as soon as they are accepted, so requests fail at
once (unlike a paused server, where they hang); `mend()` brings it back.
"""
from __future__ import annotations

import socket
import threading
import time


class SlowLink:
    def __init__(self, host: str, port: int, bytes_per_s: float | None):
        self.target = (host, port)
        self.bytes_per_s = bytes_per_s
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
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, self.bytes_per_s), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()

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
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
