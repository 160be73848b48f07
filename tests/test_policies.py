"""The failure policy and hang detection, with a fake clock: decisions and their reasons."""
from elastic.config import FailureConfig
from elastic.policies.failure import (
    REFUSED_GRACE_S, FailureObservation, LostRank, Raise, Restart, decide_after_peers_failed, decide_failure,
    decide_refused, decide_silence, detect_hang, excused_by_heartbeat, formation_silent, hang_bound_s, silence_bound_s)
from elastic.policies.restore import FromPeer, FromStorage, choose_restore
from elastic.protocol import LostCause
from elastic.runtime.heartbeat import Beat

CFG = FailureConfig(max_failures=2, hang_factor=10, hang_floor_s=5)


def obs(*lost, failures=0, user_error=None):
    return FailureObservation(tuple(lost), world_size=3, failures_so_far=failures, user_error=user_error,
                              last_checkpoint="s3://b/run/checkpoints/step_000000020")


def test_lost_rank_within_budget_restarts_and_says_why():
    decision, reason = decide_failure(obs(LostRank(1, "node_died")), CFG, now=100.0)
    assert decision == Restart((1,))
    assert "rank 1 node_died" in reason and "recovery 1/2" in reason


def test_budget_exhausted_raises_naming_failure_and_checkpoint():
    decision, reason = decide_failure(obs(LostRank(2, "process_died"), failures=2), CFG, now=0.0)
    assert isinstance(decision, Raise)
    assert "rank 2 process_died" in decision.error
    assert "max_failures=2" in decision.error
    assert "step_000000020" in decision.error
    assert "limit 2" in reason


def test_user_code_error_is_not_retried():
    decision, reason = decide_failure(obs(user_error="ZeroDivisionError: boom"), CFG, now=0.0)
    assert isinstance(decision, Raise) and "ZeroDivisionError" in decision.error
    assert "retry would fail again" in reason


def test_collective_error_without_a_lost_rank_reforms_the_same_group():
    decision, reason = decide_failure(obs(), CFG, now=0.0)
    assert decision == Restart(())
    assert "none lost" in reason


def test_hang_bound_is_factor_times_median_with_a_floor():
    assert hang_bound_s([], CFG) == 5
    assert hang_bound_s([0.1, 0.2, 0.1], CFG) == 5  # 10 x 0.1 = 1 s < floor
    assert hang_bound_s([1.0, 2.0, 30.0], CFG) == 20  # median, not mean: one slow step does not stretch it


def test_detect_hang_with_fake_clock():
    times = [1.0] * 10
    hung, reason = detect_hang(last_progress_at=100.0, step_times_s=times, cfg=CFG, now=109.0)
    assert not hung and "<= bound 10.0s" in reason
    hung, reason = detect_hang(last_progress_at=100.0, step_times_s=times, cfg=CFG, now=110.5)
    assert hung and "no step completed for 10.5s" in reason


def test_restore_prefers_the_survivor_with_the_newest_step():
    # rank 2 finished the step whose all-reduce completed: its state includes every gradient
    source, reason = choose_restore({0: 25, 2: 26}, CFG)
    assert source == FromPeer(2, 26) and "no storage read" in reason


def test_restore_from_storage_without_survivors_or_when_asked():
    assert choose_restore({}, CFG)[0] == FromStorage()
    off = CFG.model_copy(update={"peer_restore": False})
    source, reason = choose_restore({0: 25}, off)
    assert source == FromStorage() and "peer_restore is off" in reason


def test_sharded_state_restores_from_storage_after_a_loss():
    # An FSDP survivor holds only its own shards: the lost rank's are gone with it.
    source, reason = choose_restore({0: 25, 2: 25}, CFG, sharded=True)
    assert source == FromStorage() and "sharded" in reason


def test_silence_needs_the_group_idle_past_ping_timeout_or_two_median_steps_whichever_is_longer():
    cfg = FailureConfig(ping_timeout_s=1.0, silence_factor=2.0)
    assert silence_bound_s([], cfg) == 1.0  # no step yet: the ping timeout alone
    assert silence_bound_s([0.02, 0.03, 0.02], cfg) == 1.0  # small model: 2 steps are far below 1 s
    assert silence_bound_s([2.4, 2.6, 2.5], cfg) == 5.0  # a 100 M-parameter step here: 2.5 s


def test_a_late_answer_inside_a_long_step_is_not_silence_but_a_stopped_group_is():
    cfg = FailureConfig(ping_timeout_s=1.0, silence_factor=2.0)
    steps = [2.5] * 10
    # Seen with 100 M parameters and S3: rank 1 answered a poll late at the first checkpoint (its
    # writes into s3fs buffers hold the GIL), 3.9 s after the last step: not a stopped machine.
    assert decide_silence({1: "unresponsive"}, {1: 3.9}, 3.9, cfg, steps) is None
    ranks, why = decide_silence({1: "unresponsive"}, {1: 5.4}, 5.5, cfg, steps)
    assert ranks == (1,) and "5.4s or more" in why and "5.5s" in why and "silence_factor=2" in why
    assert decide_silence({1: "unresponsive"}, {1: 1.1}, 1.2, cfg, [0.02] * 10)[0] == (1,)  # small steps: as fast as before
    assert decide_silence({1: "dead"}, {}, 9.0, cfg, steps) is None  # Ray's own verdicts are handled elsewhere


def test_a_rank_silent_for_less_than_the_bound_inside_a_longer_stall_is_not_lost():
    # Seen at 1.08 GB on starved one-CPU nodes: a checkpoint stalled the group for 9-12 s (more
    # than 2 x the median step) and a healthy rank answered no poll for a while inside it. Its
    # silence, not only the group's, must outlast the bound.
    cfg = FailureConfig(ping_timeout_s=1.0, silence_factor=2.0)
    steps = [2.5] * 10  # bound 5 s
    assert decide_silence({1: "unresponsive"}, {1: 4.0}, 11.0, cfg, steps) is None
    assert decide_silence({1: "unresponsive", 2: "unresponsive"}, {1: 4.0, 2: 6.0}, 11.0, cfg, steps)[0] == (2,)
    assert decide_silence({1: "unresponsive"}, {1: 6.0}, 4.0, cfg, steps) is None  # the group still progressed


def test_a_heartbeat_keeps_a_rank_whose_python_is_held_and_finds_a_stopped_one_in_ping_timeout():
    cfg = FailureConfig(ping_timeout_s=1.0, silence_factor=2.0)
    steps = [2.5] * 10  # poll-only bound: 5 s
    # Its Python is held (a C call keeping the GIL) for 30 s; its node says the process sleeps: kept,
    # however long, and named as excused once the poll-only rule would have taken it.
    held = {1: Beat(0.1, "S")}
    assert decide_silence({1: "unresponsive"}, {1: 30.0}, 30.0, cfg, steps, held) is None
    assert excused_by_heartbeat({1: "unresponsive"}, {1: 30.0}, 30.0, cfg, steps, held) == {1: "S"}
    assert excused_by_heartbeat({1: "unresponsive"}, {1: 4.0}, 30.0, cfg, steps, held) == {}  # not past the bound yet
    # The node answers, the process is stopped (SIGSTOP): lost after ping_timeout_s, not 2 steps.
    ranks, why = decide_silence({1: "unresponsive"}, {1: 1.2}, 1.3, cfg, steps, {1: Beat(0.0, "T")})
    assert ranks == (1,) and "stopped" in why and "state T" in why
    assert decide_silence({1: "unresponsive"}, {1: 0.9}, 1.3, cfg, steps, {1: Beat(0.0, "T")}) is None
    # The node is silent too: a stopped machine, found after ping_timeout_s.
    ranks, why = decide_silence({1: "unresponsive"}, {1: 1.2}, 1.3, cfg, steps, {1: Beat(1.1, "R")})
    assert ranks == (1,) and "heartbeat" in why and "ping_timeout_s=1" in why
    assert decide_silence({1: "unresponsive"}, {1: 1.2}, 1.3, cfg, steps, {1: Beat(0.9, "R")}) is None
    # ...but never while the group still makes progress: it is holding nobody up.
    assert decide_silence({1: "unresponsive"}, {1: 3.0}, 0.5, cfg, steps, {1: Beat(3.0, "R")}) is None
    # A rank without a heartbeat beside one with: each by its own rule.
    ranks, why = decide_silence({1: "unresponsive", 2: "unresponsive"}, {1: 5.5, 2: 1.5}, 5.6, cfg, steps,
                                {2: Beat(1.4, "R")})
    assert ranks == (1, 2) and "no heartbeat" in why
    ranks, _ = decide_silence({1: "unresponsive", 2: "unresponsive"}, {1: 4.0, 2: 1.5}, 4.1, cfg, steps,
                              {2: Beat(1.4, "R")})
    assert ranks == (2,)


def test_once_peers_collectives_failed_a_silent_rank_is_lost_on_its_nodes_word_alone():
    grace, ping = 0.4, 1.0
    # Its node's heartbeat silent as long as its poll: the machine died with it (a node kill).
    got = decide_after_peers_failed({1}, {1: 0.5}, {1: Beat(0.45, "R")}, grace, ping)
    assert got[1][0] == LostCause.UNRESPONSIVE and "heartbeat" in got[1][1] and "0.45s" in got[1][1]
    # Its node answers and says its process is gone: a process death, its slot free on that node.
    got = decide_after_peers_failed({1}, {1: 0.5}, {1: Beat(0.0, "X")}, grace, ping)
    assert got[1][0] == LostCause.PROCESS_DIED and "gone" in got[1][1]
    got = decide_after_peers_failed({1}, {1: 0.5}, {1: Beat(0.0, "T")}, grace, ping)
    assert got[1][0] == LostCause.UNRESPONSIVE and "stopped" in got[1][1]
    # Not yet: its poll or its node's heartbeat silent for no longer than the grace.
    assert decide_after_peers_failed({1}, {1: 0.3}, {1: Beat(0.45, "R")}, grace, ping) == {}
    assert decide_after_peers_failed({1}, {1: 0.5}, {1: Beat(0.3, "R")}, grace, ping) == {}
    assert decide_after_peers_failed({1}, {1: 0.3}, {1: Beat(0.0, "X")}, grace, ping) == {}
    # Never: its node says it runs (busy in a long step; its peers failed because another died), it
    # answers polls (none in flight), or its node never answered (no evidence: the old rules decide).
    assert decide_after_peers_failed({1}, {1: 5.0}, {1: Beat(0.1, "R")}, grace, ping) == {}
    assert decide_after_peers_failed({1}, {}, {1: Beat(0.45, "R")}, grace, ping) == {}
    assert decide_after_peers_failed({1}, {1: 5.0}, {}, grace, ping) == {}
    # A stale "gone" is not fresh evidence, but the node's silence is: still lost, as silent.
    got = decide_after_peers_failed({1, 2}, {1: 1.5, 2: 0.5}, {1: Beat(1.2, "X"), 2: Beat(0.1, "S")}, grace, ping)
    assert list(got) == [1] and got[1][0] == LostCause.UNRESPONSIVE


def test_a_forming_group_waits_for_a_member_whose_node_says_it_runs():
    assert formation_silent(2.6, None, 0.5) and not formation_silent(2.4, None, 0.5)  # polls alone: 5 x
    assert not formation_silent(60.0, Beat(0.1, "S"), 0.5)  # busy, its node up: the rendezvous timeout decides
    assert formation_silent(0.6, Beat(0.0, "T"), 0.5) and not formation_silent(0.4, Beat(0.0, "T"), 0.5)
    assert formation_silent(0.6, Beat(0.6, "R"), 0.5)  # its node silent too
    # Its node refuses the pings (its agent gone): lost once its own ping has waited a round.
    assert formation_silent(REFUSED_GRACE_S + 0.01, Beat(0.1, "S", refused=True), 5.0)
    assert not formation_silent(REFUSED_GRACE_S - 0.01, Beat(0.1, "S", refused=True), 5.0)


def test_a_refused_heartbeat_loses_a_rank_once_its_own_poll_has_waited_a_round():
    grace = 0.2
    ranks, why = decide_refused({0, 1, 2}, [1], {1: 0.25}, grace)
    assert ranks == (1,) and "refused" in why
    assert decide_refused({0, 1, 2}, [1], {1: 0.15}, grace) is None  # its poll may still be answered
    assert decide_refused({0, 1, 2}, [1], {}, grace) is None  # it answered: the refusal was stale
    assert decide_refused({0, 2}, [1], {1: 5.0}, grace) is None  # done, stopped or already lost
    assert decide_refused({0, 1, 2}, [], {1: 5.0}, grace) is None  # silent but not refused: decide_silence's
    assert decide_refused({0, 1, 2}, [1, 2], {1: 0.3, 2: 0.5}, grace)[0] == (1, 2)


def test_a_rollback_skips_only_the_bad_batches_and_keeps_the_good_ones():
    from elastic.policies.restore import rollback_target
    # Checkpoints every 10 steps, steps 13 and 14 bad: back to 10, train 11 and 12 again, skip 13-14.
    to_step, skip, why = rollback_target([10], [13, 14])
    assert (to_step, skip) == (10, {13, 14}) and "skipping the batches of steps 13..14" in why


def test_a_checkpoint_taken_during_the_bad_run_is_a_rollback_target():
    """Checkpoints every step, num_to_keep 1, steps 11-13 bad: only step 13's checkpoint is left;
    it holds step 10's weights (bad steps make no update) and has every bad batch behind it. The
    good batch of step 10 stays trained; nothing goes back to step 0."""
    from elastic.policies.restore import rollback_target
    to_step, skip, why = rollback_target([13], [11, 12, 13])
    assert (to_step, skip) == (13, set()) and "behind it" in why
    assert rollback_target([12], [11, 12, 13])[:2] == (12, {13})


def test_a_rollback_with_nothing_committed_replays_from_the_start_skipping_only_the_bad_batches():
    from elastic.policies.restore import rollback_target
    to_step, skip, why = rollback_target([], [13, 14])
    assert (to_step, skip) == (0, {13, 14}) and "nothing committed" in why
