"""CPU priority of a worker that starts beside training: a spare started to refill the pool while
the group trains.

Starting a worker costs seconds of CPU (a Python process, Ray, then importing torch and its
distributed checkpointing: about 3 s of CPU here) before it builds its model. Where it shares CPUs
with training ranks, that time is taken from training. Such a spare starts under Linux's
`SCHED_IDLE` policy: it runs only on CPU time no normal thread wants, and a training thread that
wakes up (from a collective, say) takes its CPU back at once, which nice 19 does not promise. It
returns to its old policy before it calibrates (a spare's speed is measured as it will train) and
before it takes a rank.

Linux only, and only where the process may return to normal scheduling afterwards (CAP_SYS_NICE,
root in most containers, or an RLIMIT_NICE that allows nice 0): `lower()` first proves that on a
throwaway thread, and does nothing where it would fail. A spare that could not return would be a
straggler from its first step.

The lowering has to happen before the worker's module imports torch, which Ray does when it loads
the actor class, before the constructor runs: `elastic/__init__.py` calls `lower_if_asked()` first
thing, when the worker group set `BACKGROUND_ENV` in the actor's runtime env.
"""
from __future__ import annotations

import os
import threading

BACKGROUND_ENV = "ELASTIC_BACKGROUND_START"  # set by the worker group on spares that start beside training

_saved: int | None = None  # the scheduling policy to return to; None: not lowered
_lock = threading.Lock()


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _set(tid: int, policy: int) -> None:
    os.sched_setscheduler(tid, policy, os.sched_param(0))


def _can_return() -> bool:
    """Whether a thread of this process may leave SCHED_IDLE again: tried on a throwaway thread,
    since on Linux the scheduling policy belongs to each thread."""
    ok = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            base = os.sched_getscheduler(tid)
            _set(tid, os.SCHED_IDLE)
            _set(tid, base)
            ok.append(base != os.SCHED_IDLE)
        except (OSError, AttributeError):
            ok.append(False)

    t = threading.Thread(target=probe, name="elastic-priority-probe")
    t.start()
    t.join()
    return bool(ok and ok[0])


def lower() -> bool:
    """Every thread of this process to SCHED_IDLE, where it can be undone. Threads started later
    inherit it from the thread that starts them. True if lowered."""
    global _saved
    with _lock:
        if _saved is not None:
            return True
        if not hasattr(os, "SCHED_IDLE") or not _threads() or not _can_return():
            return False
        _saved = os.sched_getscheduler(threading.get_native_id())
        for tid in _threads():
            try:
                _set(tid, os.SCHED_IDLE)
            except OSError:
                pass  # a thread that ended meanwhile
        return True


def restore() -> bool:
    """Every thread back to the policy it had before `lower()`. True if anything was lowered."""
    global _saved
    with _lock:  # warm() and a recovery's call may both restore, on two of the actor's threads
        if _saved is None:
            return False
        for tid in _threads():
            try:
                _set(tid, _saved)
            except OSError:
                pass  # a thread that ended meanwhile; `lower()` proved the rest is allowed
        _saved = None
        return True


def lowered() -> bool:
    return _saved is not None


def lower_if_asked() -> bool:
    return os.environ.get(BACKGROUND_ENV) == "1" and lower()
