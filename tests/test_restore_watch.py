"""A rank lost while its group restores is found as it would be in training (issue 52 item 7):
the heartbeat and the polls judge every rank during a restore too, the restore's own deadline
(failure.collective_timeout_s, 120 s) is only a backstop, and the healthy ranks blocked on the
lost one keep their state. Fake group, fake clock."""
from __future__ import annotations

import pytest

from elastic.controller.states import Finished
from tests.test_controller import calls, drive, kinds, make


@pytest.mark.parametrize("how", ["machine", "process"])
def test_a_replacement_frozen_during_its_restore_is_found_within_the_heartbeat_bound(how):
    """Before: nothing was decided until the restore's 120 s deadline, and then the two healthy
    survivors were declared unresponsive too and replaced, so the run went back to storage."""
    c, g, clock = make(heartbeats=True)
    drive(c, lambda c: c.step >= 10)
    g.kill_process(1)
    g.freeze_on_restore = {1: how}  # its replacement's node (or process) stops as it restores
    drive(c, lambda c: any(e.get("during") == "restore" for e in kinds(c, "silence_detected")))
    (found,) = [e for e in kinds(c, "silence_detected") if e.get("during") == "restore"]
    assert found["ranks"] == [1] and found["reason"]
    restores = [e for e in c.events.events if e["kind"] == "state" and e["new"] == "Restoring"]
    waited = found["t"] - restores[-1]["t"]
    assert waited <= 2 * c.job.failure.ping_timeout_s + 0.5, waited  # the fake clock: not 120 s
    drive(c)
    assert isinstance(c.state, Finished) and c.step == 40
    assert not kinds(c, "worker_replaced")  # no healthy rank was counted lost for its peer's silence
    killed = calls(g, "kill")
    assert 1 in killed and 0 not in killed and 2 not in killed
    assert all(e["source"] != "storage" for e in kinds(c, "restored"))  # still from the survivors' memory


def test_a_rank_whose_process_dies_during_a_restore_is_lost_at_once():
    c, g, clock = make()
    drive(c, lambda c: c.step >= 10)
    g.kill_process(1)
    g.die_on_restore = [1]
    drive(c)
    assert isinstance(c.state, Finished)
    lost = [e["lost"] for e in kinds(c, "failure_detected")]
    assert len(lost) == 2 and [x["rank"] for x in lost[1]] == [1]
    assert not kinds(c, "worker_replaced")


def test_a_chaos_fault_during_restore_is_handed_to_the_receiving_rank_once():
    """`chaos: [{action: freeze_node, rank: 1, at_step: 10, during_restore: true}]`: the drill
    for a machine lost mid-restore fires on the replacement as the restore from a peer starts,
    never on the source, never in run(), and only once."""
    c, g, clock = make(heartbeats=True)
    fault = {"action": "freeze_node", "rank": 1, "at_step": 10, "during_restore": True}
    c.pending_faults.append(fault)
    drive(c, lambda c: c.step >= 12)
    assert not calls(g, "restore_fault")  # no restore from memory yet: not handed out
    assert fault in c.pending_faults
    g.kill_process(1)
    drive(c)
    assert isinstance(c.state, Finished)
    assert [args for args in g.calls if args[0] == "restore_fault"] == [("restore_fault", 1, "freeze_node")]
    assert [e["ranks"] for e in kinds(c, "silence_detected") if e.get("during") == "restore"] == [[1]]
    assert fault not in c.pending_faults


@pytest.mark.parametrize("how", ["machine", "process", "refused"])
def test_a_survivor_lost_while_the_replacements_start_is_merged_before_the_group_forms(how):
    """A second node lost seconds after the first, while the replacements start (4-10 s here): the
    churn benchmark found it only 6-11 s later, in a formation that could not complete. Now the
    start of the replacements is watched as training is (heartbeat and polls), and a survivor
    found lost cuts it short and is merged into this recovery."""
    c, g, clock = make(heartbeats=True)
    drive(c, lambda c: c.step >= 10)
    g.kill_process(1)
    g.freeze_on_promote = {2: how}
    drive(c)
    assert isinstance(c.state, Finished)
    (merged,) = kinds(c, "faults_merged")
    assert merged["lost"] == [2] and merged["causes"]["2"].startswith("unresponsive")
    assert not kinds(c, "group_error")  # no formation was tried with the lost survivor
    # Found while the replacements were still starting, not after: the wait is watched.
    (found,) = [e for e in kinds(c, "silence_detected") if e.get("during") == "promote"]
    assert found["ranks"] == [2] and found["reason"]
