"""Stand-in heartbeat sidecars for `python -m benchmarks controller`: NODES UDP sockets on
loopback in one process, each answering a ping as a node's sidecar does
(elastic/runtime/heartbeat.py): the ping, then `pid state cpu-ticks` for each of PER_NODE
processes. The process states are fixed (S, 5 ticks): reading /proc is the remote node's work,
not the controller's. Prints the ports on one line, then answers until its stdin closes.

    python -m benchmarks.probes.sidecars NODES PER_NODE
"""
from __future__ import annotations

import os
import select
import socket
import sys


def serve(nodes: int, per_node: int) -> None:
    socks, ep = {}, select.epoll()
    for i in range(nodes):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
        socks[s.fileno()] = (s, b" " + b" ".join(f"{1000 + i * per_node + j} S 5".encode() for j in range(per_node)))
        ep.register(s.fileno(), select.EPOLLIN)
    ep.register(0, select.EPOLLIN)
    sys.stdout.write(" ".join(str(s.getsockname()[1]) for s, _ in socks.values()) + "\n")
    sys.stdout.flush()
    while True:
        for fd, _ in ep.poll(1.0):
            if fd == 0:
                if not os.read(0, 4096):
                    return  # the bench closed our stdin: it is done
                continue
            s, procs = socks[fd]
            while True:
                try:
                    data, addr = s.recvfrom(128)
                except BlockingIOError:
                    break
                try:
                    s.sendto(data + procs, addr)
                except OSError:
                    pass


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
