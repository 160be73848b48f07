"""Stragglers: which rank stays slow, and what to do about it.

The signal is each rank's own compute time per step (forward + backward, measured
before the gradient all-reduce), never its step time: in a synchronous group
every rank waits for the slowest inside the collective, so step times are all
equal and say nothing about who is slow.

A rank is slow in a window when the median of its compute times over the
window exceeds `threshold x` the median of the other ranks' window medians. It
is flagged after `consecutive_windows` slow windows in a row (hysteresis: one
slow step, or one slow window, is never enough), and nothing is done within
`cooldown_s` of the last action. Action, in order of preference: swap it for a
warm spare that is not itself slow, drop it if the world may shrink (not
possible yet: the world size is fixed), else report it.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from elastic.config import StragglerConfig


@dataclass(frozen=True)
class Swap:
    rank: int
    spare_compute_s: float | None


@dataclass(frozen=True)
class Report:
    rank: int


@dataclass(frozen=True)
class NoAction:
    pass


@dataclass(frozen=True)
class Drop:
    rank: int


StragglerDecision = Swap | Drop | Report | NoAction


@dataclass
class StragglerState:
    """What the policy remembers between calls (owned by the controller, updated by `observe`)."""

    slow_windows: dict[int, int] = field(default_factory=dict)
    last_action_t: float = float("-inf")
    last_window_end: int = 0
    reported: set[int] = field(default_factory=set)


def window_medians(compute_s: dict[int, list[float]]) -> dict[int, float]:
    return {r: statistics.median(ts) for r, ts in compute_s.items() if ts}


def observe(state: StragglerState, window: dict[int, list[float]], cfg: StragglerConfig) -> dict[int, float]:
    """Fold one complete window (rank -> its compute times in that window) into the state.
    Returns each rank's ratio to the median of the others, for the log."""
    med = window_medians(window)
    ratios = {}
    for r, m in med.items():
        others = [v for q, v in med.items() if q != r]
        if not others:
            continue
        ratios[r] = m / max(statistics.median(others), 1e-9)
        state.slow_windows[r] = state.slow_windows.get(r, 0) + 1 if ratios[r] > cfg.threshold else 0
    return ratios


def decide_straggler(state: StragglerState, cfg: StragglerConfig, now: float, spare_compute_s: list[float],
                     rank_median_s: float, may_shrink: bool = False) -> tuple[StragglerDecision, str]:
    """`spare_compute_s`: calibrated compute time of each ready spare for one rank's share of a step;
    `rank_median_s`: the median compute time of the healthy ranks, for comparing spares;
    `may_shrink`: the world is above scaling.min_workers. Swap for a spare, else drop, else report."""
    flagged = sorted((r for r, n in state.slow_windows.items() if n >= cfg.consecutive_windows),
                     key=lambda r: -state.slow_windows[r])
    if not flagged:
        return NoAction(), "no rank slow for enough consecutive windows"
    rank = flagged[0]
    n = state.slow_windows[rank]
    if now - state.last_action_t < cfg.cooldown_s:
        return NoAction(), (f"rank {rank} slow for {n} windows, but in cooldown "
                            f"({now - state.last_action_t:.1f}s < {cfg.cooldown_s}s since the last action)")
    usable = sorted(s for s in spare_compute_s if s <= cfg.threshold * rank_median_s)
    if usable:
        return Swap(rank, usable[0]), (
            f"rank {rank} compute time above {cfg.threshold}x the others' median for {n} consecutive windows "
            f"of {cfg.window_steps} steps; swap it for a spare (calibrated {usable[0]:.3f}s vs healthy median "
            f"{rank_median_s:.3f}s)")
    why = ("no spare" if not spare_compute_s else
           f"every spare is slow itself ({min(spare_compute_s):.3f}s > {cfg.threshold} x {rank_median_s:.3f}s)")
    if may_shrink:
        return Drop(rank), (f"rank {rank} slow for {n} consecutive windows; {why}: drop it and go on with one "
                            f"rank fewer (above scaling.min_workers)")
    return Report(rank), (f"rank {rank} slow for {n} consecutive windows; {why}, and the world may not shrink "
                          f"(scaling.min_workers): report only")
