"""The straggler window: fold each step's compute times into the policy's state, log the
window, and act on a Swap or Drop decision by asking every rank to stop at a step boundary."""
from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.controller.resize import begin_resize, request_stop
from elastic.controller.states import Dropping, Swapping
from elastic.policies.straggler import (Drop, Report, Swap, decide_straggler, flagged, healthy_compute_s, observe,
                                        slow_steps, span, window_ratios)

if TYPE_CHECKING:
    from elastic.controller.controller import Controller


def check(ctl: Controller) -> Swapping | Dropping | None:
    """Fold every step all ranks have reported into the straggler state, one at a time (the
    policy's window slides by one step); log the window every `window_steps` steps; on a
    Swap decision, ask all ranks to stop at a common step boundary a few steps ahead."""
    sc = ctl.job.stragglers
    state = ctl.stragglers
    ranks = list(ctl.group.members)
    while all(ctl.next_straggler_step in ctl.compute_log.get(r, {}) for r in ranks):
        step = ctl.next_straggler_step
        ctl.next_straggler_step += 1
        observe(state, {r: ctl.compute_log[r].pop(step) for r in ranks}, sc)  # folded in once
        if step % sc.window_steps == 0:
            ratios = window_ratios(state, sc)
            ctl.metrics.on_window(ratios)
            recent = slow_steps(state, sc, sc.window_steps)
            slow = [r for r in ranks if 2 * recent.get(r, 0) > sc.window_steps]
            if slow:
                total = slow_steps(state, sc)
                ctl.events.emit("slow_window", step=step, ratios={r: round(x, 2) for r, x in ratios.items()},
                                slow_steps={r: total[r] for r in slow}, of=span(sc))
        suspects = flagged(state, sc)
        if not suspects:
            continue
        healthy_s = healthy_compute_s(state, ranks, exclude=suspects) or 0.0
        ctl.group.refresh_spares()
        # A spare started on demand for a recovery and kept has not been calibrated yet: six
        # computes of a rank's share (with tp, of the whole model: tp x longer); a spare that needs
        # more than ten healthy ones is no use.
        ctl.group.lost_spares += ctl.group.calibrate_spares(max(ctl.job.failure.ping_timeout_s * 5,
                                                                10 * ctl.job.train.tp.size * healthy_s))
        # Dropping one rank keeps a flat world (ddp, fsdp); a staged one (HSDP, tp) loses whole
        # replicas only, which is not worth one slow rank: there a straggler is swapped or reported.
        may_shrink = ctl.world_size > ctl.job.scaling.min_size and not ctl.shape.staged
        decision, reason = decide_straggler(state, sc, ctl.now(),
                                            [m.calib_s for m in ctl.group.ready_spares if m.calib_s],
                                            healthy_s, may_shrink=may_shrink,
                                            may_swap=ctl.shape.swappable(ctl.layout))
        if isinstance(decision, (Report, Swap, Drop)) and decision.rank in ctl.group.members:
            ctl.slow_nodes.add(ctl.group.members[decision.rank].node_id)  # no uncalibrated spare regroups there
        if isinstance(decision, Report) and decision.rank not in state.reported:
            state.reported.add(decision.rank)
            ctl.events.emit("decision", decision="Report", ranks=[decision.rank], reason=reason, step=step)
        if isinstance(decision, (Swap, Drop)):
            state.last_action_t = ctl.now()
            ctl.events.emit("decision", decision=type(decision).__name__, ranks=[decision.rank],
                            reason=reason, healthy_compute_s=healthy_s, step=step)
            if not request_stop(ctl):
                return None
            if isinstance(decision, Swap):
                ctl.swap_healthy_s = healthy_s
                return Swapping(decision.rank, reason)
            begin_resize(ctl, ctl.world_size - 1, reason)
            return Dropping(decision.rank, reason)
    return None
