"""The churn benchmark's fault schedule: a pure, seeded Poisson process (no Ray needed)."""
from __future__ import annotations

import math

import pytest

from benchmarks.churn import ACTIONS, Fault, fault_schedule


def test_same_seed_same_schedule_other_seed_other_schedule():
    a = fault_schedule(7, 30.0, 600.0)
    assert a == fault_schedule(7, 30.0, 600.0)
    assert a != fault_schedule(8, 30.0, 600.0)
    assert all(isinstance(f, Fault) and f.action in ACTIONS for f in a)


def test_times_increase_and_stay_inside_the_duration():
    for seed in range(50):
        s = fault_schedule(seed, 5.0, 100.0)
        times = [f.t_s for f in s]
        assert times == sorted(times)
        assert all(0 < t < 100.0 for t in times)


def test_mean_gap_is_the_mtbf():
    # Gaps are exponential with mean m and standard deviation m: the mean of n gaps has standard
    # error m / sqrt(n). 5 standard errors: a false failure has odds of about 1 in 3.5 million.
    mtbf, n = 30.0, 0
    gaps: list[float] = []
    for seed in range(200):
        s = fault_schedule(seed, mtbf, 3000.0)
        gaps += [b - a for a, b in zip([0.0] + [f.t_s for f in s], [f.t_s for f in s])]
    n = len(gaps)
    assert n > 10_000
    assert abs(sum(gaps) / n - mtbf) < 5 * mtbf / math.sqrt(n)


def test_fault_count_matches_duration_over_mtbf():
    # A Poisson count over duration d has mean and variance d/m; summed over many seeds.
    seeds, d, m = 400, 600.0, 30.0
    total = sum(len(fault_schedule(s, m, d)) for s in range(seeds))
    expected = seeds * d / m
    assert abs(total - expected) < 5 * math.sqrt(expected)


def test_actions_are_drawn_from_the_given_ones():
    s = fault_schedule(3, 1.0, 3000.0, actions=["kill_node", "freeze_node"])
    counts = {a: sum(f.action == a for f in s) for a in ("kill_node", "freeze_node", "kill_process")}
    assert counts["kill_process"] == 0
    n = len(s)  # binomial(n, 1/2) per action: 5 standard deviations
    assert abs(counts["kill_node"] - n / 2) < 5 * math.sqrt(n / 4)


def test_zero_duration_and_bad_arguments():
    assert fault_schedule(0, 30.0, 0.0) == []
    for bad in (dict(mtbf_s=0.0), dict(mtbf_s=-1.0), dict(mtbf_s=math.inf), dict(duration_s=-1.0),
                dict(actions=())):
        kw = dict(seed=0, mtbf_s=30.0, duration_s=60.0) | bad
        with pytest.raises(ValueError):
            fault_schedule(**kw)


def test_per_fault_pairs_each_fault_with_the_next_detection_and_resumption():
    from benchmarks.churn import per_fault
    records = [{"t_s": 1.0, "action": "kill_node", "fired_s": 1.0},
               {"t_s": 2.0, "action": "kill_process", "fired_s": 2.5},
               {"t_s": 9.0, "action": "freeze_node", "skipped": "no target"},
               {"t_s": 20.0, "action": "freeze_node", "fired_s": 20.0}]
    out = per_fault(records, 100.0, detections=[103.0, 121.0], resumptions=[108.0])
    assert out == [{"action": "kill_node", "at_s": 1.0, "detect_s": 2.0, "back_s": 7.0},
                   {"action": "kill_process", "at_s": 2.5, "detect_s": 0.5, "back_s": 5.5},
                   {"action": "freeze_node", "at_s": 20.0, "detect_s": 1.0, "back_s": None}]


def test_below_full_figures_count_a_smaller_groups_steps_and_time_them_without_the_recovery_gap():
    from benchmarks.churn import below_full_figures
    # rank 0's steps 1..7 end at t = 10, 11, 14, 15, 15.5, 16, 17: the group shrank to 2 at t=12
    # (steps 3, 4 and 5 ran at 2 of 3 ranks; step 3 after the recovery's gap) and grew back at 15.8.
    ends = [10.0, 11.0, 14.0, 15.0, 15.5, 16.0, 17.0]
    rows = [[s, t, 0.1, 0.05] for s, t in zip(range(1, 8), ends)]
    formed = [(15.8, 3), (0.0, 3), (12.0, 2)]
    out = below_full_figures(rows, formed, first=1, last=7, size=3)
    assert out["steps_below_full"] == 3
    assert out["seconds_below_full"] == pytest.approx(1.5)  # 14 -> 15 -> 15.5
    assert out["steps_per_s_below_full"] == pytest.approx(2 / 1.5)
    assert out["rank_bound_steps"] == pytest.approx(3 + 3 * 2 / 3)  # steps 2, 6, 7 whole; 3-5 two thirds
    # never below full size: every step whole
    assert below_full_figures(rows, [(0.0, 3)], 0, 7, 3) == {
        "steps_below_full": 0, "seconds_below_full": 0.0, "steps_per_s_below_full": None, "rank_bound_steps": 7.0}


def test_torchft_steps_count_by_their_participants_once_per_step():
    from benchmarks.churn_torchft import rank_bound_steps
    # (t, step, participants) from every worker: step 2 logged by two workers, 3 and 4 by the survivors only.
    steps = [(1.0, 1, 3), (1.1, 1, 3), (2.0, 2, 3), (2.1, 2, 3), (3.0, 3, 2), (4.0, 4, 2), (5.0, 5, 3)]
    assert rank_bound_steps(steps, 1, 5, 3) == pytest.approx(1 + 2 / 3 + 2 / 3 + 1)
    assert rank_bound_steps(steps, 0, 1, 3) == 1  # only step 1, counted once though two workers logged it
    # A worker that has not yet seen the quorum's news logs fewer: the step counts the most any logged.
    assert rank_bound_steps([(1.0, 7, 2), (1.2, 7, 3)], 6, 7, 3) == 1


def test_torchft_full_again_is_the_first_full_step_after_each_short_stretch():
    from benchmarks.churn_torchft import full_again
    steps = [(1.0, 1, 3), (2.0, 2, 2), (2.5, 3, 2), (3.0, 4, 3), (3.1, 4, 3), (4.0, 5, 3), (5.0, 6, 1), (6.0, 7, 3)]
    assert full_again(steps, 3) == [3.0, 6.0]
    assert full_again([(1.0, 1, 3), (2.0, 2, 3)], 3) == []  # never short: nothing to come back from
