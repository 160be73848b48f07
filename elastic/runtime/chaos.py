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


class SlowCompute:
    """The "slow" fault of one process: each step's compute made `factor` x longer by the wall
    clock, burning (factor - 1) x the last step's compute. Inside the compute where it can be
    (between the first micro-batch's forward and backward: peers whose backward holds collectives
    with this rank, fsdp and tp, then wait for it inside their own compute, as for a slower
    machine); after it otherwise (a pipeline's loss runs on its last stage only; on a GPU a burn
    between calls that only queue kernels slows nothing), and on the first step timed."""

    def __init__(self):
        self._work_s: float | None = None  # the last step's compute by the wall clock, less its burn
        self._left = 0.0  # to burn inside this step's compute
        self._burned = 0.0

    def wrap(self, loss_fn, factor: float, inside: bool):
        """At the step's start: `loss_fn`, burning inside the compute where it can."""
        self._burned = 0.0
        self._left = (factor - 1.0) * self._work_s if factor > 1.0 and inside and self._work_s is not None else 0.0
        if not self._left:
            return loss_fn

        def slowed(*args):
            loss = loss_fn(*args)
            if self._left > 0:
                busy_wait(self._left)
                self._burned, self._left = self._left, 0.0
            return loss
        return slowed

    def finish(self, factor: float, t_start: float, synchronize=None) -> None:
        """Where the compute ends: burn now if nothing was burned inside (`synchronize` first: a
        GPU's queued work is the work done), and note this step's compute for the next."""
        if factor > 1.0 and not self._burned:
            if synchronize is not None:
                synchronize()
            self._burned = (factor - 1.0) * (time.perf_counter() - t_start)
            busy_wait(self._burned)
        self._work_s = max(0.0, time.perf_counter() - t_start - self._burned)


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
