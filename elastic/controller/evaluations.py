"""The controller's record of the run's evaluations (train.eval_dataset): each folded in once from
the ranks' poll reports, said in an `evaluated` event, kept in the run log (metrics.json, the
Result) and held back from the loggers until it has arrived.

The record is what the workers are told at every run() (`evaluated_through`): an evaluation a
fault cut short, or whose report died with its rank, is not in it, and is done again after the
recovery from the same weights. One that arrives twice (a rank evaluated again what it had
already reported) is the same numbers, and is said once."""
from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.protocol import EvalResult, PollReport, RankStatus

if TYPE_CHECKING:
    from elastic.controller.controller import Controller


def absorb(ctl: Controller, answers: dict[int, PollReport]) -> None:
    """Record and say each evaluation reported for the first time."""
    got = ctl.run_log.evaluations
    for a in answers.values():
        for ev in a.evaluations:
            if ev.step in got:
                continue
            got[ev.step] = ev
            ctl.events.emit("evaluated", step=ev.step, metrics=ev.metrics,
                            num_samples=ev.num_samples, seconds=ev.seconds)


def note_progress(ctl: Controller, answers: dict[int, PollReport]) -> None:
    """A forward of an evaluation is progress, as a step is: an evaluation longer than the hang
    bound (a large set) is not taken for a hang, and one whose forwards stop still is."""
    if ctl.job.train.eval_dataset is None:
        return
    seen = max(((a.step, a.eval_batches) for a in answers.values()
                if a.status == RankStatus.EVALUATING), default=None)
    tr = ctl.training
    if seen is not None and seen != tr.eval_seen:
        tr.eval_seen = seen
        tr.last_progress_at = ctl.now()


def due_steps(num_steps: int, every: int | None) -> list[int]:
    """The steps a run of `num_steps` evaluates after."""
    steps = list(range(every, num_steps, every)) if every else []
    return steps + [num_steps]


def logged_through(ctl: Controller, committed_through: int) -> int:
    """How far the loggers may write: the committed steps, but not past an evaluation step whose
    evaluation has not arrived yet (a step is written whole, once, so its eval/ scalars must be
    there when it is). Steps before this controller's first restore were evaluated by an earlier
    submission, or never: they hold nothing back."""
    tr, log = ctl.job.train, ctl.run_log
    if tr.eval_dataset is None:
        return committed_through
    start = log.eras[0][0] if log.eras else 0
    missing = [s for s in due_steps(ctl.job.run.num_steps, tr.eval_every_steps)
               if start <= s <= committed_through and s not in log.evaluations]
    return min(missing) - 1 if missing else committed_through

