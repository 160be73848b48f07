"""Stragglers: which rank stays slow, and what to do about it.

The signal is each rank's own compute time per step (forward + backward, measured
before the gradient all-reduce), never its step time: in a synchronous group
every rank waits for the slowest inside the collective, so step times are all
equal and say nothing about who is slow.

A rank's step is slow when its compute time exceeds `threshold x` the median of
the other ranks' at that same step (a step that is slow for everyone, a
checkpoint or a noisy neighbour on every node, is slow for no one). The policy
looks at every step, over a window that slides by one step: a rank is flagged
once more than half of its last `window_steps x consecutive_windows` steps were
slow, and more than half of its last `window_steps` (it is still slow now).
Hysteresis without fixed windows: a blip of up to half the span (5 steps with
the defaults) is never enough, one noisy step only counts once instead of
resetting a streak, and a rank that has recovered is not flagged for its past.
A persistent straggler is flagged after just over half the span, wherever its
slowdown begins (fixed windows took from one to two full spans, depending on
where it fell). Nothing is done within `cooldown_s` of the last action. Action,
in order of preference: swap it for a warm spare that is not itself slow, drop
it if the world may shrink, else report it.
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque
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

    ratios: dict[int, deque] = field(default_factory=dict)  # rank -> its last span's per-step ratios
    compute_s: dict[int, deque] = field(default_factory=dict)  # rank -> its last window's compute times
    last_action_t: float = float("-inf")
    reported: set[int] = field(default_factory=set)

    def clear(self) -> None:
        """A new group: its ranks' history starts afresh (the cooldown and reports stay)."""
        self.ratios.clear()
        self.compute_s.clear()


def healthy_compute_s(state: StragglerState, ranks, exclude=()) -> float | None:
    """The median over `ranks` (less `exclude`) of each one's median compute in its window: what
    a spare's calibration is weighed against. None before any of them has a window."""
    per_rank = [statistics.median(state.compute_s[r]) for r in ranks if r not in exclude and state.compute_s.get(r)]
    return statistics.median(per_rank) if per_rank else None


def span(cfg: StragglerConfig) -> int:
    return cfg.window_steps * cfg.consecutive_windows


def step_ratios(compute_s: dict[int, float]) -> dict[int, float]:
    """Each rank's compute time at one step ÷ the median of the other ranks' at that step. One
    sort per step, not one per rank: the others' sorted times are the step's with one copy of the
    rank's own value taken out, so their middle is read off the step's sorted list."""
    ordered = sorted(compute_s.values())
    m = len(ordered) - 1  # how many others each rank has
    if m < 1:
        return {}

    def others_at(i: int, at: int) -> float:  # the others' i-th smallest, own value taken out at `at`
        return ordered[i] if i < at else ordered[i + 1]

    out = {}
    for r, c in compute_s.items():
        at = bisect.bisect_left(ordered, c)
        med = (others_at(m // 2, at) if m % 2 else (others_at(m // 2 - 1, at) + others_at(m // 2, at)) / 2)
        out[r] = c / max(med, 1e-9)
    return out


def observe(state: StragglerState, compute_s: dict[int, float], cfg: StragglerConfig) -> dict[int, float]:
    """Fold one step (rank -> its compute time at that step) into the state; returns the ratios."""
    ratios = step_ratios(compute_s)
    for r, x in ratios.items():
        state.ratios.setdefault(r, deque(maxlen=span(cfg))).append(x)
    for r, c in compute_s.items():
        state.compute_s.setdefault(r, deque(maxlen=cfg.window_steps)).append(c)
    return ratios


def slow_steps(state: StragglerState, cfg: StragglerConfig, last: int | None = None) -> dict[int, int]:
    """Rank -> how many of its last `last` (default: the whole span) steps were slow."""
    n = last or span(cfg)
    return {r: sum(x > cfg.threshold for x in list(xs)[-n:]) for r, xs in state.ratios.items()}


def window_ratios(state: StragglerState, cfg: StragglerConfig) -> dict[int, float]:
    """Rank -> the median of its per-step ratios over its last `window_steps` steps (for the log)."""
    return {r: statistics.median(list(xs)[-cfg.window_steps:]) for r, xs in state.ratios.items() if xs}


def flagged(state: StragglerState, cfg: StragglerConfig) -> list[int]:
    """Ranks slow in more than half of a full span and more than half of the last window, the
    slowest-counted first."""
    total, recent = slow_steps(state, cfg), slow_steps(state, cfg, cfg.window_steps)
    out = [r for r, xs in state.ratios.items()
           if len(xs) == span(cfg) and 2 * total[r] > span(cfg) and 2 * recent[r] > cfg.window_steps]
    return sorted(out, key=lambda r: (-total[r], r))


def decide_straggler(state: StragglerState, cfg: StragglerConfig, now: float, spare_compute_s: list[float],
                     rank_median_s: float, may_shrink: bool = False,
                     may_swap: bool = True) -> tuple[StragglerDecision, str]:
    """`spare_compute_s`: calibrated compute time of each ready spare for one rank's share of a step;
    `rank_median_s`: the median compute time of the healthy ranks, for comparing spares;
    `may_shrink`: the world is above scaling.min_workers; `may_swap`: a spare could take the
    rank's state from memory (not at one replica of a tp layout: Shape.swappable). Swap for a
    spare, else drop, else report."""
    ranks = flagged(state, cfg)
    if not ranks:
        return NoAction(), "no rank slow in most of its last steps"
    rank = ranks[0]
    n, of = slow_steps(state, cfg)[rank], span(cfg)
    slow = f"rank {rank} slow in {n} of its last {of} steps"
    if now - state.last_action_t < cfg.cooldown_s:
        return NoAction(), (f"{slow}, but in cooldown "
                            f"({now - state.last_action_t:.1f}s < {cfg.cooldown_s}s since the last action)")
    if not may_swap:
        return Report(rank), (f"{slow}; no other replica holds its slot's state (one replica of a tensor-parallel "
                              f"layout), so a spare could not take it from memory: report only")
    usable = sorted(s for s in spare_compute_s if s <= cfg.threshold * rank_median_s)
    if usable:
        return Swap(rank, usable[0]), (
            f"{slow} (compute time above {cfg.threshold}x the others' median); swap it for a spare "
            f"(calibrated {usable[0]:.3f}s vs healthy median {rank_median_s:.3f}s)")
    why = ("no spare" if not spare_compute_s else
           f"every spare is slow itself ({min(spare_compute_s):.3f}s > {cfg.threshold} x {rank_median_s:.3f}s)")
    if may_shrink:
        return Drop(rank), f"{slow}; {why}: drop it and go on with one rank fewer (above scaling.min_workers)"
    return Report(rank), f"{slow}; {why}, and the world may not shrink (scaling.min_workers): report only"
