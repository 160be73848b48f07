"""The group's rendezvous store, hosted by the controller, so it never dies with a member.

Each formation needs a key-value store every member reaches: members publish their addresses in
it and wait there for each other's. Hosted on rank 0 (torch's default), a formation whose rank 0
died or froze left the others retrying their connect to it until failure.rendezvous_timeout_s
(60 s in the churn benchmark), with no socket the controller could cut. Hosted here, in the
controller's process on the head node (which outlives every worker node), it is always there:
the members connect at once and wait on an open connection, which an abort cuts
(`collectives.cut_rendezvous`). One server serves every generation, each under its own key
prefix (`prefix`), so a late member of an old formation never meets a new one's keys. The keys
are a few hundred bytes a formation, kept for the run.
"""
from __future__ import annotations

import threading
from datetime import timedelta


class Rendezvous:
    """One TCPStore server in this process, started on first use."""

    def __init__(self, host: str, timeout_s: float):
        self.host = host
        self.timeout_s = timeout_s
        self._store = None
        self._lock = threading.Lock()

    def start_in_background(self) -> None:
        """Start the server on a thread: importing torch.distributed takes the controller a second
        or two of CPU, spent while the first workers start rather than in the first formation."""
        if self._store is None:
            threading.Thread(target=self.address, name="rendezvous-start", daemon=True).start()

    def address(self) -> tuple[str, int]:
        """(host, port) the members connect to; starts the server the first time."""
        with self._lock:
            if self._store is None:
                import torch.distributed as dist

                # Port 0: the OS picks a free one; the server listens on every interface.
                self._store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                            timeout=timedelta(seconds=self.timeout_s))
            return self.host, self._store.port


def prefix(generation: int) -> str:
    """The key prefix of a formation: every member of `generation` uses it, no one else."""
    return f"elastic/g{generation}/"
