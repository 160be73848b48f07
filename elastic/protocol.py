"""Every message between the controller, the worker group and the workers, as typed records.

Workers answer the group's calls (`poll`, `run`, `restore*`, `abort`, `info`/`warm`) with these
dataclasses; the group passes them to the controller unchanged. A field renamed on one side is
an AttributeError on the other, not a key that silently reads as missing. The real worker group
(`elastic.group.worker_group.WorkerGroup`) and the fake one the controller tests step against
(`tests/support/fake_group.py`) both implement `WorkerGroupProtocol`; a test compares them.

The enums are `StrEnum`s: equal to their values (`RunStatus.DONE == "done"`), printed and
written to JSON as those values, so events and messages carry the same words as plain strings.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol


class RankStatus(StrEnum):
    """What a worker is doing, as its last poll answer says."""

    IDLE = "idle"  # started, in no group yet
    JOINED = "joined"  # in a group, state not restored yet
    RESTORED = "restored"
    RUNNING = "running"
    STORAGE_WAIT = "storage_wait"  # waiting for a checkpoint persist (storage slow or down): not a hang
    EVALUATING = "evaluating"  # in an evaluation (train.eval_dataset); each forward is progress
    STOPPED = "stopped"  # at an agreed step boundary (a planned change)
    ROLLBACK = "rollback"
    ABORTED = "aborted"
    USER_ERROR = "user_error"
    BAD_STEP = "bad_step"
    DONE = "done"


class RunStatus(StrEnum):
    """How a worker's `run()` ended."""

    DONE = "done"  # trained every step; `digest` is set
    STOPPED = "stopped"  # stopped at the step boundary every rank agreed on
    ROLLBACK = "rollback"  # train.bad_step=rollback: `bad_steps` made no update in a row
    ABORTED = "aborted"  # a collective failed (a peer is gone, or the controller aborted it); `error`
    USER_ERROR = "user_error"  # the user's model, loss or data raised; `error`, `traceback`
    BAD_STEP = "bad_step"  # train.bad_step stopped the run (a non-finite step, or too many in a row); `error`


class LostCause(StrEnum):
    """Why the controller counts a rank as lost."""

    PROCESS_DIED = "process_died"  # its process exited (Ray reports the actor dead)
    NODE_DIED = "node_died"  # Ray reports its node dead
    UNREACHABLE = "unreachable"  # Ray cannot reach its actor
    UNRESPONSIVE = "unresponsive"  # answers no poll while the group waits on it (a stopped machine)
    HANG = "hang"  # no progress within the hang bound
    ERROR = "error"  # its call raised; the process lives (a survivor)


@dataclass(frozen=True)
class EvalResult:
    """One evaluation of the model after `step` (train.eval_dataset), the same on every rank."""

    step: int
    metrics: dict[str, float]  # name -> total over the evaluation set / its number of samples (or counts)
    num_samples: int
    seconds: float  # wall time of the evaluation on the reporting rank


@dataclass(frozen=True)
class RunResult:
    status: RunStatus
    step: int
    generation: int
    error: str | None = None
    traceback: str | None = None
    bad_steps: tuple[int, ...] = ()
    digest: str | None = None


@dataclass(frozen=True)
class RestoreResult:
    """What one rank restored: the step, where from (`source`, for the event), how long it took."""

    step: int
    source: str  # "storage" | "init" | "none loaded" | "peer rank N" | "stage replicas [...]" | "re-sharded ..."
    restore_s: float
    uri: str | None = None  # the checkpoint loaded, on the storage path
    skipped: tuple[tuple[str, str], ...] = ()  # (checkpoint uri, why it did not load)
    phases: dict[str, float] | None = None  # seconds per phase, where timed (a re-shard in memory, a peer's transfer)
    state_bytes: int | None = None  # this rank's state that crossed the group (a restore from a peer)
    # A restore from a peer, point to point: how many ranks of its slot sent (survivors at the
    # source's step) and how many received (the rest), and the bytes this rank received.
    senders: int | None = None
    receivers: int | None = None
    received_bytes: int | None = None


@dataclass(frozen=True)
class AbortResult:
    aborted: bool
    reason: str | None = None  # why not (a stale generation)
    transports: int = 0  # connections cut
    running: bool = False  # run() was in a step when the abort came
    step: int | None = None
    joining: str | None = None  # a join in progress: what it was doing, and for how long


@dataclass(frozen=True)
class WorkerInfo:
    node_id: str
    ip: str
    pid: int
    actor_id: str
    calib_s: float | None = None  # warm(): compute seconds of one step's share (None: not calibrated)
    started_low: bool = False  # warm(): started at the lowest CPU priority beside training


@dataclass
class PersistResult:
    """One checkpoint persist that ended, reported once by the rank that ran it."""

    step: int
    uri: str
    committed: bool
    persist_s: float
    attempts: int
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    reused: bool = False  # the step's folder was committed already (a redone step): nothing written
    stall_s: float = 0.0  # how long save() held the training thread (waiting for the previous persist, snapshot)


@dataclass(frozen=True)
class StepRecord:
    """One completed step on one rank: its own compute time (the straggler signal), the loss, and
    when it ended and how long it took in all (compute + waiting on collectives and data)."""

    step: int
    compute_s: float
    loss: float
    t_end: float = 0.0  # wall clock (time.time()) at the step's end, on the rank's node
    step_s: float = 0.0
    metrics: dict[str, float] | None = None  # the loss function's own, averaged as the loss is


STEP_FIELDS = ("step", "t_end", "step_s", "compute_s")  # a row of steps.json: a StepRecord's times


@dataclass(frozen=True)
class LedgerEntry:
    """The sample ids one dp replica trained on at `step` (train.sample_ledger)."""

    step: int
    world: int  # the dp size the step ran at
    replica: int
    sample_ids: tuple[int, ...]
    # The dataset's length: with the run's seed and global batch, the plan (elastic.data.order)
    # that gives every replica's ids at this step, so the controller can complete a step whose
    # other replicas' reports died with their process.
    num_samples: int = 0


@dataclass(frozen=True)
class MemorySample:
    """A rank's memory now (elastic/runtime/memory_watch.py); the GPU fields are None off CUDA."""

    rss_bytes: int  # the worker process's resident set
    host_limit_bytes: int  # the node's memory, or its cgroup's limit where lower
    gpu_allocated_bytes: int | None = None  # held by tensors
    gpu_reserved_bytes: int | None = None  # held by the caching allocator
    gpu_peak_allocated_bytes: int | None = None  # since the process started
    gpu_total_bytes: int | None = None  # the device's
    gpu_fragmentation: float | None = None  # free-but-split share of reserved


@dataclass(frozen=True)
class PollReport:
    """A worker's answer to `poll()`: its progress now, and everything that happened since its
    last answer (each persist, step, skip and retry is reported exactly once)."""

    rank: int
    generation: int
    status: RankStatus
    step: int
    loss: float | None = None
    step_s: float | None = None  # wall time of the last step
    compute_s: float | None = None  # own compute of the last step
    step_end: float | None = None  # wall-clock end of the last step
    first_step_end: float | None = None  # wall-clock end of the group's first step (recovery and resize times)
    grad_norm: float | None = None
    ckpt_stall_s: float | None = None
    persisting: bool = False  # a checkpoint persist is in flight
    # The rank's model and optimizer are a restored or trained state, at `step`: false for a
    # worker that never restored (a replacement, a spare) and during a restore that overwrites
    # them. Only a rank that holds state may be a restore source.
    holds_state: bool = False
    persists: tuple[PersistResult, ...] = ()
    compute_log: tuple[StepRecord, ...] = ()
    ledger: tuple[LedgerEntry, ...] = ()
    skipped: tuple[tuple[int, str], ...] = ()  # (step, why it made no update)
    abandoned: tuple[int, ...] = ()  # persists of a failed group left to end on their own
    retried: tuple[int, ...] = ()  # steps that saved again after a failed checkpoint
    deferred: tuple[int, ...] = ()  # checkpoint steps skipped while a persist was still running
    memory_steps: tuple[int, ...] = ()  # steps of this rank's own in-memory parts (memory_every_steps)
    copies_held: dict[int, tuple[int, ...]] = field(default_factory=dict)  # rank -> steps of its parts held here
    memory: MemorySample | None = None  # its memory now (at most a second old)
    evaluations: tuple[EvalResult, ...] = ()  # train.eval_dataset: evaluations done (rank 0 reports)
    eval_batches: int = 0  # forwards done in the evaluation in progress (status EVALUATING)
    # Whether it carries anything besides progress (a persist, steps, the ledger, ...): worked out
    # once, where the answer is made, so the controller need not look into each of 100,000.
    news: bool = field(init=False, default=False)

    def __post_init__(self):
        object.__setattr__(self, "news", bool(self.compute_log or self.ledger or self.persists or self.skipped
                                              or self.abandoned or self.retried or self.deferred
                                              or self.evaluations))


@dataclass(frozen=True)
class AgentInfo:
    """A node agent's answer once started (elastic/group/node_agent.py)."""
    node_id: str
    ip: str
    pid: int
    hb_port: int | None  # its node's heartbeat sidecar; None where none can run


@dataclass(frozen=True)
class NodePoll:
    """A node agent's answer to one aggregated poll: every local rank's report that arrived, the
    ranks whose worker died, and how long each still unanswered poll has waited. `actors`: the
    actor id that answered for each rank (an answer for a rank since given to another actor is
    dropped by the group)."""
    epoch: int
    answers: dict[int, PollReport] = field(default_factory=dict)
    died: dict[int, str] = field(default_factory=dict)  # rank -> why (a LostCause value)
    waiting_s: dict[int, float] = field(default_factory=dict)  # rank -> its poll's age at the answer
    actors: dict[int, str] = field(default_factory=dict)


# During a call every member makes together (a restore), which ranks are lost: given the ranks
# still waiting, {rank: why}, judged as in training (the controller's, elastic/controller/restoring.py).
Watch = Callable[[set[int]], dict[int, str]]


class WorkerGroupProtocol(Protocol):
    """What the controller asks of a worker group. Mechanics only: every decision is the
    controller's. `WorkerGroup` implements it on Ray; the controller tests' `FakeGroup` without."""

    members: dict[int, Any]  # rank -> Member (node_id, calib_s, ...)
    ready_spares: list
    suspect_nodes: set[str]
    lost_spares: list[str]
    newly_ready: list[tuple[str, int, bool]]
    slowest_poll_answer_s: float
    placement: Any  # elastic.policies.placement.Placement of the first start (tensor parallelism), or None
    split_reasons: dict[int, str]  # the last promote's: first rank of a tp group -> why it spans nodes

    def start(self, ranks: list[int], timeout_s: float) -> None: ...
    def add_spares(self, n: int, on_demand: bool = False, background: bool = False,
                   calibrate: bool | None = None, near: tuple[str, ...] = (), at: tuple[str, ...] = ()) -> None: ...
    def tend_prestarted(self) -> list[str]: ...  # keep the pre-started workers; why any were lost
    def wait_prestarted_ready(self, timeout_s: float) -> bool: ...
    def prestarted_news(self) -> tuple[int, list[tuple[str, int]]]: ...  # (ready now, [(node, pid)] newly ready)
    def wait_spares_ready(self, timeout_s: float) -> bool: ...
    def num_spares(self) -> int: ...
    def refresh_spares(self, wait_s: float = 0.0) -> list[str]: ...
    def check_spares(self, timeout_s: float) -> list[str]: ...
    def trim_spares(self, keep: int, regroup: bool = True) -> None: ...
    def start_regroup_spares(self) -> int: ...  # tp: spares where they gather a split tp group; how many
    def calibrate_spares(self, timeout_s: float) -> list[str]: ...
    def take_spare_for(self, rank: int, max_calib_s: float, ping_timeout_s: float,
                       home: str | None = None) -> Any: ...
    def spare_homes(self, n: int) -> tuple[str, ...]: ...  # where n new spares belong (tp: beside their groups)
    def suspect(self, node_id: str) -> None: ...
    def probe_suspects(self) -> list[str]: ...
    def request_stop(self, generation: int, timeout_s: float) -> dict[int, int]: ...
    def renumber(self, mapping: dict[int, int] | None = None) -> dict[int, int]: ...
    def promote(self, ranks: list[int], timeout_s: float, ping_timeout_s: float,
                watch: Watch | None = None) -> dict[int, str]: ...
    def form(self, generation: int, timeout_s: float, ping_timeout_s: float, pp: int = 1) -> float: ...
    def abort_all(self, generation: int, timeout_s: float, only: list[int] | None = None) -> dict[int, str]: ...
    def restore(self, candidates: list[str], timeout_s: float, watch: Watch | None = None
                ) -> dict[int, RestoreResult]: ...
    def restore_from_peer(self, src_rank: int, timeout_s: float, slot_sources: tuple[int, ...] = (),
                          watch: Watch | None = None, faults: dict[int, dict] | None = None
                          ) -> dict[int, RestoreResult]: ...
    def restore_from_shards(self, offers: dict, old_world: int, timeout_s: float, old_pp: int = 1,
                            copies_step: int | None = None, watch: Watch | None = None,
                            faults: dict[int, dict] | None = None) -> dict[int, RestoreResult]: ...
    def offer_shards(self, timeout_s: float, keep: frozenset[int] = frozenset()) -> tuple[dict, list[int]]: ...
    def collect_runs(self, refs: dict, timeout_s: float) -> tuple[dict[int, RunResult], dict[int, tuple]]: ...
    def run(self, num_steps: int, faults: list[dict], skip_steps: list[int] = (),
            buddies: dict[int, int] | None = None, evaluated_through: int = 0) -> dict: ...
    def memory_parts(self, sources: dict[int, int], step: int) -> dict: ...
    def keep_copies(self, sources: dict[int, int]) -> None: ...
    def drain_polls(self, timeout_s: float) -> dict[int, PollReport]: ...
    def poll_nowait(self, ping_timeout_s: float) -> tuple[dict[int, PollReport], dict[int, str]]: ...
    def poll(self, timeout_s: float) -> tuple[dict[int, PollReport], dict[int, str]]: ...
    def unanswered_s(self) -> Mapping[int, float]: ...
    def control_traffic(self) -> dict[str, int]: ...  # periodic messages sent: agent and direct polls, pings
    def beats(self, fresh_within_s: float = 0.0) -> dict: ...
    def kill(self, rank: int) -> None: ...
    def wait_runs(self, refs: dict, timeout_s: float) -> dict[int, str]: ...

    def where(self, ranks, timeout_s: float) -> dict[int, str | None]: ...  # where each one's run() is now
    def save_again(self, timeout_s: float) -> dict[int, str]: ...
    def leave_all(self, timeout_s: float) -> dict[int, str]: ...
    def shutdown(self) -> None: ...
