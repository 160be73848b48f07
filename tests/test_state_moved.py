"""The state a recovery or a resize moved rank to rank, on its events (`moved_bytes`,
`moved_gb_per_s`, `state_in_place_s`): the controller stepped against the fake group, whose
restore from a peer reports a copy of `state_bytes` into each rank that lacked it, and
`moved_state` alone on every restore path's results."""
from __future__ import annotations

import pytest

from elastic.controller.restoring import moved_state
from elastic.controller.states import Finished
from elastic.observability.report import describe_event
from elastic.protocol import RestoreResult
from tests.test_controller import _release_leases, drive, kinds, make  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(60)

STATE = 1_080_000_000  # the 90 M MLP's parameters and AdamW moments, fp32


def test_a_recovery_from_a_peer_reports_the_state_it_moved_and_when_it_was_in_place():
    c, g, clock = make(state_bytes=STATE, transfer_s=0.5)
    drive(c, lambda c: c.step >= 10)
    c.report_fault({"action": "kill_node", "rank": 1, "at_step": c.step}, 1, c.step, clock())
    g.kill_process(1)
    drive(c)
    assert isinstance(c.state, Finished)
    (restored,) = [e for e in kinds(c, "restored") if e["source"].startswith("peer")]
    (rec,) = kinds(c, "recovered")
    # One replacement received the whole state; the two survivors held it and only sent.
    assert restored["moved_bytes"] == rec["moved_bytes"] == STATE
    assert restored["moved_gb_per_s"] == rec["moved_gb_per_s"] == round(STATE / 0.5 / 1e9, 3)
    assert rec["detect_s"] + 0.5 <= rec["state_in_place_s"] <= rec["recover_s"], rec
    # The driver's line says it too.
    assert describe_event(rec).endswith(
        f"; state in place after {rec['state_in_place_s']:.2f}s, 1.08 GB moved at 2.16 GB/s")


def test_a_grow_from_a_peer_reports_one_state_per_rank_that_joined():
    c, g, clock = make(num_steps=4000,
                       scaling={"num_workers": 2, "max_workers": 4, "grow_check_s": 1},
                       state_bytes=STATE, transfer_s=2.0)
    drive(c, lambda c: kinds(c, "resize_completed"))
    (done,) = kinds(c, "resize_completed")
    joined = done["new_world_size"] - done["old_world_size"]
    assert joined == 2 and done["moved_bytes"] == joined * STATE, done
    assert done["moved_gb_per_s"] == round(joined * STATE / 2.0 / 1e9, 3)
    assert 2.0 <= done["state_in_place_s"] <= done["resize_s"], done


def test_a_restore_without_a_copy_reports_none_and_one_where_all_held_it_reports_zero():
    c, g, clock = make(num_steps=20)  # the fake reports no copy: state from the seed
    drive(c)
    assert all("moved_bytes" not in e for e in kinds(c, "restored"))
    stored = {r: RestoreResult(step=20, source="storage", restore_s=1.0, uri="u") for r in range(3)}
    assert moved_state(stored) == {}
    held = {r: RestoreResult(step=5, source="peer rank 0", restore_s=0.1, phases={"transfer": 0.01},
                             state_bytes=STATE, senders=3, receivers=0, received_bytes=0)
            for r in range(3)}
    assert moved_state(held) == {"moved_bytes": 0, "moved_gb_per_s": None}


def test_a_broadcast_counts_every_rank_but_the_source_and_a_reshard_its_rows_sent():
    bcast = {r: RestoreResult(step=5, source="peer rank 0", restore_s=1.0,
                              phases={"transfer": 0.8 + r / 10}, state_bytes=STATE,
                              received_bytes=STATE if r else 0) for r in range(3)}
    assert moved_state(bcast) == {"moved_bytes": 2 * STATE,
                                  "moved_gb_per_s": round(2 * STATE / 1.0 / 1e9, 3)}
    shards = {0: RestoreResult(step=5, source="re-sharded", restore_s=1.0,
                               phases={"assemble": 0.25}, received_bytes=300),
              1: RestoreResult(step=5, source="re-sharded", restore_s=1.0, phases={"assemble": 0.5},
                               received_bytes=None)}
    assert moved_state(shards) == {"moved_bytes": 300, "moved_gb_per_s": round(300 / 0.5 / 1e9, 3)}
