"""Folding the ranks' poll reports (`PollReport`) into the run's records and events.

Progress (the group's step, loss, step times) moves the run forward and closes a recovery or a
resize at its first step; what is reported once (persists, compute times, the sample ledger,
skipped and retried steps) is folded in from every answer, also those polled during a recovery.
An answer from an older generation describes a group that no longer exists: ignored, once said."""
from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING

from elastic.controller import evaluations
from elastic.protocol import PollReport

if TYPE_CHECKING:
    from elastic.controller.controller import Controller

_step, _step_s = attrgetter("step"), attrgetter("step_s")


def collect(ctl: Controller, timeout_s: float | None = None, progress: bool = True):
    """Before the group changes: the polls in flight and one more carry the last reports.
    Returns the fresh poll's (answers, silent). During a recovery only the reports are folded
    in: progress from before the fault must not count as a step of the recovered group."""
    timeout_s = timeout_s or ctl.job.failure.ping_timeout_s * 5
    fold = absorb if progress else (lambda c, a: absorb_reports(c, current(c, a)))
    fold(ctl, ctl.group.drain_polls(timeout_s))
    answers, silent = ctl.group.poll(timeout_s)
    fold(ctl, answers)
    return answers, silent


def absorb(ctl: Controller, answers: dict[int, PollReport]) -> None:
    """Fold polled progress into run-level progress and events."""
    answers = current(ctl, answers)
    absorb_reports(ctl, answers)
    absorb_progress(ctl, answers)
    evaluations.note_progress(ctl, answers)


def current(ctl: Controller, answers: dict[int, PollReport]) -> dict[int, PollReport]:
    """Answers of the current generation only: one from an older generation comes from a
    worker that was cut off (a frozen machine that came back) and describes a group that no
    longer exists."""
    gen = ctl.generation
    stale = [r for r, a in answers.items() if a.generation != gen and a.generation is not None]
    if not stale:  # the usual case, taken in one pass: at 100,000 ranks every copy counts
        return answers
    out = dict(answers)
    for r in stale:
        g = out.pop(r).generation
        if (r, g) not in ctl.house.stale:
            ctl.house.stale.add((r, g))
            ctl.events.emit("stale_report_ignored", rank=r, generation=g, current_generation=gen)
    return out


def absorb_reports(ctl: Controller, answers: dict[int, PollReport]) -> None:
    """Persist results, compute times and the sample ledger: each is reported once, so every
    answer that carries them must be folded in, also those polled during a recovery."""
    emit, log = ctl.events.emit, ctl.run_log
    # Most answers report only progress: pick out those that carry anything else (`news`, set
    # where the answer was made, on the worker).
    answers = {r: a for r, a in answers.items() if a.news}
    for rank, a in answers.items():
        for p in a.persists:
            if p.committed:
                ctl.checkpoints.last_committed = p.uri
                ctl.checkpoints.committed_steps.add(p.step)
                user = {k: v for k, v in p.metrics.items() if k != "loss"}  # the loss fn's own
                emit("checkpoint_committed", step=p.step, uri=p.uri, persist_s=p.persist_s, stall_s=p.stall_s,
                     attempts=p.attempts, loss=p.metrics.get("loss"),
                     **({"metrics": user} if user else {}))
            elif p.error:
                emit("checkpoint_failed", rank=rank, step=p.step, error=p.error[:300])
        for step in a.abandoned:
            emit("persist_abandoned", rank=rank, step=step,
                 reason="its group failed, so it can never commit, and its write could not be "
                        "cut short (a synchronous filesystem, or a file still being written): "
                        "the rank left it to end on its own, and its next persist waits for it "
                        "before writing")
    for step, why in sorted({(s, w) for a in answers.values() for s, w in a.skipped}):
        if log.skipped.get(step) != why:
            log.skipped[step] = why
            emit("step_skipped", step=step, reason=why)
    for step in sorted({s for a in answers.values() for s in a.retried}):
        emit("checkpoint_retry", step=step,
             reason="a checkpoint failed on storage: saved again at this step, the first after "
                    "its wait, not left to the next checkpoint step")
    for step in sorted({s for a in answers.values() for s in a.deferred}):
        emit("checkpoint_deferred", step=step,
             reason="the previous persist is still running (storage slow or down); training goes "
                    "on, and the next checkpoint step saves again")
    for rank, a in answers.items():
        for rec in a.compute_log:
            if ctl.job.stragglers.enabled:
                ctl.compute_log.setdefault(rank, {})[rec.step] = rec.compute_s
            log.loss_curve[rec.step] = (rec.loss, ctl.world_size)  # a redone step replaces the lost attempt
            if rec.metrics:
                log.user_metrics[rec.step] = rec.metrics
            if rec.t_end:
                log.record_step(rank, rec.step, rec.t_end, rec.step_s, rec.compute_s, ctl.world_size)
        for e in a.ledger:
            log.num_samples = e.num_samples or log.num_samples
            entry = log.ledger.get(e.step)
            if entry is None or entry[0] != e.world or e.replica in entry[1]:  # a new attempt at this step
                entry = log.ledger[e.step] = (e.world, {})
            entry[1][e.replica] = list(e.sample_ids)
    evaluations.absorb(ctl, answers)
    if ctl.loggers.enabled:  # a committed checkpoint's steps: no restore or rollback redoes them
        committed = max(ctl.checkpoints.committed_steps, default=0)
        ctl.loggers.advance(evaluations.logged_through(ctl, committed), log, ctl.wall)


def absorb_progress(ctl: Controller, answers: dict[int, PollReport]) -> None:
    tr = ctl.training
    if not answers:
        return
    tr.reports.update(answers)
    # map/attrgetter/filter: the per-rank passes run in C (a third of the time at 100,000 ranks)
    steps = list(map(_step, answers.values()))
    new_step = min(steps)
    if new_step > tr.step:
        tr.last_progress_at = ctl.now()
        step_s = max(filter(None, map(_step_s, answers.values())), default=None)
        if step_s:
            tr.step_times.append(step_s)
        tr.loss = next((a.loss for a in answers.values() if a.loss is not None and a.step == new_step), tr.loss)
        if ctl.recovery is not None:
            recovered(ctl, answers)
        if ctl.resize is not None and ctl.resize.restore_s is not None:  # restored at the new size
            resized(ctl, answers)
    tr.step = max(tr.step, new_step)
    tr.max_step_seen = max(tr.max_step_seen, max(steps))
    ctl.metrics.on_progress(tr.step, tr.loss, answers, len(ctl.group.ready_spares))


def _first_step_t(ctl: Controller, answers: dict[int, PollReport]) -> float:
    ends = [a.first_step_end for a in answers.values() if a.first_step_end]
    return max(ends) if ends else ctl.wall()


def resized(ctl: Controller, answers: dict[int, PollReport]) -> None:
    """The first step at the new world size completed: how long the resize took."""
    rz, ctl.resize = ctl.resize, None
    first_step_t = _first_step_t(ctl, answers)
    ctl.events.emit("resize_completed", old_world_size=rz.old_world_size, new_world_size=len(ctl.group.members),
                    path=rz.path, source=rz.source, resize_s=first_step_t - rz.decided_t, restore_s=rz.restore_s,
                    first_step_t=first_step_t, reached_step=rz.reached_step, resumed_step=rz.resumed_step,
                    lost_steps=max(0, (rz.reached_step or 0) - (rz.resumed_step or 0)), reason=rz.reason,
                    state_in_place_s=rz.restored_t - rz.decided_t if rz.restored_t is not None else None,
                    **rz.moved)


def recovered(ctl: Controller, answers: dict[int, PollReport]) -> None:
    rec, ctl.recovery = ctl.recovery, None
    first_step_t = _first_step_t(ctl, answers)
    # A fault from outside (a real crash, not an injected one) has no known time: the recovery is
    # measured from its detection, and the detection time is unknown, not zero.
    start_t = rec.fault_t if rec.fault_t is not None else rec.detected_t
    ctl.events.emit("recovered", recover_s=first_step_t - start_t,
                    detect_s=rec.detected_t - rec.fault_t if rec.fault_t is not None else None,
                    measured_from="fault" if rec.fault_t is not None else "detection",
                    resumed_step=rec.resumed_step, fault_step=rec.fault_step,
                    lost_steps=max(0, rec.fault_step - rec.resumed_step), world_size=len(ctl.group.members),
                    state_in_place_s=rec.restored_t - start_t if rec.restored_t is not None else None,
                    **rec.moved)
