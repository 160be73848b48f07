"""The end of a run: every rank trained the last step; the final checkpoint must commit, the
replicas' digests are compared, the sample ledger is written."""
from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.checkpoint.fencing import current_generation
from elastic.checkpoint.layout import latest_committed
from elastic.controller import reports
from elastic.controller.states import Errored, Finished
from elastic.protocol import RunResult
from elastic.storage import call_within

if TYPE_CHECKING:
    from elastic.controller.controller import Controller


def finish(ctl: Controller, done: dict[int, RunResult]) -> Finished | Errored:
    # Every run() waited for its last persist: collect those reports. Storage has the last
    # word on what is committed.
    reports.collect(ctl)
    ctl.training.step = max(o.step for o in done.values())
    if ctl.job.run.sample_ledger:
        ctl.run_log.write_ledger(ctl.storage, ctl.run_dir, ctl.fence.holds, ctl.job.run.seed,
                                 ctl.job.train.global_batch_size, ctl.training.step)
    missing = final_checkpoint(ctl)
    digests = {r: o.digest for r, o in done.items()}
    # Replicas of the same stage hold the same state (ddp: every rank; a pipeline: per stage).
    lay = ctl.layout
    by_stage = {s: {d for r, d in digests.items() if lay.stage_of(r) == s} for s in range(lay.pp)}
    ctl.events.emit("final_state", step=ctl.step, digests=digests,
                    replicas_identical=all(len(ds) <= 1 for ds in by_stage.values()))
    return Errored(missing) if missing else Finished(digests)


def logged_through(ctl: Controller, finished: bool) -> int:
    """The last step the loggers may write at the end of the run: every step once the final
    checkpoint committed; else the newest committed checkpoint's, as storage shows it (a commit
    whose report died with its rank counts too), which a resubmitted run resumes after."""
    if finished or not ctl.loggers.enabled:
        return ctl.step
    answered, latest, error = call_within(lambda: latest_committed(ctl.storage, ctl.root),
                                          ctl.grace_s)
    from_storage = latest.step if answered and error is None and latest is not None else 0
    return max(from_storage, max(ctl.checkpoints.committed_steps, default=0))


def fenced_out(ctl: Controller) -> str | None:
    """Why this controller's checkpoints are refused by the fence, naming who holds the run and
    its generation; None when they are not (the fence shows ours, or cannot be read)."""
    answered, shown, _ = call_within(lambda: current_generation(ctl.storage, ctl.root), ctl.grace_s)
    if not answered or shown is None or shown <= ctl.generation:
        return None
    answered, holder, _ = call_within(ctl.lease.newest, ctl.grace_s)
    who = (f"lease {holder.number}, held by {holder.holder} (host {holder.host})" if answered and holder
           else "another driver")
    return (f"this run's checkpoints are refused by the fence: it shows generation {shown}, above this "
            f"controller's {ctl.generation}; {who} owns the run folder now, and nothing of this driver's "
            f"is committed from here on")


def final_checkpoint(ctl: Controller) -> str | None:
    """The run's last checkpoint is what a user takes away: if it did not commit (storage out
    for longer than the persist's retries, or the new generation's fence not landed after a
    recovery), the ranks still hold the final state, so they save it again until it commits,
    within checkpoint.final_wait_s. Returns None once it is committed, else why not."""
    cfg = ctl.job.checkpoint
    cks = ctl.checkpoints
    t0 = ctl.now()
    attempts = 0
    while True:
        answered, latest, error = call_within(lambda: latest_committed(ctl.storage, ctl.root), ctl.grace_s)
        if answered and error is None and latest is not None:
            cks.last_committed = latest.uri
        if ctl.step in cks.committed_steps or (answered and latest is not None and latest.step >= ctl.step):
            if attempts:
                ctl.events.emit("final_checkpoint_committed", step=ctl.step, attempts=attempts,
                                waited_s=round(ctl.now() - t0, 2), uri=cks.last_committed)
            return None
        left = cfg.final_wait_s - (ctl.now() - t0)
        if left <= 0:
            why = (f"trained all {ctl.step} steps, but the final checkpoint did not commit "
                   f"({attempts} more save(s) in {ctl.now() - t0:.0f} s, checkpoint.final_wait_s="
                   f"{cfg.final_wait_s:g}); the newest committed checkpoint is "
                   f"{cks.last_committed or 'none'}: ")
            fenced = fenced_out(ctl)
            why += (f"fenced: {fenced}" if fenced else
                    "resume from it once storage answers, or raise checkpoint.final_wait_s")
            ctl.events.emit("final_checkpoint_missing", step=ctl.step, attempts=attempts,
                            waited_s=round(ctl.now() - t0, 2), newest=cks.last_committed)
            return why
        attempts += 1
        ctl.events.emit("final_checkpoint_retry", step=ctl.step, attempt=attempts, newest=cks.last_committed,
                        left_s=round(left, 1))
        bad = ctl.group.save_again(left)
        reports.collect(ctl)
        if bad and ctl.now() - t0 < cfg.final_wait_s:  # else: the time ran out during the save
            return (f"trained all {ctl.step} steps, but the final checkpoint did not commit, and rank(s) "
                    f"{sorted(bad)} did not finish saving it again ({'; '.join(set(bad.values()))[:300]}); "
                    f"the newest committed checkpoint is {cks.last_committed or 'none'}")
