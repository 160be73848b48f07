"""Who a node's heartbeat sidecar answers: the controller's address, with that sidecar's token.

A sidecar (elastic/runtime/heartbeat.py) tells whoever it answers the pids of its node's workers
and their states in `/proc`. It answers only a ping that comes from the controller's address (the
pinger binds its socket to it) and carries the token its agent gave it; anything else, from
another process on the node or anyone on the network, gets nothing back. The controller draws a
key when it starts its node agents and gives it to them as an actor argument; a sidecar's token
is derived from that key and the sidecar's own address, so one sidecar's token (sent in the clear
in every ping to it) says nothing of another's. The key never appears on a command line: the
agent writes the token to its sidecar's stdin, and the controller the key to its pinger's.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

TOKEN_HEX = 16  # hex digits of a sidecar's token


@dataclass(frozen=True)
class PingAuth:
    """The controller's address (pings go out from it, sidecars answer only it) and the run's key."""

    ip: str
    key: bytes = field(repr=False)

    @classmethod
    def new(cls, ip: str) -> "PingAuth":
        return cls(ip, secrets.token_bytes(16))

    def token(self, ip: str, port: int) -> bytes:
        """The token of the sidecar listening at (ip, port), as its agent and the pinger name it."""
        return hmac.new(self.key, f"{ip}|{port}".encode(), hashlib.sha256).hexdigest()[:TOKEN_HEX].encode()
