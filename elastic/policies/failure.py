"""What to do when ranks fail, and when "no progress" means a hang."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from elastic.config import FailureConfig


@dataclass(frozen=True)
class LostRank:
    rank: int
    cause: str  # "process_died" | "node_died" | "unresponsive" | "hang" | "collective_error"
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
    """Re-form the group at the same world size: replace `ranks` with new workers, keep the rest,
    and restore every rank from the latest committed checkpoint."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Raise:
    error: str


Decision = Restart | Raise


def decide_failure(obs: FailureObservation, cfg: FailureConfig, now: float) -> tuple[Decision, str]:
    where = f"last committed checkpoint: {obs.last_checkpoint or 'none'}"
    if obs.user_error:
        return Raise(f"training code raised: {obs.user_error}; {where}"), "user code error: a retry would fail again"
    what = ", ".join(f"rank {x.rank} {x.cause}" + (f" ({x.detail})" if x.detail else "") for x in obs.lost) \
        or "collective failed on every rank, none lost"
    if obs.failures_so_far >= cfg.max_failures:
        return (Raise(f"{what}; failure.max_failures={cfg.max_failures} reached; {where}"),
                f"{obs.failures_so_far} recoveries already, limit {cfg.max_failures}")
    ranks = tuple(sorted(x.rank for x in obs.lost))
    return (Restart(ranks),
            f"{what}; recovery {obs.failures_so_far + 1}/{cfg.max_failures}: "
            f"replace {list(ranks) or 'no rank'}, restore from the latest committed checkpoint")


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
