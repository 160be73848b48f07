"""The worker's side of a chaos fault (the job's `chaos:` section, keyed by rank and step): tell
the controller, wait for the moment the fault names (during an upload, after a persist), then
fault. The faults themselves are elastic/runtime/chaos.py's."""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import ray
from ray.exceptions import GetTimeoutError

from elastic.checkpoint.persister import AsyncCheckpointer
from elastic.runtime import chaos

if TYPE_CHECKING:
    from elastic.runtime.worker import Worker

log = logging.getLogger(__name__)


def fire_fault(w: Worker, fault: dict) -> None:
    # Tell the controller first (it records the fault time and never hands this fault out
    # again), then fault. The report must land before the process dies, hence ray.get; within
    # the backstop, so a controller that never answers does not hold the rank (and the drill)
    # for good: the fault then fires unreported, as a fault from outside would.
    uploading = _await_upload(w.ckpt, w.job.failure.collective_timeout_s) if fault.get("during_upload") else None
    if fault.get("after_persist") and w.ckpt is not None:
        w.ckpt.wait(w.job.failure.collective_timeout_s)
    if w.controller is not None:
        bound_s = w.job.failure.collective_timeout_s
        try:
            ray.get(w.controller.report_fault.remote(fault, w.rank, w.step, time.time(), os.getpid(),
                                                     w.generation, uploading), timeout=bound_s)
        except GetTimeoutError:
            log.warning("chaos fault %s at step %s not reported: the controller did not answer within %g s "
                        "(failure.collective_timeout_s); it fires anyway", fault["action"], w.step, bound_s)
    if fault["action"] == "slow":
        w.slow_factor = fault["factor"]  # the process stays slow; the rank may move elsewhere
        return
    if fault["action"] == "slow_copies":
        w.copies.delay_s = fault["delay_s"]  # a slow link to the buddy, from now on
        return
    if fault["action"] == "kill_agent":
        chaos.kill_own_agent()  # then trains on: the controller replaces this node's ranks
        return
    if fault["action"] == "hold_gil":
        chaos.hold_gil(fault["hold_s"])  # then trains on: a busy rank, not a lost one
        return
    chaos.inject(fault["action"], fault.get("thaw_after_s"))


def _await_upload(ck: AsyncCheckpointer | None, limit_s: float) -> bool:
    """Wait (at most `limit_s`) until this rank's persist in flight (`ck`'s) writes to storage;
    True if it does now. False at once when no persist is in flight, or when it ends first."""
    deadline = time.monotonic() + limit_s
    while ck is not None and ck.in_flight() and time.monotonic() < deadline:
        if ck.writing.wait(0.02):
            return ck.in_flight()
    return False
