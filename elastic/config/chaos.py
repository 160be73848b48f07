"""Injected faults (the job's `chaos` list): drills, tests and the demo."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from elastic.config.base import Strict


class ChaosFault(Strict):
    """One injected fault, keyed by (rank, step): fires once, on the worker holding `rank`,
    when it has completed `at_step` steps and before it starts the next one."""

    action: Literal["kill_node", "kill_process", "freeze_node", "freeze_process", "hang", "slow", "hold_gil",
                    "kill_agent", "slow_copies"] = Field(
        description="kill_node: SIGKILL the raylet and every process on the rank's node; kill_process: SIGKILL the "
                    "rank's worker; freeze_node: SIGSTOP the raylet and every process on the node (a machine that "
                    "loses power: nothing exits, no socket closes); freeze_process: SIGSTOP the worker only; hang: "
                    "SIGSTOP the rank (alive, silent, holding its sockets); slow: the process computes factor x "
                    "slower from then on; hold_gil: the rank's Python held hold_s seconds (busy, not lost); kill_agent: "
                    "SIGKILL the node agent of the rank's node, workers left running (its ranks are lost with it); "
                    "slow_copies: each of the rank's in-memory copies from then on reaches its buddy delay_s "
                    "seconds late (a slow link to the buddy).")
    rank: int = Field(ge=0, description="The rank the fault hits (below scaling.num_workers).")
    at_step: int = Field(ge=0, description="Fires right after the rank has completed this many steps (below "
                                           "run.num_steps).")
    factor: float = Field(3.0, gt=1, description="slow only: the process computes this many times slower from then on")
    thaw_after_s: float | None = Field(
        None, gt=0, description="freeze_node / freeze_process only: resume (SIGCONT) the frozen processes this "
                                "many seconds later, as a machine back from a partition; default never")
    hold_s: float | None = Field(
        None, gt=0, le=3600, description="hold_gil only: the rank's Python is held this many seconds by one C call "
                                         "that keeps the GIL (as a C extension may): its polls go unanswered while "
                                         "its process sleeps; it then trains on")
    delay_s: float | None = Field(
        None, gt=0, le=600, description="slow_copies only: seconds each in-memory copy of the rank is held back "
                                        "before it is sent to its buddy")
    during_upload: bool = Field(
        False, description="at at_step, first wait until this rank's checkpoint is being written to storage, then "
                           "fire: the drill for a machine lost mid-upload. Waits at most "
                           "failure.collective_timeout_s; fires at once if no persist is in flight (the "
                           "fault_injected event says whether an upload was under way)")
    during_restore: bool = Field(
        False, description="instead of training on at at_step: fire on the worker that takes `rank` as a group "
                           "restores from memory (a replacement taking a peer's state, or re-sharded parts), "
                           "before it joins the restore's collectives, in the first such restore once the run "
                           "reached at_step: the drill for a machine lost mid-restore (kill_process, kill_node, "
                           "freeze_node, freeze_process)")
    during_eval: bool = Field(
        False, description="at at_step, a step train.eval_every_steps evaluates: fire after the rank's "
                           "first evaluation batch, mid-evaluation (the evaluation is redone after the "
                           "recovery); at a step with no evaluation it fires as without this flag")
    after_persist: bool = Field(
        False, description="at at_step, first wait until this rank's checkpoint persist in flight has ended, then "
                           "fire: the drill for a machine lost just after a checkpoint, whose restore from storage "
                           "must lose only the steps since it. Waits at most failure.collective_timeout_s")

    @model_validator(mode="after")
    def _check_thaw(self) -> "ChaosFault":
        if self.during_restore and (self.during_upload or self.after_persist):
            raise ValueError("during_restore fires as a group restores, not at a step's checkpoint: leave out "
                             "during_upload and after_persist")
        if self.during_restore and self.action not in ("kill_process", "kill_node", "freeze_node", "freeze_process"):
            raise ValueError(f"during_restore takes kill_process, kill_node, freeze_node or freeze_process, "
                             f"not {self.action}")
        if self.during_eval and (self.during_upload or self.after_persist or self.during_restore):
            raise ValueError("during_eval fires inside an evaluation: leave out during_upload, "
                             "after_persist and during_restore")
        if self.during_upload and self.after_persist:
            raise ValueError("during_upload and after_persist exclude each other: fire during a checkpoint's "
                             "upload, or after its persist")
        if self.thaw_after_s is not None and self.action not in ("freeze_node", "freeze_process"):
            raise ValueError(f"thaw_after_s is for freeze_node and freeze_process, not {self.action}")
        if (self.hold_s is None) != (self.action != "hold_gil"):
            raise ValueError("hold_gil needs hold_s (seconds the rank's Python is held)" if self.hold_s is None
                             else f"hold_s is for hold_gil, not {self.action}")
        if (self.delay_s is None) != (self.action != "slow_copies"):
            raise ValueError("slow_copies needs delay_s (seconds each copy to the buddy is held back)"
                             if self.delay_s is None else f"delay_s is for slow_copies, not {self.action}")
        return self
