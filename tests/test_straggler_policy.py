"""The straggler policy with a fake clock: which steps flag a rank, decisions and their reasons."""
from elastic.config import StragglerConfig
from elastic.policies.straggler import (Drop, NoAction, Report, StragglerState, Swap, decide_straggler, flagged,
                                        observe, slow_steps)

CFG = StragglerConfig(enabled=True, threshold=1.5, window_steps=5, consecutive_windows=2, cooldown_s=30)
FAST, SLOW = 0.10, 0.30


def feed(state, rank1_compute_s, others=FAST):
    """One step per value: rank 1 computes that long, ranks 0 and 2 `others`."""
    for c in rank1_compute_s:
        observe(state, {0: others, 1: c, 2: others}, CFG)


def steps_until_flagged(rank1_compute_s):
    state = StragglerState()
    for i, c in enumerate(rank1_compute_s, 1):
        feed(state, [c])
        if flagged(state, CFG):
            return i
    return None


def test_flags_a_persistent_straggler_and_swaps_it_for_a_spare():
    state = StragglerState()
    feed(state, [FAST] * 10 + [SLOW] * 6)
    decision, reason = decide_straggler(state, CFG, now=100.0, spare_compute_s=[0.11], rank_median_s=0.10)
    assert decision == Swap(1, 0.11)
    assert "rank 1 slow in 6 of its last 10 steps" in reason and "swap it for a spare" in reason


def test_a_persistent_straggler_is_flagged_after_six_slow_steps_wherever_its_slowdown_begins():
    """The window slides by one step: just over half the span (10 steps) from the first slow one,
    never a window boundary away (fixed windows took 6 to 10 slow steps, by where it began)."""
    for healthy in range(10, 20):
        assert steps_until_flagged([FAST] * healthy + [SLOW] * 20) == healthy + 6


def test_a_blip_of_up_to_half_the_span_is_never_enough():
    for blip in (1, 3, 5):
        for healthy in range(10, 16):
            assert steps_until_flagged([FAST] * healthy + [SLOW] * blip + [FAST] * 20) is None, (blip, healthy)


def test_one_noisy_step_inside_a_slowdown_does_not_start_the_count_again():
    # Fixed windows reset their streak on one window that noise pulled under the threshold.
    assert steps_until_flagged([FAST] * 10 + [SLOW, SLOW, SLOW, FAST, SLOW, SLOW, SLOW]) == 17


def test_a_rank_that_has_recovered_is_not_flagged_for_its_past():
    state = StragglerState()
    feed(state, [FAST] * 10 + [SLOW] * 6)
    assert flagged(state, CFG) == [1]
    feed(state, [FAST] * 3)  # 6 of its last 10 still slow, but only 2 of its last 5
    assert slow_steps(state, CFG)[1] == 6 and flagged(state, CFG) == []


def test_a_step_slow_for_everyone_is_slow_for_no_one():
    state = StragglerState()
    for _ in range(20):
        observe(state, {0: SLOW, 1: SLOW * 1.1, 2: SLOW}, CFG)
    assert flagged(state, CFG) == [] and max(slow_steps(state, CFG).values()) == 0


def test_nothing_is_flagged_before_a_full_span():
    state = StragglerState()
    feed(state, [SLOW] * 9)
    assert flagged(state, CFG) == []
    feed(state, [SLOW])
    assert flagged(state, CFG) == [1]


def test_a_new_group_starts_afresh():
    state = StragglerState()
    feed(state, [SLOW] * 10)
    state.clear()
    feed(state, [SLOW] * 5)
    assert flagged(state, CFG) == []


def test_cooldown_is_respected():
    state = StragglerState(last_action_t=90.0)
    feed(state, [SLOW] * 10)
    decision, reason = decide_straggler(state, CFG, now=100.0, spare_compute_s=[0.1], rank_median_s=0.1)
    assert decision == NoAction() and "cooldown" in reason
    assert isinstance(decide_straggler(state, CFG, now=121.0, spare_compute_s=[0.1], rank_median_s=0.1)[0], Swap)


def test_never_swaps_for_a_slow_spare():
    state = StragglerState()
    feed(state, [SLOW] * 10)
    decision, reason = decide_straggler(state, CFG, 100.0, spare_compute_s=[0.25], rank_median_s=0.10)
    assert decision == Report(1) and "every spare is slow itself" in reason
    decision, reason = decide_straggler(state, CFG, 100.0, spare_compute_s=[0.4, 0.12], rank_median_s=0.10)
    assert decision == Swap(1, 0.12)  # the fast one, never the slow one


def test_without_a_spare_it_reports():
    state = StragglerState()
    feed(state, [SLOW] * 10)
    decision, reason = decide_straggler(state, CFG, 100.0, spare_compute_s=[], rank_median_s=0.10)
    assert decision == Report(1) and "no spare" in reason and "min_workers" in reason


def test_without_a_spare_it_drops_when_the_world_may_shrink():
    state = StragglerState()
    feed(state, [SLOW] * 10)
    decision, reason = decide_straggler(state, CFG, 100.0, spare_compute_s=[], rank_median_s=0.10, may_shrink=True)
    assert decision == Drop(1) and "drop" in reason
    # A usable spare still comes first.
    decision, _ = decide_straggler(state, CFG, 100.0, spare_compute_s=[0.1], rank_median_s=0.10, may_shrink=True)
    assert isinstance(decision, Swap)


def test_where_no_replica_holds_its_slot_a_straggler_is_reported_not_swapped():
    """One replica of a tp layout (Shape.swappable is False): a spare could not take the rank's
    state from memory, so even a fast spare is not used."""
    state = StragglerState()
    feed(state, [SLOW] * 10)
    decision, reason = decide_straggler(state, CFG, 100.0, spare_compute_s=[0.1], rank_median_s=0.10, may_swap=False)
    assert decision == Report(1) and "no other replica holds its slot" in reason


def test_a_swap_needs_the_slot_held_elsewhere_or_offered():
    from elastic.parallel.shape import Shape
    from elastic.parallel.topology import Layout
    assert Shape().swappable(Layout(1, 1)) and Shape(sharded=True, tp=2).swappable(Layout(1, 1, 2))
    assert Shape(tp=2).swappable(Layout(1, 2, 2)) and not Shape(tp=2).swappable(Layout(1, 1, 2))
    assert not Shape(stages=2, staged=True, tp=2).swappable(Layout(2, 1, 2))
    assert Shape(stages=2, staged=True).swappable(Layout(2, 2))


def test_the_slowest_counted_rank_is_acted_on_first():
    state = StragglerState()
    for i in range(10):
        observe(state, {0: FAST, 1: SLOW, 2: SLOW if i >= 3 else FAST, 3: FAST}, CFG)
    assert flagged(state, CFG) == [1, 2]
    assert decide_straggler(state, CFG, 100.0, [0.1], 0.1)[0] == Swap(1, 0.1)
