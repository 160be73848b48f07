"""The straggler policy with a fake clock: decisions and their reasons."""
from elastic.config import StragglerConfig
from elastic.policies.straggler import Drop, NoAction, Report, StragglerState, Swap, decide_straggler, observe

CFG = StragglerConfig(enabled=True, threshold=1.5, window_steps=5, consecutive_windows=2, cooldown_s=30)
FAST = [0.10] * 5


def feed(state, windows):
    for w in windows:
        observe(state, w, CFG)


def test_flags_a_persistent_straggler_and_swaps_it_for_a_spare():
    state = StragglerState()
    feed(state, [{0: FAST, 1: [0.3] * 5, 2: FAST}] * 2)
    decision, reason = decide_straggler(state, CFG, now=100.0, spare_compute_s=[0.11], rank_median_s=0.10)
    assert decision == Swap(1, 0.11)
    assert "2 consecutive windows" in reason and "swap it for a spare" in reason


def test_one_slow_step_is_never_enough():
    state = StragglerState()
    blip = [0.1, 0.1, 0.9, 0.1, 0.1]  # one slow step: the window median ignores it
    feed(state, [{0: FAST, 1: blip, 2: FAST}] * 3)
    assert decide_straggler(state, CFG, 100.0, [0.1], 0.1)[0] == NoAction()


def test_one_slow_window_is_not_enough_and_recovery_resets_the_count():
    state = StragglerState()
    feed(state, [{0: FAST, 1: [0.3] * 5, 2: FAST}, {0: FAST, 1: FAST, 2: FAST}, {0: FAST, 1: [0.3] * 5, 2: FAST}])
    decision, reason = decide_straggler(state, CFG, 100.0, [0.1], 0.1)
    assert decision == NoAction() and "no rank slow for enough consecutive windows" in reason


def test_cooldown_is_respected():
    state = StragglerState(last_action_t=90.0)
    feed(state, [{0: FAST, 1: [0.3] * 5, 2: FAST}] * 2)
    decision, reason = decide_straggler(state, CFG, now=100.0, spare_compute_s=[0.1], rank_median_s=0.1)
    assert decision == NoAction() and "cooldown" in reason
    assert isinstance(decide_straggler(state, CFG, now=121.0, spare_compute_s=[0.1], rank_median_s=0.1)[0], Swap)


def test_never_swaps_for_a_slow_spare():
    state = StragglerState()
    feed(state, [{0: FAST, 1: [0.3] * 5, 2: FAST}] * 2)
    decision, reason = decide_straggler(state, CFG, 100.0, spare_compute_s=[0.25], rank_median_s=0.10)
    assert decision == Report(1) and "every spare is slow itself" in reason
    decision, reason = decide_straggler(state, CFG, 100.0, spare_compute_s=[0.4, 0.12], rank_median_s=0.10)
    assert decision == Swap(1, 0.12)  # the fast one, never the slow one


def test_without_a_spare_it_reports():
    state = StragglerState()
    feed(state, [{0: FAST, 1: [0.3] * 5, 2: FAST}] * 2)
    decision, reason = decide_straggler(state, CFG, 100.0, spare_compute_s=[], rank_median_s=0.10)
    assert decision == Report(1) and "no spare" in reason and "min_workers" in reason


def test_without_a_spare_it_drops_when_the_world_may_shrink():
    state = StragglerState()
    feed(state, [{0: FAST, 1: [0.3] * 5, 2: FAST}] * 2)
    decision, reason = decide_straggler(state, CFG, 100.0, spare_compute_s=[], rank_median_s=0.10, may_shrink=True)
    assert decision == Drop(1) and "drop" in reason
    # A usable spare still comes first.
    decision, _ = decide_straggler(state, CFG, 100.0, spare_compute_s=[0.1], rank_median_s=0.10, may_shrink=True)
    assert isinstance(decision, Swap)
