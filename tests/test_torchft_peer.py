"""The timeline -> figures logic of the Ray Train + torchft recovery peer (pure; no cluster, no torchft)."""
from __future__ import annotations

import pytest

from benchmarks.torchft_peer import summarise

N = 3  # replica groups
FAULT_T = 100.0


def step(t, rank, before, after, participants, committed=None, t_start=None):
    return {"event": "step", "t": t, "t_start": t - 0.01 if t_start is None else t_start, "rank": rank,
            "before": before, "step": after, "committed": after > before if committed is None else committed,
            "participants": participants}


def fault(step_no=25):
    return {"event": "fault", "t": FAULT_T, "fault_t": FAULT_T, "rank": 1, "step": step_no}


def full_steps(t, before, ranks=range(N)):
    return [step(t, r, before, before + 1, N) for r in ranks]


def timeline_with_recovery():
    """Steps 1..25 by all, fault, step 26 fails on the survivors, 26..30 degraded, the replacement
    heals to 30 in step 31, step 32 is the first one all three groups take part in."""
    ev = []
    for s in range(24):
        ev += full_steps(10 + s * 0.1, s)
    # Step 25: the faulted group finished it just before the fault, the others just after.
    ev += [step(99.99, 1, 24, 25, N), step(100.02, 0, 24, 25, N, t_start=99.95), step(100.03, 2, 24, 25, N, t_start=99.95)]
    ev.append(fault())
    ev += [step(101.0, r, 25, 25, N, committed=False) for r in (0, 2)]  # all-reduce with the dead group failed
    for i, s in enumerate(range(25, 30)):
        ev += [step(106.0 + i, r, s, s + 1, N - 1) for r in (0, 2)]
    ev.append({"event": "controller_saw_failure", "t": 103.5, "errors": {"1": "ActorDiedError: ..."}})
    ev.append({"event": "train_fn_start", "t": 112.0, "rank": 1, "replacement": True})
    ev += [step(115.0, r, 30, 31, N - 1) for r in (0, 2)] + [step(115.1, 1, 0, 31, N - 1)]  # heal step
    ev += full_steps(116.0, 31) + full_steps(116.5, 32)
    return ev


def test_recovery_figures():
    fig = summarise(timeline_with_recovery(), num_workers=N, fault_step=25)
    assert fig["recover_s"] == pytest.approx(16.0)
    assert fig["first_full_step"] == 32
    assert fig["full_group_back"] is True
    assert fig["detect_s"] == pytest.approx(3.5)
    assert fig["degraded_s"] == pytest.approx(6.0)
    # Degraded steps 26..31 (31 is the heal step: the replacement's gradient is not in it).
    assert fig["steps_during_recovery"] == 6
    assert fig["resumed_step"] == 25 and fig["lost_steps"] == 0
    assert fig["heal_step"] == 30 and fig["heal_s"] == pytest.approx(15.1)
    assert fig["replacement_start_s"] == pytest.approx(12.0)
    assert fig["controller_errors"] == {"1": "ActorDiedError: ..."}
    assert fig["last_step_by_rank"] == {"0": 33, "1": 33, "2": 33}


def test_survivors_finish_before_the_lost_group_is_back():
    ev = [e for e in timeline_with_recovery() if e["t"] < 112.0]
    ev += [step(112.0 + i * 0.1, r, s, s + 1, N - 1) for i, s in enumerate(range(30, 40)) for r in (0, 2)]
    fig = summarise(ev, num_workers=N, fault_step=25)
    assert fig["recover_s"] is None and fig["full_group_back"] is False and fig["first_full_step"] is None
    assert fig["steps_during_recovery"] == 15  # every step after the fault was degraded
    assert fig["lost_steps"] == 0
    assert fig["heal_step"] is None


def test_replacement_restarting_from_scratch_counts_lost_steps():
    """What a run showed: the survivors finish, then the replacement forms a quorum alone and trains
    from step 0. It redoes steps done before the fault; the survivors' steps are the degraded ones."""
    ev = [e for e in timeline_with_recovery() if e["t"] < 112.0]
    ev += [step(112.0 + i * 0.1, r, s, s + 1, N - 1) for i, s in enumerate(range(30, 40)) for r in (0, 2)]
    ev += [step(120.0 + s, 1, s, s + 1, 1) for s in range(40)]
    fig = summarise(ev, num_workers=N, fault_step=25)
    assert fig["resumed_step"] == 0 and fig["lost_steps"] == 25
    assert fig["recover_s"] is None and fig["full_group_back"] is False
    assert fig["steps_during_recovery"] == 15


def test_a_full_step_begun_before_the_fault_is_not_a_recovery():
    ev = timeline_with_recovery()
    fig = summarise(ev, num_workers=N, fault_step=25)
    assert fig["first_full_step"] == 32  # not step 25, logged by two groups just after the fault


def test_no_fault_no_figures():
    ev = []
    for s in range(10):
        ev += full_steps(10 + s, s)
    fig = summarise(ev, num_workers=N, fault_step=5)
    assert fig["recover_s"] is None and fig["detect_s"] is None and fig["lost_steps"] is None
    assert fig["steps_during_recovery"] is None and fig["fault_step"] is None


def test_event_order_in_the_file_does_not_matter():
    ev = timeline_with_recovery()
    assert summarise(list(reversed(ev)), num_workers=N, fault_step=25) == summarise(ev, num_workers=N, fault_step=25)
