"""What to do when ranks fail, and when "no progress" means a hang."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from elastic.config import FailureConfig
from elastic.protocol import LostCause
from elastic.runtime.heartbeat import PING_INTERVAL_S, STOPPED_STATES

GONE_STATES = frozenset("ZXx")  # of STOPPED_STATES, those of a process that is no more: zombie, dead


@dataclass(frozen=True)
class LostRank:
    rank: int
    cause: str  # an elastic.protocol.LostCause: process_died, node_died, unreachable, unresponsive, hang, error
    detail: str = ""


@dataclass(frozen=True)
class FailureObservation:
    lost: tuple[LostRank, ...]
    world_size: int
    failures_so_far: int  # recoveries already done in this run
    user_error: str | None = None  # the user's code raised: retrying would raise again
    last_checkpoint: str | None = None


@dataclass(frozen=True)
class Restart:
    """Re-form the group at the same world size: replace `ranks` (spares first), keep the rest.
    Where state comes from is decided after the survivors are known (`choose_restore`)."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Raise:
    error: str


Decision = Restart | Raise


def decide_failure(obs: FailureObservation, cfg: FailureConfig, now: float) -> tuple[Decision, str]:
    where = f"last committed checkpoint: {obs.last_checkpoint or 'none'}"
    if obs.user_error:
        return Raise(f"training code raised: {obs.user_error}; {where}"), "user code error: a retry would fail again"
    what = ", ".join(f"rank {x.rank} {x.cause}" + (f" ({x.detail})" if x.detail and x.detail != x.cause else "")
                     for x in obs.lost) \
        or "collective failed on every rank, none lost"
    if obs.failures_so_far >= cfg.max_failures:
        return (Raise(f"{what}; failure.max_failures={cfg.max_failures} reached; {where}"),
                f"{obs.failures_so_far} recoveries already, limit {cfg.max_failures}")
    ranks = tuple(sorted(x.rank for x in obs.lost))
    return (Restart(ranks),
            f"{what}; recovery {obs.failures_so_far + 1}/{cfg.max_failures}: replace {list(ranks) or 'no rank'}")


def silence_bound_s(step_times_s: list[float], cfg: FailureConfig) -> float:
    """How long the group must make no progress before an unanswered poll means a lost rank:
    ping_timeout_s, or silence_factor x the median step when steps are longer. A step of a large
    model is seconds of no progress by itself, and a rank in it may answer late (a poll needs the
    GIL, which a checkpoint's writes into s3fs buffers hold for a few hundred ms at a time)."""
    if not step_times_s:
        return cfg.ping_timeout_s
    return max(cfg.ping_timeout_s, cfg.silence_factor * statistics.median(step_times_s))


def node_says_running(beat, ping_timeout_s: float) -> bool:
    """A rank's heartbeat (`elastic.runtime.heartbeat.Beat`) answered within ping_timeout_s and says its
    process runs or sleeps: its machine is up and the rank is busy, not lost."""
    return beat.age_s <= ping_timeout_s and beat.state not in STOPPED_STATES


def decide_silence(silent: dict[int, str], unanswered_s: dict[int, float], idle_s: float, cfg: FailureConfig,
                   step_times_s: list[float] = (), beats: dict | None = None) -> tuple[tuple[int, ...], str] | None:
    """A machine that stops (power, kernel panic, partition) closes no socket: its peers wait on it
    and never see an error. The sign is silence: ranks whose poll has been unanswered
    ("unresponsive", for `unanswered_s` seconds) while the group completed no step either.
    Returns (those ranks, reason), or None.

    `beats` (rank -> `elastic.runtime.heartbeat.Beat`) is what each rank's node says from outside the
    rank's Python process; it decides where present:
      * its sidecar silent for longer than ping_timeout_s too: the machine stopped or is cut off;
      * it reports the process stopped or gone (SIGSTOP, a zombie): lost, after ping_timeout_s;
      * it reports the process running or sleeping: the rank is busy (its Python held), not lost,
        however long its poll waits; a rank that never comes back is the hang bound's to find.
    A rank whose sidecar never answered is judged by its poll alone, against `silence_bound_s`:
    both clocks must pass it. A stopped machine's last poll went out about when it stopped, so its
    silence grows with the group's idle time; a healthy rank that a long stall keeps from
    answering for a while still answers within the bound. A rank slow to answer while others
    still make progress is never lost: it is not holding anyone up."""
    beats = {} if beats is None else beats  # a lazy mapping (heartbeat.Beats): never sized
    bound = silence_bound_s(list(step_times_s), cfg)
    ping = cfg.ping_timeout_s
    by_poll, by_beat = [], []
    for r in sorted(r for r, why in silent.items() if why == "unresponsive"):
        waited, beat = unanswered_s.get(r, 0.0), beats.get(r)
        if beat is None:
            if waited > bound and idle_s > bound:
                by_poll.append(r)
        elif not node_says_running(beat, ping) and waited > ping and idle_s > ping:
            by_beat.append((r, beat))
    if not by_poll and not by_beat:
        return None
    reasons = []
    if by_beat:
        node_silent = [r for r, b in by_beat if b.age_s > ping]
        stopped = [(r, b.state) for r, b in by_beat if b.age_s <= ping]
        seen = []
        if node_silent:
            seen.append(f"ranks {node_silent}: neither the rank nor its node's heartbeat answered for "
                        f"{min(unanswered_s[r] for r in node_silent):.1f}s / "
                        f"{min(b.age_s for r, b in by_beat if r in node_silent):.1f}s or more")
        if stopped:
            seen.append("ranks " + str([r for r, _ in stopped]) + ": the heartbeat says the process is stopped "
                        f"or gone (state {','.join(sorted({s for _, s in stopped}))})")
        reasons.append("; ".join(seen) + f", while the group made no progress for {idle_s:.1f}s (all > "
                       f"failure.ping_timeout_s={ping:g}s)")
    if by_poll:
        least = min(unanswered_s[r] for r in by_poll)
        reasons.append(f"ranks {by_poll} (no heartbeat): answered no poll for {least:.1f}s or more while the group "
                       f"made no progress for {idle_s:.1f}s (both > {bound:.1f}s: the longer of "
                       f"failure.ping_timeout_s={ping:g}s and failure.silence_factor={cfg.silence_factor:g} x the "
                       f"median step)")
    return tuple(sorted(by_poll + [r for r, _ in by_beat])), "; ".join(reasons)


def decide_refused(waiting, refused: list[int], unanswered_s, grace_s: float) -> tuple[tuple[int, ...], str] | None:
    """Ranks lost on their node's refusal: of those still `waiting` (neither failed nor done), the
    ones whose node refused its newest heartbeat pings (`refused`: an ICMP "port unreachable",
    the machine up but nothing listening where its sidecar was; the sidecar exits only with the
    node's agent, and an agent's death is its node's loss) and whose own poll has gone unanswered
    for `grace_s` too. No need to wait out ping_timeout_s, nor for a peer's collective to fail:
    a refusal, unlike silence, is never a busy or starved machine. Returns (ranks, reason) as
    decide_silence does (cause: unresponsive, so nothing new goes to that node until it answers),
    or None."""
    lost = tuple(r for r in refused if r in waiting and unanswered_s.get(r, 0.0) > grace_s)
    if not lost:
        return None
    return lost, (f"ranks {list(lost)}: their node refused the heartbeat's pings (nothing listens where its "
                  f"sidecar was: the node's agent is gone) and they answered no poll for "
                  f"{min(unanswered_s[r] for r in lost):.2f}s or more")


def decide_after_peers_failed(waiting, unanswered_s, beats, grace_s: float, ping_timeout_s: float
                              ) -> dict[int, tuple[LostCause, str]]:
    """Peers' collectives failed (a socket closed under them: gloo's "Connection closed by peer"
    comes within milliseconds of a process's or machine's death); of the ranks still `waiting`
    (neither failed nor done), those to count as lost now instead of after ping_timeout_s:
    {rank: (LostCause, why)}. Only on the node's word, from outside the rank's Python
    (`beats`, as in decide_silence), and only for a rank whose poll has also gone unanswered for
    `grace_s`:
      * its node's heartbeat, fresh, says the process is gone or stopped: lost (process_died when
        gone, so its replacement may take the slot on the same node);
      * its node's heartbeat is silent for `grace_s` too: the machine died with it (unresponsive,
        so nothing new is placed there until it answers).
    A rank whose node says it runs, or whose node never answered, is left to decide_silence and
    the settle bound: a busy rank is not replaced because a peer died. `grace_s` is a few
    heartbeat rounds: a live sidecar answers in milliseconds."""
    out: dict[int, tuple[LostCause, str]] = {}
    for r in sorted(waiting):
        waited, beat = unanswered_s.get(r), beats.get(r)
        if beat is None or waited is None or waited <= grace_s or node_says_running(beat, grace_s):
            continue
        if beat.age_s <= ping_timeout_s and beat.state in STOPPED_STATES:
            gone = beat.state in GONE_STATES
            out[r] = (LostCause.PROCESS_DIED if gone else LostCause.UNRESPONSIVE,
                      f"its peers' collectives failed and its node's heartbeat says the process is "
                      f"{'gone' if gone else 'stopped'} (state {beat.state}); no poll answered for {waited:.2f}s")
        else:  # silent for longer than grace_s
            out[r] = (LostCause.UNRESPONSIVE,
                      f"its peers' collectives failed, and neither it nor its node's heartbeat answered for "
                      f"{waited:.2f}s / {beat.age_s:.2f}s (> {grace_s:g}s)")
    return out


def excused_by_heartbeat(silent: dict[int, str], unanswered_s: dict[int, float], idle_s: float,
                         cfg: FailureConfig, step_times_s: list[float], beats: dict) -> dict[int, str]:
    """Ranks that the poll-only rule would call lost (both clocks past `silence_bound_s`) but whose
    heartbeat says the process runs: {rank: its state}. Only for the event log."""
    bound = silence_bound_s(list(step_times_s), cfg)
    if idle_s <= bound:
        return {}
    return {r: beats[r].state for r, why in silent.items()
            if why == "unresponsive" and r in beats and unanswered_s.get(r, 0.0) > bound
            and node_says_running(beats[r], cfg.ping_timeout_s)}


def decide_none_loaded(reasons: list[str], last_reasons: list[str] | None, waited_s: float,
                       limit_s: float) -> str | None:
    """Committed checkpoints exist but none loaded (the reasons, one per checkpoint tried, and
    those of the attempt before, if any). None: wait and try again (storage may be out, or a
    blip). Otherwise why the run fails: the wait bound is spent, or the same failures came twice
    while storage answered the listing in between (a model that no longer matches its
    checkpoints, say, which no wait will mend). Never a restart from step 0."""
    if waited_s >= limit_s:
        return f"storage did not serve them for {waited_s:.0f} s (checkpoint.restore_wait_s={limit_s:g})"
    if last_reasons is not None and reasons == last_reasons:
        return "the same failures twice, while storage answered in between: waiting will not change them"
    return None


# During a group's formation there is no step time to weigh silence against (the run loop waits
# silence_factor x the median step): a member without a heartbeat is lost when it answers no ping
# for this many times failure.ping_timeout_s. A 90 M-parameter job on a busy 2-core machine once
# answered its first formation's ping after more than 1 s and was replaced as "unresponsive", which
# cost 55 s; a stopped machine is still found 12x sooner than the rendezvous timeout would find it.
FORMATION_SILENCE = 5
# A rank whose node refuses the heartbeat's pings is lost once its own poll has waited this long
# too: one heartbeat round, so a poll answered in the meantime (the refusal was stale) keeps it.
REFUSED_GRACE_S = PING_INTERVAL_S


def formation_silent(unanswered_s: float, beat, ping_timeout_s: float) -> bool:
    """Whether a member whose ping has waited `unanswered_s` while the group forms is lost. With a
    heartbeat (`elastic.runtime.heartbeat.Beat`): as soon as its ping and its node's heartbeat have both
    been silent for ping_timeout_s, or the node says the process is stopped; never while the node
    says the process runs (a busy machine: the rendezvous timeout bounds the wait). Without one:
    after FORMATION_SILENCE x ping_timeout_s. A member whose node refuses the heartbeat's pings
    is lost once its ping has waited REFUSED_GRACE_S."""
    if beat is None:
        return unanswered_s > ping_timeout_s * FORMATION_SILENCE
    if beat.refused and unanswered_s > REFUSED_GRACE_S:
        return True  # its node refused the pings: its agent is gone (decide_refused)
    return not node_says_running(beat, ping_timeout_s) and unanswered_s > ping_timeout_s


def hang_bound_s(step_times_s: list[float], cfg: FailureConfig) -> float:
    """No progress for longer than this is a hang: hang_factor x the median step, never below the floor."""
    if not step_times_s:
        return cfg.hang_floor_s
    return max(cfg.hang_floor_s, cfg.hang_factor * statistics.median(step_times_s))


def detect_hang(last_progress_at: float, step_times_s: list[float], cfg: FailureConfig,
                now: float) -> tuple[bool, str]:
    bound = hang_bound_s(step_times_s, cfg)
    idle = now - last_progress_at
    if idle > bound:
        med = statistics.median(step_times_s) if step_times_s else float("nan")
        return True, (f"no step completed for {idle:.1f}s > bound {bound:.1f}s "
                      f"(max({cfg.hang_floor_s}s floor, {cfg.hang_factor} x median step {med:.3f}s))")
    return False, f"idle {idle:.1f}s <= bound {bound:.1f}s"
