"""Placement, ranks and process-group (re)formation for a set of worker actors.

The group does mechanics only (start, form, restore, run, poll, kill), each
with a timeout; it never decides what to do about a failure.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic.worker import Worker


class GroupError(RuntimeError):
    """A group operation failed. `ranks` are the ranks that did not answer or died."""

    def __init__(self, msg: str, ranks: dict[int, str]):
        super().__init__(msg)
        self.ranks = ranks


@dataclass
class Member:
    rank: int
    handle: "ray.actor.ActorHandle"
    node_id: str
    ip: str
    pid: int


def death_cause(e: BaseException) -> str:
    text = str(e).lower()
    # Ray words node loss as "...because its node has died" / "node ... is dead".
    if "its node has died" in text or "node has died" in text or "because its node" in text:
        return "node_died"
    return "process_died"


@ray.remote(num_cpus=0)
def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class WorkerGroup:
    def __init__(self, job, job_json: str, checkpoints_root: str, controller, runtime_env: dict | None):
        self.job, self.job_json, self.root = job, job_json, checkpoints_root
        self.controller = controller
        sc = job.scaling
        self._actor_cls = ray.remote(Worker).options(
            num_cpus=sc.cpus_per_worker, num_gpus=1 if sc.use_gpu else 0,
            max_concurrency=4,  # run() on one thread; poll/ping answer on others
            max_restarts=0,  # the controller replaces workers; Ray must not resurrect a rank behind its back
            scheduling_strategy="SPREAD",
            runtime_env=runtime_env or None,
        )
        self.members: dict[int, Member] = {}

    # ---------------------------------------------------------------- start
    def start(self, ranks: list[int], timeout_s: float) -> None:
        """Start one worker per rank and wait until each has built its dataset and answered.
        On failure, the ones that did start are kept only if all did (a half-done start is undone)."""
        handles = {r: self._actor_cls.remote(self.job_json, self.root, self.controller) for r in ranks}
        refs = {r: h.info.remote() for r, h in handles.items()}
        infos, bad = self._gather(refs, timeout_s)
        if bad:
            for h in handles.values():
                ray.kill(h, no_restart=True)
            raise GroupError(f"could not start workers for ranks {sorted(bad)} within {timeout_s:.0f}s: "
                             f"{bad}; is there a free slot ({self.job.scaling.cpus_per_worker} CPU) per worker?", bad)
        for r, info in infos.items():
            self.members[r] = Member(r, handles[r], info["node_id"], info["ip"], info["pid"])

    # ---------------------------------------------------------------- form / restore / run
    def form(self, timeout_s: float) -> None:
        """A fresh rendezvous (new port, so a fresh store) for the current members."""
        world = len(self.members)
        assert sorted(self.members) == list(range(world)), f"ranks must be 0..{world - 1}: {sorted(self.members)}"
        m0 = self.members[0]
        port, bad = self._gather({0: m0.handle.free_port.remote()}, timeout_s)
        if bad:
            raise GroupError(f"rank 0 did not give a rendezvous port: {bad}", bad)
        refs = {r: m.handle.join.remote(m0.ip, port[0], r, world) for r, m in self.members.items()}
        _, bad = self._gather(refs, timeout_s)
        if bad:
            raise GroupError(f"process group formation failed for ranks {sorted(bad)}: {bad}", bad)

    def restore(self, candidates: list[str], timeout_s: float) -> dict[int, dict]:
        refs = {r: m.handle.restore.remote(candidates) for r, m in self.members.items()}
        out, bad = self._gather(refs, timeout_s)
        if bad:
            raise GroupError(f"restore failed for ranks {sorted(bad)}: {bad}", bad)
        return out

    def run(self, num_steps: int, faults: list[dict]) -> dict[int, "ray.ObjectRef"]:
        return {r: m.handle.run.remote(num_steps, faults) for r, m in self.members.items()}

    def poll(self, timeout_s: float) -> tuple[dict[int, dict], dict[int, str]]:
        """(answers by rank, {rank: why not} for those that died or did not answer in time)."""
        return self._gather({r: m.handle.poll.remote() for r, m in self.members.items()}, timeout_s)

    # ---------------------------------------------------------------- teardown
    def kill(self, rank: int) -> None:
        """Kill a member for sure: ray.kill, plus a SIGKILL by pid from its own node, which also
        ends a stopped (SIGSTOP) process whose Ray core worker cannot act on a kill request.
        Fire and forget: on a dead node the second part never runs, and need not."""
        m = self.members.pop(rank, None)
        if m is None:
            return
        ray.kill(m.handle, no_restart=True)
        _sigkill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(m.node_id, soft=False)).remote(m.pid)

    def wait_runs(self, refs: dict[int, "ray.ObjectRef"], timeout_s: float) -> dict[int, str]:
        """Wait for members' run() calls to return; {rank: why} for those that did not."""
        live = {r: ref for r, ref in refs.items() if r in self.members}
        _, bad = self._gather(live, timeout_s)
        return bad

    def leave_all(self, timeout_s: float) -> dict[int, str]:
        """Ask every member to drop its process group; returns the ranks that could not."""
        _, bad = self._gather({r: m.handle.leave.remote() for r, m in self.members.items()}, timeout_s)
        return bad

    def shutdown(self) -> None:
        for r in list(self.members):
            self.kill(r)

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _gather(refs: dict[int, "ray.ObjectRef"], timeout_s: float) -> tuple[dict[int, object], dict[int, str]]:
        """Results by rank, and {rank: reason} for errors and timeouts, waiting at most timeout_s in all."""
        deadline = time.monotonic() + timeout_s
        ok, bad = {}, {}
        for r, ref in refs.items():
            try:
                ok[r] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except GetTimeoutError:
                bad[r] = "unresponsive"
            except RayActorError as e:
                bad[r] = death_cause(e)
            except Exception as e:  # noqa: BLE001 - a worker method raised
                bad[r] = f"error: {type(e).__name__}: {str(e)[:300]}"
        return ok, bad
