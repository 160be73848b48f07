"""Fault injection keyed by (rank, step): kill or freeze a node, kill or freeze a process, hang,
hold a process's Python (the GIL).

Users run these against their own clusters as drills (the `chaos:` section of
a job), tests and benchmarks use the same code. Faults are executed by the
worker that holds the target rank, right before the step runs, so the fault
step is exact; the controller hands each fault out at most once per run.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil


def _own_raylet() -> psutil.Process:
    me = psutil.Process()
    raylet = me.parent()
    if raylet is None or "raylet" not in raylet.name():
        raise RuntimeError(f"chaos: parent of pid {me.pid} is {raylet and raylet.name()!r}, not a raylet")
    return raylet


def _thaw_later(pids: list[int], after_s: float | None) -> int | None:
    """Start a process outside the frozen set that sends SIGCONT to `pids` after `after_s`."""
    if after_s is None:
        return None
    code = ("import os, signal, sys, time\n"
            "time.sleep(float(sys.argv[1]))\n"
            "for p in map(int, sys.argv[2:]):\n"
            "    try: os.kill(p, signal.SIGCONT)\n"
            "    except ProcessLookupError: pass\n")
    # A new session: it must not be stopped with the node, nor die with the worker.
    p = subprocess.Popen([sys.executable, "-c", code, str(after_s), *map(str, pids)], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return p.pid


def freeze_own_node(thaw_after_s: float | None = None) -> None:
    """A machine that stops: SIGSTOP this node's raylet and every process under it (this one
    last). Nothing exits and no socket closes; peers see only silence, as with a power loss,
    a kernel panic or a cut cable. With `thaw_after_s`, everything is resumed (SIGCONT) that
    much later, as a machine that comes back from a partition: what it does then is what
    fencing must make harmless."""
    me = psutil.Process()
    raylet = _own_raylet()
    others = [c for c in raylet.children(recursive=True) if c.pid != me.pid]
    pids = [raylet.pid] + [c.pid for c in others] + [me.pid]
    thawer = _thaw_later(pids, thaw_after_s)
    for proc in [raylet] + others:
        if proc.pid == thawer:
            continue
        try:
            proc.send_signal(signal.SIGSTOP)
        except psutil.NoSuchProcess:
            pass
    os.kill(me.pid, signal.SIGSTOP)


def freeze_own_process(thaw_after_s: float | None = None) -> None:
    """SIGSTOP this worker process only (its node stays up): silence from one rank."""
    _thaw_later([os.getpid()], thaw_after_s)
    os.kill(os.getpid(), signal.SIGSTOP)


def kill_own_node() -> None:
    """Kill the Ray node this process runs on: every process under its raylet, then the raylet.

    Ray starts each worker as a child of the node's raylet, so the raylet and
    its children are the node (on a single-host `ray.cluster_utils.Cluster`,
    exactly what `remove_node` would stop). SIGKILL: no clean shutdown, like a
    lost machine. Never returns.
    """
    me = psutil.Process()
    raylet = _own_raylet()
    for child in raylet.children(recursive=True):
        if child.pid != me.pid:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    raylet.kill()
    os.kill(me.pid, signal.SIGKILL)


def kill_own_agent() -> bool:
    """SIGKILL this node's agent (elastic/group/node_agent.py: the Ray actor process titled
    `ray::NodeAgent`), leaving every worker running. Returns whether one was found."""
    found = False
    for proc in _own_raylet().children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::NodeAgent"):
            try:
                proc.kill()
                found = True
            except psutil.NoSuchProcess:
                pass
    return found


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


def hold_gil(seconds: float) -> None:
    """Hold this process's Python for `seconds` in one C call that keeps the GIL, as a C
    extension may (ctypes.PyDLL does not release it): no other thread of the process, the one
    answering the controller's polls included, runs meanwhile. The calling thread sleeps in the
    kernel and the machine is up."""
    import ctypes

    ctypes.PyDLL(None).poll(None, 0, int(seconds * 1000))


ACTIONS = {"kill_node": kill_own_node, "kill_process": kill_own_process, "hang": hang_own_process,
           "freeze_node": freeze_own_node, "freeze_process": freeze_own_process}
THAWABLE = ("freeze_node", "freeze_process")


def inject(action: str, thaw_after_s: float | None = None) -> None:
    """Run one fault in the calling worker process. Returns only after a thawed freeze; the
    caller then behaves as a process that lost `thaw_after_s` seconds (fencing decides what
    it may still do)."""
    if action in THAWABLE:
        ACTIONS[action](thaw_after_s)
        if thaw_after_s is not None:
            return
    else:
        ACTIONS[action]()
    time.sleep(3600)  # a hang, or a kill still in flight, must never fall through into the next step
