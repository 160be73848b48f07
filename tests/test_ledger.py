"""The sample ledger (train.sample_ledger): what the controller folds from the ranks' reports and
writes as ledger.json, including the steps whose reports died with a lost rank."""
from __future__ import annotations

import json

from elastic.controller import reports
from elastic.controller.records import RunLog
from elastic.data.order import GlobalOrder
from elastic.protocol import LedgerEntry, PollReport, RankStatus
from elastic.storage import Storage

N, SEED, BATCH = 100, 7, 12


def _entry(step, world, replica, order):
    return LedgerEntry(step, world, replica, tuple(order.rank_indices(step - 1, BATCH, world, replica)), N)


def _write(log, tmp_path, upto=None):
    log.write_ledger(Storage(str(tmp_path)), str(tmp_path), lambda: (True, ""), SEED, BATCH,
                     max(log.ledger) if upto is None else upto)
    return json.loads((tmp_path / "ledger.json").read_text())


def test_a_step_whose_replica_report_died_is_completed_from_the_plan_and_marked(tmp_path):
    order = GlobalOrder(N, SEED)
    log = RunLog()
    # Steps 1-2 reported by all three replicas; step 3 only by the survivors 0 and 2 (replica 1's
    # report was still in its process when its node died). Then the group went on at world 2.
    for step, world, replicas in [(1, 3, [0, 1, 2]), (2, 3, [0, 1, 2]), (3, 3, [0, 2]), (4, 2, [0, 1])]:
        for r in replicas:
            log.ledger.setdefault(step, (world, {}))[1][r] = list(_entry(step, world, r, order).sample_ids)
    log.num_samples = N
    body = _write(log, tmp_path)
    assert [s for s, e in body.items() if "derived" in e] == ["3"] and body["3"]["derived"] == ["1"]
    assert body["3"]["ranks"]["1"] == order.rank_indices(2, BATCH, 3, 1)
    for s, e in body.items():  # every step is the plan's whole global batch, each sample once
        got = [i for r in range(e["world_size"]) for i in e["ranks"][str(r)]]
        assert got == order.indices((int(s) - 1) * BATCH, int(s) * BATCH)


def test_a_step_no_report_reached_is_the_plan_of_the_group_that_trained_it(tmp_path):
    """One rank per replica reports its share; the nodes of every reporter of step 4 died before
    it was polled. The next group restored step 4 (its state had trained it) at a data world of 3
    and trained 5-6. Step 4 has no report at all: it is the plan's batch at the data world of the
    group that trained it (the one that started before it), every slice marked derived. Steps
    before the first group's start are never made up."""
    order = GlobalOrder(N, SEED)
    log = RunLog()
    log.eras = [(0, 2), (4, 3)]  # the first group (data world 2) from step 0; the next from step 4, at 3
    for step, world in [(1, 2), (2, 2), (3, 2), (5, 3), (6, 3)]:
        for r in range(world):
            log.ledger.setdefault(step, (world, {}))[1][r] = list(_entry(step, world, r, order).sample_ids)
    log.num_samples = N
    body = _write(log, tmp_path, upto=6)
    assert sorted(map(int, body)) == [1, 2, 3, 4, 5, 6]
    assert body["4"]["world_size"] == 2 and body["4"]["derived"] == ["0", "1"]
    assert all("derived" not in body[s] for s in ("1", "2", "3", "5", "6"))
    for s, e in body.items():  # every step is the plan's whole global batch, each sample once
        got = [i for r in range(e["world_size"]) for i in e["ranks"][str(r)]]
        assert got == order.indices((int(s) - 1) * BATCH, int(s) * BATCH)
    resumed = RunLog()
    resumed.eras, resumed.num_samples = [(10, 2)], N  # a run resumed from a checkpoint of step 10
    assert _write(resumed, tmp_path, upto=10) == {}  # nothing it did not see is made up


def test_the_reports_carry_the_dataset_length_the_completion_needs(tmp_path):
    order = GlobalOrder(N, SEED)

    class Ctl:  # what absorb_reports reads of the controller
        run_log = RunLog()
        job = type("J", (), {"stragglers": type("S", (), {"enabled": False})()})()
        compute_log = {}
        world_size = 2
        checkpoints = None
        events = type("E", (), {"emit": staticmethod(lambda *a, **k: None)})()
        loggers = type("L", (), {"enabled": False})()  # no TensorBoard or MLflow

    reports.absorb_reports(Ctl, {0: PollReport(rank=0, generation=0, status=RankStatus.RUNNING, step=5, ledger=(_entry(5, 2, 0, order),))})
    assert Ctl.run_log.num_samples == N
    body = _write(Ctl.run_log, tmp_path)
    assert body["5"]["derived"] == ["1"] and body["5"]["ranks"]["1"] == order.rank_indices(4, BATCH, 2, 1)
