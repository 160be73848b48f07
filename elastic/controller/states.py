"""The controller's states, one small class each, holding only their own data.

    Starting -> Forming -> Restoring -> Running -> Finished
                   ^                        |
                   +------ Recovering <-----+ (fault detected)
                   |           |
                   |           +-> Errored (policy says stop)
                   +------ Swapping <-------+ (straggler: planned stop at a step boundary)
                   +------ Growing <--------+ (capacity appeared: planned stop, add ranks)
                   +------ Dropping <-------+ (straggler, no spare, may shrink: planned stop)
                   +------ Trading <--------+ (two ranks of a slot exchange numbers: planned stop)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from elastic.policies.failure import LostRank
from elastic.protocol import RunResult


@dataclass(frozen=True)
class Starting:
    pass


@dataclass(frozen=True)
class Forming:
    pass


@dataclass(frozen=True)
class Restoring:
    pass


@dataclass
class RunWatch:
    """What the run loop learns across its iterations; it lives in the Running state."""

    refs: dict  # rank -> run() call still in flight
    done: dict[int, RunResult] = field(default_factory=dict)  # ranks that finished
    stopped: set[int] = field(default_factory=set)  # ranks that stopped at an agreed step boundary
    aborted: set[int] = field(default_factory=set)  # ranks whose collective failed
    lost: dict[int, LostRank] = field(default_factory=dict)
    failing_since: float | None = None  # first failure signal; then we settle who is lost
    planned: "Swapping | Growing | Dropping | Trading | None" = None  # a planned stop in progress
    storage_wait_logged: bool = False
    storage_wait_since: float | None = None  # every waiting rank has been in storage_wait since then
    rollback: dict[int, RunResult] = field(default_factory=dict)  # ranks asking for a rollback (bad steps)
    last_tick_t: float | None = None  # when the previous iteration began (a stall of the loop itself shows)
    stall_excused: bool = False  # the previous iteration judged nobody: the controller itself had stalled


@dataclass(frozen=True)
class Running:
    watch: RunWatch | None = None  # None: run() not started yet


@dataclass(frozen=True)
class Recovering:
    lost: tuple[LostRank, ...]
    detected_at: float
    user_error: str | None = None


@dataclass(frozen=True)
class Swapping:
    rank: int
    reason: str
    to_node: str | None = None  # a regroup: the node of the spare that gathers the rank's tp group


@dataclass(frozen=True)
class Trading:
    """Two ranks of one slot in different replicas exchange their numbers (regroup.py)."""
    ranks: tuple[int, int]
    reason: str


@dataclass(frozen=True)
class Dropping:
    rank: int
    reason: str


@dataclass(frozen=True)
class Growing:
    num_new: int


@dataclass(frozen=True)
class Finished:
    digests: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Errored:
    error: str


State = (Starting | Forming | Restoring | Running | Recovering | Swapping | Growing | Dropping | Trading | Finished
         | Errored)
TERMINAL = (Finished, Errored)
