"""Fault injection keyed by (rank, step): kill a node, kill a process, hang.

Users run these against their own clusters as drills (the `chaos:` section of
a job), tests and benchmarks use the same code. Faults are executed by the
worker that holds the target rank, right before the step runs, so the fault
step is exact; the controller hands each fault out at most once per run.
"""
from __future__ import annotations

import os
import signal
import time

import psutil


def kill_own_node() -> None:
    """Kill the Ray node this process runs on: every process under its raylet, then the raylet.

    Ray starts each worker as a child of the node's raylet, so the raylet and
    its children are the node (on a single-host `ray.cluster_utils.Cluster`,
    exactly what `remove_node` would stop). SIGKILL: no clean shutdown, like a
    lost machine. Never returns.
    """
    me = psutil.Process()
    raylet = me.parent()
    if raylet is None or "raylet" not in raylet.name():
        raise RuntimeError(f"kill_own_node: parent of pid {me.pid} is {raylet and raylet.name()!r}, not a raylet")
    for child in raylet.children(recursive=True):
        if child.pid != me.pid:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    raylet.kill()
    os.kill(me.pid, signal.SIGKILL)


def kill_own_process() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def hang_own_process() -> None:
    """SIGSTOP: the process stays alive, holds its sockets and answers nothing."""
    os.kill(os.getpid(), signal.SIGSTOP)


def busy_wait(seconds: float) -> None:
    """Burn CPU (not sleep) for `seconds`: a real slowdown of this process's compute, as a
    throttled or contended machine would show, not a fake metric."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


ACTIONS = {"kill_node": kill_own_node, "kill_process": kill_own_process, "hang": hang_own_process}


def inject(action: str) -> None:
    """Run one fault in the calling worker process."""
    ACTIONS[action]()
    time.sleep(3600)  # a hang, or a kill still in flight, must never fall through into the next step
