"""Who is lost while the group waits on something other than training: a restore (every rank in
its collectives), or the start of replacements (the survivors idle). Judged as in training
(running.py): a rank whose node refuses the heartbeat, or that answers no poll while its node's
heartbeat is silent or says its process is stopped, for failure.ping_timeout_s; Ray's word on a
dead one at once. The wait's own deadline stays a backstop."""
from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.policies.failure import REFUSED_GRACE_S, decide_refused, decide_silence
from elastic.protocol import LostCause, Watch
from elastic.runtime.heartbeat import refused_ranks

if TYPE_CHECKING:
    from elastic.controller.controller import Controller


def group_watch(ctl: Controller, during: str) -> Watch:
    """A `Watch` for the group's wait `during` ("restore", "promote"): given the ranks it waits
    on, {rank: why} of those lost; each verdict said in a `silence_detected` event."""
    cfg, t0 = ctl.job.failure, ctl.now()

    def lost(pending: set[int]) -> dict[int, str]:
        _, silent = ctl.group.poll_nowait(cfg.ping_timeout_s)
        out = {r: why for r, why in silent.items() if r in pending and why != LostCause.UNRESPONSIVE}
        beats = ctl.group.beats() if cfg.heartbeat else {}
        unanswered = ctl.group.unanswered_s()
        quiet = {r: why for r, why in silent.items() if r in pending and why == LostCause.UNRESPONSIVE}
        decision = (decide_refused(pending, refused_ranks(beats), unanswered, REFUSED_GRACE_S)
                    or decide_silence(quiet, unanswered, ctl.now() - t0, cfg, list(ctl.training.step_times), beats))
        if decision is not None:
            ranks, why = decision
            ctl.events.emit("silence_detected", ranks=list(ranks), during=during, reason=why,
                            unanswered_s={r: round(unanswered.get(r, 0.0), 2) for r in ranks})
            out.update({r: LostCause.UNRESPONSIVE.value for r in ranks})
        return out
    return lost
