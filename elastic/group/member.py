"""What the worker group knows of one worker actor (`Member`), how it calls many at once with one
deadline (`gather`), how it reads a failed call (`death_cause`, `cause_of`), and how it kills one
for sure (`kill_member`). Shared by the group (elastic/group/worker_group.py) and its spare pool
(elastic/group/spares.py).

A failed call is reported as a why: free text for the event log ("unresponsive", "process_died",
"error: ValueError: ..."). `cause_of` reads the `LostCause` back from it.
"""
from __future__ import annotations

import functools
import itertools
import os
import signal
import time
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic.group.prestart import release_slot
from elastic.protocol import LostCause


class GroupError(RuntimeError):
    """A group operation failed. `ranks` are the ranks that did not answer or died."""

    def __init__(self, msg: str, ranks: dict[int, str]):
        super().__init__(msg)
        self.ranks = ranks


class SurvivorsLost(GroupError):
    """Members found lost (`ranks`: {rank: why}) while the group waited on something else, such
    as replacements starting: the wait is cut so the recovery can take them in at once."""


@dataclass
class Member:
    rank: int
    handle: "ray.actor.ActorHandle"
    node_id: str
    ip: str
    pid: int
    calib_s: float | None = None  # spares: measured compute time of one rank's share of a step
    on_demand: bool = False  # spares: started for a recovery in progress, not ahead of time
    prestarted: bool = False  # taken from its node's pre-started workers (elastic/group/prestart.py)
    slot: object = None  # the placement group that holds a pre-started worker's CPU; removed with it

    @functools.cached_property
    def actor_hex(self) -> str:
        """Its actor's id, as a node agent names who answered (made once per Member)."""
        return self.handle._actor_id.hex()


class Members(dict):
    """rank -> Member, with a `version` that every change makes new (unique across instances), so
    what is derived from the membership (the node agents' ranks) is redone only when it changed."""

    _versions = itertools.count(1)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.version = next(Members._versions)

    def _changed(self) -> None:
        self.version = next(Members._versions)

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        self._changed()

    def __delitem__(self, k):
        super().__delitem__(k)
        self._changed()

    def pop(self, *args):
        self._changed()
        return super().pop(*args)

    def popitem(self):
        self._changed()
        return super().popitem()

    def clear(self):
        self._changed()
        super().clear()

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self._changed()

    def setdefault(self, k, default=None):
        self._changed()
        return super().setdefault(k, default)


_GONE_OR_SILENT = (LostCause.NODE_DIED, LostCause.PROCESS_DIED, LostCause.UNREACHABLE, LostCause.UNRESPONSIVE)


def cause_of(why: str) -> LostCause:
    """A rank's reason reduced to its cause: gone (node_died, process_died, unreachable),
    silent (unresponsive), or alive but failed ("error")."""
    return LostCause(why) if why in _GONE_OR_SILENT else LostCause.ERROR


def short_reason(e: BaseException) -> str:
    if isinstance(e, ActorUnavailableError):
        return "RPC socket closed"
    return str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__


def death_cause(e: BaseException) -> LostCause:
    if isinstance(e, ActorUnavailableError):
        return LostCause.UNREACHABLE  # its RPC socket closed: the process, or the whole node, is gone
    text = str(e).lower()
    # Ray words node loss as "...because its node has died" / "node ... is dead".
    if "its node has died" in text or "node has died" in text or "because its node" in text:
        return LostCause.NODE_DIED
    return LostCause.PROCESS_DIED


def gather(refs: dict[int, "ray.ObjectRef"], timeout_s: float) -> tuple[dict[int, object], dict[int, str]]:
    """Results by rank, and {rank: why} for errors and timeouts, waiting at most timeout_s in all.
    A why is plain text, a cause as its value: a message that prints the dict reads "unresponsive",
    never the enum's repr."""
    deadline = time.monotonic() + timeout_s
    ok, bad = {}, {}
    for r, ref in refs.items():
        try:
            ok[r] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except GetTimeoutError:
            bad[r] = LostCause.UNRESPONSIVE.value
        except RayActorError as e:
            bad[r] = death_cause(e).value
        except Exception as e:  # noqa: BLE001 - a worker method raised
            bad[r] = f"error: {type(e).__name__}: {str(e)[:300]}"
    return ok, bad


WATCH_EVERY_S = 0.2  # how often a watched gather asks who is lost (the run loop's poll interval)


def gather_watched(refs: dict[int, "ray.ObjectRef"], timeout_s: float, watch, method: str
                   ) -> tuple[dict[int, object], dict[int, str]]:
    """`gather`, for a call every member makes together (a restore: its collectives block each
    rank on the others), judged as training is: every WATCH_EVERY_S, `watch(pending ranks)` says
    which are lost ({rank: why}: the heartbeat and the polls, as in the run loop), and a call
    that fails because its process died is seen at once. Once a rank is lost the others are
    waited for no longer: they are blocked on it, and their why is an error, so the recovery
    keeps them and their state (a healthy rank is never counted lost because a peer vanished).
    At `timeout_s` (a backstop) the ranks still waiting are judged once more; if none of them is
    lost they are all counted unresponsive, as `gather` does."""
    deadline = time.monotonic() + timeout_s
    pending = dict(refs)
    ok: dict[int, object] = {}
    bad: dict[int, str] = {}
    while pending:
        left = deadline - time.monotonic()
        ready, _ = ray.wait(list(pending.values()), num_returns=len(pending),
                            timeout=max(0.0, min(WATCH_EVERY_S, left)))
        for r in [r for r, ref in pending.items() if ref in set(ready)]:
            got, failed = gather({r: pending.pop(r)}, 0.0)
            ok.update(got)
            bad.update(failed)
        lost = {r: why for r, why in bad.items() if cause_of(why) != LostCause.ERROR}
        if pending and not lost:
            lost = {r: why for r, why in watch(set(pending)).items() if r in pending}
            bad.update(lost)
            for r in lost:
                pending.pop(r)
        if pending and lost:
            for r in pending:
                bad[r] = f"error: {method} was blocked on lost rank(s) {sorted(lost)}; kept with its state"
            break
        if pending and left <= 0:
            for r in pending:
                bad[r] = LostCause.UNRESPONSIVE.value
            break
    return ok, bad


@ray.remote(num_cpus=0)
def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_member(m: Member) -> None:
    """ray.kill, plus a SIGKILL by pid from its own node, which also ends a stopped (SIGSTOP)
    process whose Ray core worker cannot act on a kill request. Fire and forget."""
    ray.kill(m.handle, no_restart=True)
    if m.slot is not None:
        release_slot(m.slot)
    _sigkill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(m.node_id, soft=False)).remote(m.pid)
