"""The controller, stepped one iteration at a time against a fake worker group and a fake clock
(no Ray): a frozen rank, a partial stop delivery, a failure during a recovery, a failure
during a resize."""
from __future__ import annotations

import uuid

import pytest

from elastic.config import JobConfig
from elastic.controller.controller import Controller
from elastic.controller.running import POLL_INTERVAL_S
from elastic.controller.states import TERMINAL, Errored, Finished, Recovering
from elastic.policies.failure import REFUSED_GRACE_S
from tests.support.fake_group import FakeClock, FakeGroup

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _release_leases(monkeypatch):
    """A controller driven by `step_once` until some state, not to its end, never reaches the
    release in run(): its lease renewal thread would go on reading the process-wide memory
    filesystem under later tests (tests/test_parquet.py once counted its reads). Released here."""
    from elastic.checkpoint.lease import Lease
    started, original = [], Lease.start_renewing

    def start(self):
        started.append(self)
        original(self)

    monkeypatch.setattr(Lease, "start_renewing", start)
    yield
    for lease in started:
        lease.release()


def make(num_steps=40, scaling=None, failure=None, stragglers=None, checkpoint=None, loggers=None,
         storage_uri=None, **group_kw):
    """`storage_uri`: a run folder shared with another controller (a resubmitted run)."""
    clock = FakeClock()
    job = JobConfig.model_validate({
        "run": {"name": "ctl", "num_steps": num_steps},
        "scaling": {"num_workers": 3, **(scaling or {})},
        "failure": {"max_failures": 3, "hang_floor_s": 5, **(failure or {})},
        "checkpoint": {"storage_uri": storage_uri or f"memory://ctl-{uuid.uuid4().hex[:8]}",
                       **(checkpoint or {})},
        "train": {"model": "m:f", "dataset": "m:f", "loss": "m:f", "global_batch_size": 48},
        "stragglers": stragglers or {},
        "loggers": loggers or {},
    })
    group = FakeGroup(clock, **group_kw)
    return Controller(job.model_dump_json(), group=group, clock=clock, wall=clock), group, clock


def drive(c, until=lambda c: False, max_iters=20_000):
    for _ in range(max_iters):
        if isinstance(c.state, TERMINAL) or until(c):
            return
        c.step_once()
    raise AssertionError(f"still {type(c.state).__name__} at step {c.step} after {max_iters} iterations")


def kinds(c, kind):
    return [e for e in c.events.events if e["kind"] == kind]


def calls(g, name):
    return [args for n, args in g.calls if n == name]


def test_a_frozen_rank_is_found_by_silence_and_its_peers_keep_their_state():
    c, g, clock = make()
    drive(c, lambda c: c.step >= 10)
    g.freeze(1)
    frozen_at = clock()
    drive(c, lambda c: isinstance(c.state, Recovering))
    (silence,) = kinds(c, "silence_detected")
    assert silence["ranks"] == [1] and "ping_timeout_s" in silence["reason"]
    # Found by silence within ping_timeout_s and a couple of polls, long before the 5 s hang floor.
    assert clock() - frozen_at <= c.job.failure.ping_timeout_s + 0.5
    step_at_freeze = c.step
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 40
    assert ("abort_all", 1) in g.calls  # the survivors' collectives of generation 1 were aborted
    assert calls(g, "kill")[0] == 1 and 0 not in calls(g, "kill") and 2 not in calls(g, "kill")
    assert calls(g, "promote") == [(1,)]
    assert calls(g, "restore_from_peer") == [0]  # memory path
    (rec,) = kinds(c, "recovered")
    assert rec["resumed_step"] == step_at_freeze and rec["lost_steps"] == 0
    assert not kinds(c, "hang_detected")
    assert g.suspect_nodes  # the frozen rank's node gets nothing new


def test_a_slow_answer_while_the_group_progresses_is_not_a_failure():
    """A rank whose poll is late while the others keep stepping is holding nobody up: not lost."""
    c, g, clock = make(num_steps=200)
    drive(c, lambda c: c.step >= 5)
    g.members[2].frozen_at = clock()  # unanswered polls...
    g._advance_training = lambda: [setattr(m, "step", m.step + 1) for m in g.members.values()]  # ...yet progress
    for _ in range(30):
        c.step_once()
    assert not kinds(c, "silence_detected") and not kinds(c, "failure_detected")


def test_a_stop_request_that_reaches_only_some_ranks_is_not_lost():
    """Growth asks every rank to stop; one does not get the request. The others' flag rides on the
    step's all-reduce, so all stop together; the dropped plan must not leave the run waiting."""
    c, g, clock = make(num_steps=400, scaling={"num_workers": 2, "max_workers": 3, "grow_check_s": 1})
    g.stop_undelivered = {1}
    drive(c, lambda c: c.world_size == 3)
    assert kinds(c, "stop_without_plan")
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 400 and len(g.members) == 3
    assert not kinds(c, "failure_detected")


def test_a_grow_waits_for_the_persist_in_flight_while_training_goes_on():
    """A planned stop would wait for a persist with every rank idle: the grow waits instead."""
    c, g, clock = make(num_steps=4000, scaling={"num_workers": 2, "max_workers": 3, "grow_check_s": 1})
    g.persisting = True
    drive(c, lambda c: kinds(c, "grow_deferred"))
    step = c.step
    drive(c, lambda c: c.step >= step + 100)  # training goes on at 2 ranks, and no stop is requested
    assert c.world_size == 2 and not calls(g, "request_stop") and len(kinds(c, "grow_deferred")) == 1
    g.persisting = False  # the persist is over
    drive(c, lambda c: c.world_size == 3)
    assert [d["decision"] for d in kinds(c, "decision")] == ["Grow"]


def test_a_grow_waits_for_one_persist_at_most():
    """Checkpoints so frequent that the next persist is always in flight cannot put a grow off:
    once the persist it waited for has committed, the group stops and grows."""
    c, g, clock = make(num_steps=4000, scaling={"num_workers": 2, "max_workers": 3, "grow_check_s": 1})
    g.persisting = True
    drive(c, lambda c: kinds(c, "grow_deferred"))
    step = c.step
    drive(c, lambda c: c.step >= step + 100)
    assert c.world_size == 2
    g.commits = ["memory://ckpt/step_1"]  # committed, and the next persist is already running
    drive(c, lambda c: c.world_size == 3)
    assert c.world_size == 3 and kinds(c, "checkpoint_committed") and g.persisting


def rank_1_lost_at_step_10():
    """A run whose rank 1 stopped after step 10, its controller now recovering: (controller,
    group, the step reached), for a test to add a second fault to the recovery."""
    c, g, _ = make()
    drive(c, lambda c: c.step >= 10)
    step = c.step
    g.freeze(1)
    drive(c, lambda c: isinstance(c.state, Recovering))
    return c, g, step


def test_a_failure_during_a_recovery_keeps_the_survivors():
    """Rank 1's machine stops; while the new group forms, rank 2 dies. Ranks 0 and the replacement
    failed their join because of a peer: they are survivors, and rank 0's state is still used."""
    c, g, step = rank_1_lost_at_step_10()
    g.die_on_form = [2]
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 40
    errors = kinds(c, "group_error")
    assert errors and errors[0]["lost"] == [2] and errors[0]["survivors"] == [0, 1]
    detected = kinds(c, "failure_detected")
    assert [[x["rank"] for x in d["lost"]] for d in detected] == [[1], [2]]
    assert 0 not in calls(g, "kill")
    assert calls(g, "restore_from_peer") == [0]
    assert kinds(c, "restored")[-1]["step"] == step  # nothing redone


def test_when_every_member_with_state_is_lost_the_restore_comes_from_storage():
    """Rank 1 is lost; while its replacement joins, the other two die too. The members left are
    replacements that never restored: they report step 0 but hold no state, so the restore must
    come from the newest committed checkpoint, not from "rank 0's memory at step 0"."""
    c, g, _ = rank_1_lost_at_step_10()
    g.die_on_form = [0, 2]
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 40
    first, second = kinds(c, "restore_plan")
    assert first["source"] == "FromPeer" and second["source"] == "FromStorage", (first, second)
    assert "no surviving replica holds state" in second["reason"]
    assert calls(g, "restore_from_peer") == [] and calls(g, "restore")[-1] == 0


def test_a_member_that_dies_while_replacements_start_is_merged_into_the_same_recovery():
    """Rank 1 is lost; rank 2 dies while rank 1's replacement starts. Both are replaced before
    the group forms: no formation is tried with a dead member in it."""
    c, g, step = rank_1_lost_at_step_10()
    g.die_on_promote = [2]
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 40
    (merged,) = kinds(c, "faults_merged")
    assert merged["lost"] == [2]
    assert not kinds(c, "group_error")  # no formation with a dead member
    assert len(calls(g, "form")) == 2  # the first group, and the one after both replacements
    assert calls(g, "restore_from_peer") == [0] and kinds(c, "restored")[-1]["step"] == step


def test_a_failure_during_a_resize_recovers_at_the_new_size():
    c, g, clock = make(num_steps=400, scaling={"num_workers": 2, "max_workers": 3, "grow_check_s": 1})
    drive(c, lambda c: type(c.state).__name__ == "Growing")
    g.die_on_form = [1]
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 400 and len(g.members) == 3
    (detected,) = kinds(c, "failure_detected")
    assert [x["rank"] for x in detected["lost"]] == [1]
    assert calls(g, "promote")[-1] == (1,)
    assert kinds(c, "restored")[-1]["source"] == "peer rank 0"


def test_replacements_that_never_come_end_the_run_naming_the_checkpoint():
    c, g, clock = make()
    drive(c, lambda c: c.step >= 10)
    g.freeze(1)
    g.fail_promote = 1
    drive(c)
    assert not isinstance(c.state, Finished)
    assert "scaling.min_workers=3" in c.state.error and "last committed checkpoint: none" in c.state.error


def make_pipeline(stages=3, replicas=1, num_steps=200, scaling=None):
    clock = FakeClock()
    job = JobConfig.model_validate({
        "run": {"name": "ctl", "num_steps": num_steps},
        "scaling": {"num_workers": stages * replicas, **(scaling or {})},
        "failure": {"max_failures": 3, "hang_floor_s": 5},
        "checkpoint": {"storage_uri": f"memory://ctl-{uuid.uuid4().hex[:8]}"},
        "train": {"model": "m:f", "dataset": "m:f", "global_batch_size": 48, "strategy": "pipeline",
                  "pipeline": {"stages": stages, "microbatches": 4, "loss": "m:f"}},
    })
    group = FakeGroup(clock)
    return Controller(job.model_dump_json(), group=group, clock=clock, wall=clock), group, clock


def test_a_pipeline_stage_lost_beside_a_replica_copies_that_replica_per_stage():
    c, g, clock = make_pipeline(stages=2, replicas=2)
    drive(c, lambda c: c.step >= 10)
    g.freeze(1)  # stage 1 of replica 0; rank 3 holds stage 1 too
    drive(c)
    assert isinstance(c.state, Finished)
    assert ("form", (2, 2)) in g.calls  # the group re-formed with 2 stages
    assert calls(g, "restore_from_peer")[-1] == (0, (0, 3))  # stage 0 from rank 0, stage 1 from rank 3


def test_a_pipeline_without_capacity_drops_a_replica_then_stages_and_grows_back():
    c, g, clock = make_pipeline(stages=2, replicas=2, num_steps=400,
                                scaling={"min_workers": 2, "shrink_after_s": 1, "grow_check_s": 1})
    drive(c, lambda c: c.step >= 10)
    g.fail_promote = 1
    g.freeze(2)  # stage 0 of replica 1
    drive(c, lambda c: c.layout.world_size == 2)
    assert (c.layout.pp, c.layout.dp) == (2, 1)  # a whole replica dropped, both stages kept
    (resized,) = kinds(c, "resized")
    assert resized["new_layout"] == "2 stage(s) x 1 replica(s)" and resized["path"] == "memory"
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 400
    assert [(r["old_world_size"], r["new_world_size"]) for r in kinds(c, "resized")] == [(4, 2), (2, 4)]
    assert (c.layout.pp, c.layout.dp) == (2, 2)


def test_spares_that_refill_the_pool_beside_training_start_at_low_priority():
    """The first spares start with the group, at full priority; the one that replaces a spare used
    by a recovery starts while the group trains, so it asks for low priority
    (elastic/runtime/priority.py). A worker a recovery waits for never does."""
    c, g, clock = make(scaling={"num_spares": 1})
    drive(c, lambda c: c.step >= 10)
    assert g.spare_starts == [(1, False, False)]
    g.freeze(1)
    drive(c)
    assert isinstance(c.state, Finished)
    assert calls(g, "promote") == [(1,)]
    assert g.spare_starts[1:] == [(1, False, True)]
    assert all(not background for _, on_demand, background in g.spare_starts if on_demand)


def test_workers_wanted_to_grow_the_world_are_not_calibrated_first():
    """A worker started to grow the world takes a rank as soon as it is built: timing its compute
    first only delays the grow (4.4 s of a 1 GB grow here). The spares the job keeps from its start
    are calibrated before they count as ready."""
    c, g, clock = make(num_steps=400, scaling={"num_workers": 2, "max_workers": 3, "grow_check_s": 1,
                                               "num_spares": 1})
    drive(c, lambda c: type(c.state).__name__ == "Growing")
    assert g.spare_starts[0] == (1, False, False) and g.calibrated_starts[0] is True
    assert g.spare_starts[1:] and not any(g.calibrated_starts[1:])
    drive(c)
    assert isinstance(c.state, Finished) and len(g.members) == 3


def test_a_warm_worker_fills_a_missing_rank_before_it_is_kept_as_a_spare():
    """Below full size with one spare wanted: the first warm worker grows the group (every step
    below full size loses throughput; a spare only shortens a recovery that may not come), and
    the pool refills after. A second worker that would take a fake hour to warm is never waited
    for."""
    c, g, clock = make(num_steps=400, scaling={"num_workers": 2, "max_workers": 3, "grow_check_s": 1,
                                               "num_spares": 1, "wait_for_spares": True})
    drive(c, lambda c: c.step >= 5)
    assert len(g.ready_spares) == 1 and len(g.members) == 2
    g.spare_warm_s = 3600.0
    t0 = clock()
    drive(c, lambda c: type(c.state).__name__ == "Growing")
    assert clock() - t0 < 10.0
    (grow,) = [e for e in kinds(c, "decision") if e["decision"] == "Grow"]
    assert grow["ranks"] == [2]
    drive(c, lambda c: c.world_size == 3 and type(c.state).__name__ == "Running")
    assert len(g.members) == 3 and g.num_spares() == 1  # the pool's refill is on its way
    (resized,) = kinds(c, "resized")  # where every rank is after the change
    assert resized["nodes"] == {str(r): m.node_id[:12] for r, m in g.members.items()}
    assert resized["pids"] == {str(r): m.pid for r, m in g.members.items()}


def test_a_recovery_from_memory_does_not_wait_for_a_storage_that_hangs(monkeypatch):
    """An outage and a lost machine at once: the survivors' memory needs no storage, so the
    controller's look at the committed checkpoints and the new generation's fence wait at most
    3 x ping_timeout_s each; the fence lands once storage is back."""
    import threading

    from elastic.checkpoint.fencing import current_generation
    c, g, clock = make(failure={"ping_timeout_s": 0.2})
    drive(c, lambda c: c.step >= 10)
    step = c.step
    back = threading.Event()
    for op in ("list_dir", "sizes", "read_bytes", "write_bytes", "exists"):
        real = getattr(c.storage, op)
        monkeypatch.setattr(c.storage, op, lambda *a, _real=real, **kw: (back.wait(), _real(*a, **kw))[1])
    g.freeze(1)
    drive(c, lambda c: kinds(c, "recovered"))
    (unanswered,) = kinds(c, "storage_unanswered")
    assert unanswered["op"] == "list committed checkpoints"
    assert [e["generation"] for e in kinds(c, "fence_not_written")] == [2]
    assert calls(g, "restore_from_peer") == [0] and kinds(c, "restored")[-1]["step"] == step
    assert not back.is_set()  # all of it while storage still hangs
    back.set()
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 40
    assert c.fence.announce(2, wait_s=10) and current_generation(c.storage, c.root) == 2


def test_a_resubmitted_run_numbers_its_generations_on_from_the_fence_an_earlier_one_left():
    """A zombie of an earlier submission (generation 5, say) must be older than every group of
    the resubmitted run, or it would pass the fence once the new run reached generation 5."""
    from elastic.checkpoint.fencing import current_generation, may_write, write_fence
    c, g, clock = make()
    write_fence(c.storage, c.root, 5)  # what the earlier submission left
    drive(c, lambda c: c.step >= 10)
    (cont,) = kinds(c, "generations_continued")
    assert cont["after"] == 5 and kinds(c, "group_formed")[0]["generation"] == 6
    g.freeze(1)
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 40
    assert [e["generation"] for e in kinds(c, "group_formed")] == [6, 7]
    assert c.fence.announce(7, wait_s=10) and current_generation(c.storage, c.root) == 7
    allowed, why = may_write(c.storage, c.root, 5)
    assert allowed is False and "generation 7" in why


def test_a_first_run_starts_at_generation_1():
    c, g, clock = make(num_steps=5)
    drive(c)
    assert isinstance(c.state, Finished)
    assert not kinds(c, "generations_continued") and kinds(c, "group_formed")[0]["generation"] == 1


def test_a_straggler_is_swapped_six_slow_steps_after_its_slowdown_wherever_it_begins():
    """The controller folds in every step as soon as all ranks reported it (the policy's window
    slides by one step): the swap is decided once rank 1 was slow in 6 of its last 10 steps,
    whatever the step its slowdown began at; a 4-step blip on rank 2 never triggers anything."""
    for after in (20, 22, 24):
        c, g, clock = make(num_steps=60, scaling={"num_spares": 1},
                           stragglers={"enabled": True, "window_steps": 5, "consecutive_windows": 2,
                                       "cooldown_s": 0},
                           report_compute=True)
        drive(c, lambda c: c.step >= 5)
        g.slow_down(2, 10, 4.0, steps=4)  # steps 11-14: most of the window ending at 15
        g.slow_down(1, after, 4.0)
        drive(c, lambda c: kinds(c, "decision"))
        (decision,) = kinds(c, "decision")
        assert decision["decision"] == "Swap" and decision["ranks"] == [1], decision
        assert "rank 1 slow in 6 of its last 10 steps" in decision["reason"]
        assert decision["step"] == after + 6  # decided on the 6th slow step, not a window later
        windows = kinds(c, "slow_window")  # logged every 5 steps; rank 2's blip is logged, not acted on
        assert [(w["step"], w["slow_steps"]) for w in windows if w["step"] < after] == [(15, {"2": 4})], windows
        assert all(list(w["slow_steps"]) == ["1"] for w in windows if w["step"] > after), windows
        drive(c)
        assert isinstance(c.state, Finished) and c.step == 60
        assert [e["rank"] for e in kinds(c, "swapped")] == [1]


def test_a_resize_counts_the_steps_a_rank_reported_with_its_fault_as_reached():
    # Polls lag training by up to a poll interval; a chaos fault is reported by the rank itself,
    # at the step it reached, just before the fault. The shrink's lost steps start from there.
    c, g, clock = make(num_steps=400, scaling={"min_workers": 2, "shrink_after_s": 1, "grow_check_s": 1000})
    drive(c, lambda c: c.step >= 10)
    g.members[1].step += 3  # rank 1 trained on since the last poll answer anyone gave
    reached = g.members[1].step
    c.report_fault({"action": "kill_node", "rank": 1, "at_step": reached}, 1, reached, clock())
    g.kill_process(1)
    g.fail_promote = 1
    drive(c, lambda c: kinds(c, "resize_completed"))
    (done,) = kinds(c, "resize_completed")
    assert (done["old_world_size"], done["new_world_size"]) == (3, 2)
    assert done["reached_step"] == reached and done["lost_steps"] == reached - done["resumed_step"] > 0


def test_a_rank_slow_to_answer_inside_a_long_stall_is_kept_and_a_stopped_one_is_found():
    # 2.5 s steps (a large model): the silence bound is 2 x 2.5 = 5 s. A checkpoint stalls the
    # group for 12 s and keeps rank 2 from answering for 3.5 s of it: not lost. Later rank 1
    # stops for good: found once its silence passes the bound, within a step and a poll of it.
    c, g, clock = make(num_steps=30, step_s=2.5)
    drive(c, lambda c: c.step >= 8)
    g.stalled_until = clock() + 12.0
    drive(c, lambda c: clock() >= g.stalled_until - 6.0)
    g.freeze(2)
    drive(c, lambda c: clock() >= g.stalled_until - 2.5)
    g.thaw(2)
    drive(c, lambda c: c.step >= 15)
    assert not kinds(c, "silence_detected") and not kinds(c, "failure_detected")
    g.freeze(1)
    frozen_at = clock()
    drive(c, lambda c: isinstance(c.state, Recovering))
    (silence,) = kinds(c, "silence_detected")
    assert silence["ranks"] == [1] and silence["unanswered_s"]["1"] >= 5.0
    assert clock() - frozen_at <= 5.0 + 2.5 + 0.5
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 30


def test_a_rank_whose_python_is_held_is_kept_by_its_heartbeat_and_only_by_it():
    # 2.5 s steps: the poll-only bound is 5 s. Rank 1's Python is held for 12 s (a C call keeping
    # the GIL): its polls go unanswered and the group waits on it, but its node's heartbeat says
    # the process sleeps. Kept, named once as excused, and the run goes on without a recovery.
    for heartbeats in (True, False):
        c, g, clock = make(num_steps=30, step_s=2.5, heartbeats=heartbeats)
        drive(c, lambda c: c.step >= 8)
        g.freeze(1, how="held")
        held_until = clock() + 12.0
        drive(c, lambda c: clock() >= held_until or isinstance(c.state, Recovering))
        if heartbeats:
            assert not kinds(c, "silence_detected") and not isinstance(c.state, Recovering)
            (excused,) = kinds(c, "silence_excused")
            assert excused["rank"] == 1 and excused["state"] == "S" and excused["unanswered_s"] >= 5.0
            g.thaw(1)
            drive(c)
            assert isinstance(c.state, Finished) and c.step == 30 and not kinds(c, "failure_detected")
            # Held for good, it is the hang bound's (25 s: 10 x 2.5 s steps) to find, and only it is named.
            c, g, clock = make(num_steps=30, step_s=2.5, heartbeats=True)
            drive(c, lambda c: c.step >= 8)
            g.freeze(1, how="held")
            drive(c, lambda c: isinstance(c.state, Recovering))
            (hang,) = kinds(c, "hang_detected")
            assert hang["ranks"] == [1] and hang["heartbeat"]["1"]["state"] == "S" and not kinds(c, "silence_detected")
            assert sorted(c.house.beats) == [0, 1, 2]  # what run_finished reports as heartbeat_ranks
        else:  # the same hold without a heartbeat is taken for a stopped machine
            (silence,) = kinds(c, "silence_detected")
            assert silence["ranks"] == [1] and silence["heartbeat"] == {"1": None}


def test_a_heartbeat_finds_a_stopped_machine_or_process_after_ping_timeout_not_two_steps():
    # 2.5 s steps: polls alone would wait 5 s. With the node's heartbeat silent (a stopped machine)
    # or saying the process is stopped (SIGSTOP), ping_timeout_s (1 s) and a poll suffice.
    for how, state in (("machine", "R"), ("process", "T")):
        c, g, clock = make(num_steps=30, step_s=2.5, heartbeats=True)
        drive(c, lambda c: c.step >= 8)
        g.freeze(1, how=how)
        frozen_at = clock()
        drive(c, lambda c: isinstance(c.state, Recovering))
        (silence,) = kinds(c, "silence_detected")
        assert silence["ranks"] == [1] and silence["heartbeat"]["1"]["state"] == state
        assert clock() - frozen_at <= c.job.failure.ping_timeout_s + 0.5
        drive(c)
        assert isinstance(c.state, Finished) and c.step == 30


def test_a_dead_machine_whose_peers_collectives_failed_is_lost_before_ping_timeout():
    # Its peers' sockets to it closed (gloo fails at once); it and its node's heartbeat are silent.
    # Lost after two heartbeat rounds of silence, not after ping_timeout_s (here 5 s, to tell the
    # two apart); without heartbeats, the old bound still decides.
    for heartbeats in (True, False):
        c, g, clock = make(num_steps=30, failure={"ping_timeout_s": 5.0}, heartbeats=heartbeats)
        drive(c, lambda c: c.step >= 8)
        g.kill_node(1)
        killed_at = clock()
        drive(c, lambda c: isinstance(c.state, Recovering))
        waited = clock() - killed_at
        drive(c)
        assert isinstance(c.state, Finished) and c.step == 30
        (detected,) = kinds(c, "failure_detected")
        (lost,) = detected["lost"]
        assert lost["rank"] == 1 and lost["cause"] == "unresponsive"
        if heartbeats:
            assert "peers' collectives failed" in lost["detail"], lost
            assert 0.4 < waited <= 1.0, waited
        else:
            assert waited > 5.0, waited


def test_a_node_that_refuses_the_heartbeat_is_lost_after_one_round_whatever_its_peers_do():
    # Its processes died with the machine up (a killed node, a dead agent): its kernel refuses the
    # heartbeat's pings. With 2.5 s steps and ping_timeout_s 5 s, silence would take 5 s, and while
    # its peers compute none of their collectives fails; the refusal decides once the rank's own
    # poll has waited a heartbeat round. With its peers' collectives failed, the same.
    for peers_failed in (False, True):
        c, g, clock = make(num_steps=30, step_s=2.5, failure={"ping_timeout_s": 5.0}, heartbeats=True)
        drive(c, lambda c: c.step >= 8)
        if peers_failed:
            g.kill_node(1, refuses=True)
        else:
            g.freeze(1, how="refused")
        at = clock()
        drive(c, lambda c: isinstance(c.state, Recovering))
        waited = clock() - at
        assert REFUSED_GRACE_S < waited <= REFUSED_GRACE_S + 2 * POLL_INTERVAL_S, waited
        drive(c)
        assert isinstance(c.state, Finished) and c.step == 30
        (detected,) = kinds(c, "failure_detected")
        (lost,) = detected["lost"]
        assert lost["rank"] == 1 and lost["cause"] == "unresponsive" and "refused" in lost["detail"], lost
        if not peers_failed:
            (silence,) = kinds(c, "silence_detected")
            assert silence["ranks"] == [1] and silence["heartbeat"]["1"]["refused"] is True, silence


def test_a_survivor_whose_run_does_not_return_after_the_abort_is_replaced_and_the_event_says_so():
    # Rank 2's machine stops; rank 1's Python is held (its heartbeat says it sleeps, so it is not
    # lost), and it does not act on the abort: its run() does not return within the grace, so it
    # cannot safely join the new group and is replaced. The event names which step it missed.
    c, g, clock = make(num_steps=30, step_s=2.5, heartbeats=True)
    drive(c, lambda c: c.step >= 8)
    g.freeze(1, how="held")
    g.freeze(2, how="machine")
    drive(c, lambda c: bool(kinds(c, "worker_replaced")) or isinstance(c.state, Finished))
    (silence,) = kinds(c, "silence_detected")
    assert silence["ranks"] == [2]
    (replaced,) = kinds(c, "worker_replaced")
    grace = 3 * c.job.failure.ping_timeout_s
    assert replaced["rank"] == 1
    assert replaced["reason"] == f"its run() did not return after the abort within {grace:g} s: unresponsive"


def test_a_survivor_slow_to_return_after_the_abort_it_answered_gets_one_more_grace_then_is_replaced():
    # Rank 2's machine stops. Rank 1 answers the abort, but its run() returns only after a second
    # grace (a loaded machine): it is kept, and the event says where it was. Rank 0's would need
    # a third: it is replaced, and the reason names where its run() was stuck.
    c, g, clock = make(num_steps=30, step_s=2.5, heartbeats=True)
    drive(c, lambda c: c.step >= 8)
    g.late_returns = {1: 2, 0: 3}
    g.freeze(2, how="machine")
    drive(c, lambda c: bool(kinds(c, "worker_replaced")) or isinstance(c.state, Finished))
    (slow,) = kinds(c, "slow_return")
    grace = 3 * c.job.failure.ping_timeout_s
    assert slow["ranks"] == [0, 1] and slow["returned"] == [1] and slow["waited_s"] >= grace
    assert slow["where"] == {"0": "step.py:1 in all_reduce", "1": "step.py:1 in all_reduce"}
    (replaced,) = kinds(c, "worker_replaced")
    assert replaced["rank"] == 0
    assert replaced["reason"] == (f"its run() did not return after the abort within {2 * grace:g} s "
                                  "(in step.py:1 in all_reduce): unresponsive")
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 30


def test_a_survivor_that_answers_the_recovery_s_polls_late_while_its_node_says_it_runs_is_kept():
    # Rank 2's machine stops. Rank 1 is busy (a loaded machine): it answers none of the recovery's
    # first two polls within ping_timeout_s, while its node's heartbeat says its process runs.
    # It is polled again, answers the third, and keeps its place and its state: no worker started
    # for it, and the restore takes the survivors' memory.
    c, g, clock = make(num_steps=30, step_s=2.5, heartbeats=True)
    drive(c, lambda c: c.step >= 8)
    g.freeze(2, how="machine")
    g.late_polls = {1: 2}
    drive(c, lambda c: bool(kinds(c, "restore_plan")) or isinstance(c.state, Finished))
    assert not kinds(c, "worker_replaced") and ("kill", 1) not in g.calls
    (slow,) = kinds(c, "slow_poll")
    assert slow["ranks"] == [1] and slow["waited_s"] == 3 * c.job.failure.ping_timeout_s, slow
    (plan,) = kinds(c, "restore_plan")
    assert plan["source"] == "FromPeer", plan
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 30


def test_a_survivor_silent_through_every_recovery_poll_is_replaced_and_the_event_says_so():
    # The same, but rank 1 answers none of the polls within FORMATION_SILENCE x ping_timeout_s
    # (5 s): it is replaced, and the event says how long the polls waited and what its heartbeat
    # said. Without a heartbeat that says it runs, one poll is all it gets (the rule before).
    for heartbeats, waited in ((True, 5), (False, 1)):
        c, g, clock = make(num_steps=30, step_s=2.5, heartbeats=heartbeats)
        drive(c, lambda c: c.step >= 8)
        g.freeze(2, how="machine")
        g.late_polls = {1: 100}
        drive(c, lambda c: bool(kinds(c, "worker_replaced")) or isinstance(c.state, Finished))
        (replaced,) = kinds(c, "worker_replaced")
        assert replaced["rank"] == 1, replaced
        said = "age 0.00 s, state R" if heartbeats else "none"
        assert replaced["reason"] == (f"it answered no poll within {waited:g} s during the recovery "
                                      f"(its node's heartbeat: {said}): unresponsive"), replaced


def test_a_final_checkpoint_that_did_not_commit_is_saved_again_until_it_commits():
    # Storage was out at the end for longer than the persist's retries: the ranks still hold the
    # final state, so they save it again; the second try commits.
    c, g, clock = make(num_steps=30, final_commits=False, commit_on_save_again=2)
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 30
    assert [e["attempt"] for e in kinds(c, "final_checkpoint_retry")] == [1, 2]
    (done,) = kinds(c, "final_checkpoint_committed")
    assert done["attempts"] == 2 and done["step"] == 30 and c.last_committed.endswith("step_000000030")
    assert not kinds(c, "final_checkpoint_missing")


def test_a_final_checkpoint_that_never_commits_fails_the_run_naming_the_newest_committed():
    c, g, clock = make(num_steps=30, checkpoint={"final_wait_s": 100}, final_commits=False, commit_on_save_again=0)
    g.commits.append("memory://fake/step_000000020")  # an earlier checkpoint that did commit
    drive(c)
    assert isinstance(c.state, Errored)
    assert "final checkpoint did not commit" in c.state.error and "step_000000020" in c.state.error
    assert "checkpoint.final_wait_s" in c.state.error
    (missing,) = kinds(c, "final_checkpoint_missing")
    assert missing["newest"].endswith("step_000000020")
    assert calls(g, "save_again") == [1, 2, 3, 4]  # 30 s each, the 4th cut at 100 s


def test_final_wait_s_0_fails_the_run_at_once_without_saving_again():
    c, g, clock = make(num_steps=30, checkpoint={"final_wait_s": 0}, final_commits=False)
    drive(c)
    assert isinstance(c.state, Errored) and not calls(g, "save_again")
    assert [e["attempts"] for e in kinds(c, "final_checkpoint_missing")] == [0]


def test_a_committed_final_checkpoint_is_not_saved_again():
    c, g, clock = make(num_steps=30)
    drive(c)
    assert isinstance(c.state, Finished) and not calls(g, "save_again")
    assert not kinds(c, "final_checkpoint_retry")


def test_a_restore_from_storage_waits_out_a_storage_outage(monkeypatch):
    from elastic.controller import restoring as ctl  # where the restore reads the listing
    from elastic.storage import StorageError
    real, failures = ctl.committed_checkpoints, [2]

    def flaky(*a, **kw):
        if failures[0]:
            failures[0] -= 1
            raise StorageError("list s3://b/run/checkpoints failed: ConnectionClosedError")
        return real(*a, **kw)

    monkeypatch.setattr(ctl, "committed_checkpoints", flaky)
    c, g, clock = make(num_steps=20)
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 20
    waits = kinds(c, "storage_unanswered")
    assert [w["op"] for w in waits] == ["list committed checkpoints to restore from"] * 2
    assert "ConnectionClosedError" in waits[0]["error"]


def test_a_restore_from_storage_that_never_answers_fails_the_run_saying_so(monkeypatch):
    from elastic.controller import restoring as ctl  # where the restore reads the listing
    from elastic.storage import StorageError

    def down(*a, **kw):
        raise StorageError("list s3://b/run/checkpoints failed: ConnectionClosedError")

    monkeypatch.setattr(ctl, "committed_checkpoints", down)
    c, g, clock = make(num_steps=20, checkpoint={"restore_wait_s": 30})
    drive(c)
    assert isinstance(c.state, Errored)
    assert "must be restored from storage, which did not answer for 30 s" in c.state.error
    assert "checkpoint.restore_wait_s" in c.state.error and "ConnectionClosedError" in c.state.error
    # Unanswered at 0, 1, 3, 7 and 15 s (the backoff doubles up to 15 s); given up at 30 s.
    assert [w["waited_s"] for w in kinds(c, "storage_unanswered")] == [0.0, 1.0, 3.0, 7.0, 15.0]


def _committed_at(monkeypatch, step: int) -> str:
    """Storage lists one committed checkpoint, of `step` (the fake group 'loads' it by its name)."""
    from elastic.checkpoint.layout import CommittedCheckpoint, Manifest
    from elastic.controller import restoring as ctl  # where the restore reads the listing
    uri = f"memory://fake/run/checkpoints/step_{step:09d}"
    found = [CommittedCheckpoint(uri, Manifest(step, step * 48, 3, "ddp", {}, 0.0))]
    monkeypatch.setattr(ctl, "committed_checkpoints", lambda *a, **kw: list(found))
    return uri


def test_checkpoints_that_do_not_load_while_storage_is_out_are_waited_for_not_replaced_by_step_0(monkeypatch):
    """The listing answered, then storage went out: every rank's load failed. The workers used to
    fall back to a fresh init, and the run silently started over from step 0."""
    uri = _committed_at(monkeypatch, 20)
    c, g, clock = make(num_steps=30, load_failures=["ClientError: 503 Slow Down (request 1)",
                                                    "ConnectionClosedError: endpoint closed (request 2)"])
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 30
    waits = kinds(c, "storage_unanswered")
    assert [w["op"] for w in waits] == ["load a committed checkpoint"] * 2
    assert "503" in waits[0]["error"]
    assert [e["step"] for e in kinds(c, "restored")] == [20]  # resumed there, never from step 0
    assert kinds(c, "restored")[0]["uri"] == uri
    assert [why for _, why in [(e["uri"], e["reason"]) for e in kinds(c, "checkpoint_skipped")]] == [
        "load failed: ClientError: 503 Slow Down (request 1)",
        "load failed: ConnectionClosedError: endpoint closed (request 2)"]


def test_checkpoints_that_fail_the_same_way_twice_end_the_run_at_once(monkeypatch):
    """Storage answers, and the loads fail identically (a model changed under the same run name):
    no wait mends that, and starting over from step 0 would hide it."""
    _committed_at(monkeypatch, 20)
    why = "RuntimeError: size mismatch for net.0.weight: copying a param with shape [64, 256]"
    c, g, clock = make(num_steps=30, load_failures=[why] * 10)
    t0 = clock()
    drive(c)
    assert isinstance(c.state, Errored) and not kinds(c, "restored")
    assert len(calls(g, "restore")) == 2 and clock() - t0 < 10
    assert "none of the 1 committed checkpoints loaded (the same failures twice" in c.state.error
    assert "step_000000020" in c.state.error and "size mismatch" in c.state.error
    assert "new run.name" in c.state.error


def test_checkpoints_that_keep_failing_to_load_end_the_run_after_restore_wait_s(monkeypatch):
    _committed_at(monkeypatch, 20)
    c, g, clock = make(num_steps=30, checkpoint={"restore_wait_s": 30},
                       load_failures=[f"ConnectionClosedError (request {i})" for i in range(100)])
    drive(c)
    assert isinstance(c.state, Errored) and not kinds(c, "restored")
    assert "storage did not serve them for 30 s (checkpoint.restore_wait_s=30)" in c.state.error
    # Tried at 0, 1, 3, 7 and 15 s (the backoff doubles up to 15 s), and once more at 30 s.
    assert [w["waited_s"] for w in kinds(c, "storage_unanswered")] == [0.0, 1.0, 3.0, 7.0, 15.0]


def test_a_checkpoint_saved_again_after_a_storage_failure_is_in_the_event_log():
    c, g, clock = make(num_steps=30)
    g.retried = [7]
    drive(c)
    assert isinstance(c.state, Finished)
    (ev,) = kinds(c, "checkpoint_retry")
    assert ev["step"] == 7 and "failed on storage" in ev["reason"]


def test_a_last_commit_that_waits_for_storage_after_the_other_ranks_returned_is_no_hang():
    # DDP's rank 0 commits the last checkpoint alone, after the other ranks' part of the persist
    # ended and their run() returned: its 20 s wait for storage is not a hang (5 s bound here).
    c, g, clock = make(num_steps=30, final_persist_s={0: 20.0})
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 30
    assert not kinds(c, "hang_detected") and not kinds(c, "failure_detected")
    assert kinds(c, "storage_wait")


def test_ranks_held_in_storage_wait_past_the_bound_end_the_run_naming_storage_and_the_bound():
    """Every rank waiting for a persist counted as progress forever: a storage call that never
    returns (and that the ranks could not give up themselves) hung the run with no verdict."""
    c, g, clock = make(num_steps=30, checkpoint={"persist_timeout_s": 10},
                       final_persist_s={r: 1e9 for r in range(3)})
    drive(c)
    assert isinstance(c.state, Errored)
    (ev,) = kinds(c, "storage_timeout")
    bound = 10 + 3 * c.job.failure.ping_timeout_s
    assert ev["bound_s"] == bound and ev["waited_s"] >= bound and ev["ranks"] == [0, 1, 2] and ev["step"] == 30
    assert "checkpoint.persist_timeout_s=10" in c.state.error and c.storage.uri in c.state.error
    assert kinds(c, "storage_wait") and not kinds(c, "hang_detected")  # a storage verdict, not a hang


def test_a_second_controller_on_a_held_run_is_refused_and_starts_and_writes_nothing():
    """Two drivers on one run (a KubeRay retry while the first head is cut off, or the same job
    submitted twice): the second is refused at once, naming the holder; it starts no worker and
    writes no event, and the first trains on to the end."""
    from elastic.observability.events import read_events
    c, g, clock = make()
    drive(c, lambda c: c.step >= 5)
    second_group = FakeGroup(clock)
    second = Controller(c.job.model_dump_json(), group=second_group, clock=clock, wall=clock)
    out = second.run()
    assert out["status"] == "error" and "is in use" in out["error"] and c.lease.holder in out["error"]
    assert second_group.calls == [] and out["events"] == []
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 40
    c.events.flush(timeout_s=5)
    assert [e["kind"] for e in read_events(c.storage, c.run_dir)].count("run_started") == 1


def test_a_controller_whose_lease_was_taken_over_stops_and_its_groups_are_fenced_out():
    c, g, clock = make()
    drive(c, lambda c: c.step >= 5)
    first_generation = c.generation
    clock.advance(c.job.run.lease_ttl_s + 1)  # its renewals stopped (a partitioned head): the lease expires
    newer = Controller(c.job.model_dump_json(), group=FakeGroup(clock), clock=clock, wall=clock)
    drive(newer, lambda n: n.step >= 1)
    assert newer.generation > first_generation  # the newer driver's groups are above the old one's
    c.lease.renew_once()  # the old driver's next renewal finds the newer lease
    drive(c)
    assert isinstance(c.state, Errored) and "no longer owns the run" in c.state.error
    assert newer.lease.holder in c.state.error


def test_a_fault_from_outside_has_an_unknown_detection_time_not_zero():
    """No injected fault (a real crash): the controller knows no fault time, so `recovered` says
    its detect_s is unknown and measures the recovery from the detection."""
    c, g, clock = make()
    drive(c, lambda c: c.step >= 10)
    g.kill_process(1)
    drive(c)
    assert isinstance(c.state, Finished)
    (rec,) = kinds(c, "recovered")
    assert rec["detect_s"] is None and rec["measured_from"] == "detection" and rec["recover_s"] > 0


def test_a_bad_step_stops_the_run_naming_that_step_not_as_a_crash_of_user_code():
    """train.bad_step=raise: every rank agrees on the bad step; the run's error names that step
    (not the rank's own counter, one behind) and does not call it a crash of the training code."""
    from elastic.protocol import RunResult, RunStatus
    c, g, clock = make()
    drive(c, lambda c: c.step >= 10)
    bad = max(m.step for m in g.members.values()) + 1
    for m in g.members.values():
        m.running = False
        m.run_out = RunResult(RunStatus.BAD_STEP, bad, m.generation,
                              error=f"step {bad}: non-finite loss on some rank (train.bad_step=raise)")
    drive(c)
    assert isinstance(c.state, Errored) and c.state.error.startswith(f"step {bad}: non-finite loss on some rank")
    assert "training code raised" not in c.state.error and not kinds(c, "failure_detected")
    (decision,) = kinds(c, "decision")
    assert decision["decision"] == "Raise" and decision["step"] == bad


def test_a_resumed_run_skips_the_batches_an_earlier_rollback_skipped():
    """A rollback's skipped batches are in the checkpoints written after it: a run resubmitted
    from such a checkpoint (the controller's memory of them is gone) skips them too."""
    import time

    from elastic.checkpoint.layout import Manifest, commit, step_dir
    c, g, clock = make(num_steps=30)
    folder = step_dir(c.root, 20)
    commit(c.storage, folder, Manifest(20, 20 * 48, 3, "ddp", {}, time.time(), skip_steps=[13, 14]))
    drive(c, lambda c: c.step >= 21)
    assert ("restore", 1) in g.calls and c.run_log.skip_steps == {13, 14}
    drive(c)
    assert isinstance(c.state, Finished)


def test_a_manifest_without_skip_steps_still_reads():
    from elastic.checkpoint.layout import Manifest
    m = Manifest.from_json(b'{"step": 5, "cursor": 1, "world_size": 2, "strategy": "ddp", "files": {}, '
                           b'"created_at": 0.0}')
    assert m.skip_steps == [] and Manifest.from_json(Manifest(5, 1, 2, "ddp", {}, 0.0, skip_steps=[3]).to_json()
                                                     ).skip_steps == [3]


def test_a_lapsed_lease_is_said_and_the_run_trains_on_until_a_renewal_lands():
    """No renewal landed for run.lease_ttl_s (storage out): said once, with why; the run trains
    on (the fence, not the lease, keeps another driver's run apart), and the renewal is said too."""
    c, g, clock = make()
    drive(c, lambda c: c.step >= 5)
    c.lease.lapsed_s = lambda: 31.0
    c.lease.last_error = "StorageTimeout: renewal not answered within 7.5 s"
    drive(c, lambda c: c.step >= 15)
    c.lease.lapsed_s = lambda: None
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 40
    (lapsed,) = kinds(c, "lease_lapsed")
    assert lapsed["since_s"] == 31.0 and "StorageTimeout" in lapsed["error"]
    assert len(kinds(c, "lease_renewed")) == 1


def test_the_controller_starts_workers_without_importing_torch():
    """The controller never trains: importing torch cost every run's start about 4 s before its
    first event. Its actor class is a torch-free shim (elastic/runtime/actor.py) that forwards
    every remote method of the worker, checked here against the Worker class."""
    import subprocess
    import sys
    code = ("import sys, elastic.controller.controller, elastic.group.worker_group; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout[-500:], out.stderr[-2000:])

    from elastic.runtime.actor import REMOTE_METHODS, WorkerActor
    from elastic.runtime.worker import Worker
    public = {n for n in dir(Worker) if not n.startswith("_") and callable(getattr(Worker, n))}
    local_only = {"set_progress", "forget_old_meshes"}  # called by the worker itself, never through a handle
    assert set(REMOTE_METHODS) == public - local_only
    assert all(callable(getattr(WorkerActor, n)) for n in REMOTE_METHODS)
