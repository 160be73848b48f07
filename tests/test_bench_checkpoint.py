"""`python -m benchmarks checkpoint`: the figures it derives from a run (pure), and its command line.
The benchmark itself runs a cluster and SeaweedFS: `python -m benchmarks checkpoint`."""
import argparse

import pytest

from benchmarks import checkpoint as bench
from benchmarks.cli import add_bench_args


def test_each_step_lasts_from_the_end_of_the_one_before():
    # t[s-1] ends step s: step 2 lasts t[1] - t[0], and so on; step 1 has no start.
    assert bench.step_intervals([10.0, 10.5, 11.5, 11.75]) == {2: 0.5, 3: 1.0, 4: 0.25}


def test_a_checkpoint_costs_its_stall_in_the_next_step_and_its_persist_over_the_period():
    # Steps of 1 s before the first save (step 2 is the warm-up); the save after step 4 makes
    # step 5 last 3 s and, while it persists, step 6 1.5 s; every 3 steps.
    ends = [0.0, 5.0, 6.0, 7.0, 10.0, 11.5, 12.5, 13.5]  # ends of steps 1..8
    figs = bench.checkpoint_figures(bench.step_intervals(ends), saved_steps=[4], warmup_steps=2, every=3)
    assert figs["step_s"] == 1.0  # steps 3 and 4: after the warm-up, before the first save
    assert figs["extra_s"] == {4: 2.0}
    assert figs["period_extra_s"] == {4: 2.5}  # steps 5, 6, 7: 2 + 0.5 + 0


def test_a_period_cut_short_by_the_end_of_the_run_is_left_out():
    ends = [0.0, 5.0, 6.0, 7.0, 10.0]
    figs = bench.checkpoint_figures(bench.step_intervals(ends), saved_steps=[4], warmup_steps=2, every=3)
    assert figs["extra_s"] == {4: 2.0} and figs["period_extra_s"] == {}


def test_a_run_with_no_clean_step_is_refused_not_divided_by_zero():
    with pytest.raises(ValueError, match="before the first checkpoint"):
        bench.checkpoint_figures({2: 1.0, 3: 1.0}, saved_steps=[2], warmup_steps=2, every=1)


def test_the_summary_is_per_size_and_divides_persist_by_raw_of_the_same_bytes():
    recs = [{"params": 10, "bytes": 100e6, "step_s": 0.2, "stall_s": s, "extra_s": 0.01, "period_extra_s": 0.1,
             "persist_s": p,
             "persist_MBps": 100 / p} for s, p in ((0.05, 1.0), (0.07, 2.0), (0.06, 1.0))]
    rows, table = bench.summarise(recs, {10: {"raw_MBps": 125.0}})
    (row,) = rows
    assert row["median_stall_s"] == 0.06 and row["max_stall_s"] == 0.07
    assert row["stall_over_step"] == pytest.approx(0.3)
    assert row["persist_MBps"] == 100.0 and row["persist_over_raw"] == pytest.approx(0.8)
    assert "| 0.80 |" in table


def test_the_summary_divides_persist_by_raw_beside_training_where_it_was_measured():
    recs = [{"params": 10, "bytes": 100e6, "step_s": 0.2, "stall_s": 0.05, "extra_s": 0.01, "period_extra_s": 0.1,
             "persist_s": 1.0, "persist_MBps": 100.0}]
    (row,), table = bench.summarise(recs, {10: {"raw_MBps": 200.0, "raw_beside_MBps": 125.0}})
    assert row["persist_over_raw"] == pytest.approx(0.5)
    assert row["persist_over_raw_beside"] == pytest.approx(0.8)
    assert table.rstrip().endswith("| 0.50 | 125 | 0.80 |")
    (row,), table = bench.summarise(recs, {10: {"raw_MBps": 200.0}})  # records from before it was measured
    assert row["persist_over_raw_beside"] is None and table.rstrip().endswith("| 0.50 | - | - |")


def test_the_run_beside_the_raw_writes_leaves_each_write_four_times_its_idle_time_and_half_again():
    # 5 writes of 2 s pause + 4 x 0.5 s each = 20 s, x 1.5 = 30 s at 0.25 s a step: 120 steps,
    # plus 5 of warm-up and 5 at the end.
    assert bench.beside_steps(step_s=0.25, raw_s=0.5, reps=5, gap_s=2.0, warmup_steps=5) == 130


def test_only_writes_between_the_first_and_the_last_step_count_as_beside_training():
    ends = [10.0, 11.0, 12.0, 20.0]
    assert bench.writes_inside([(10.5, 11.5), (12.0, 19.0)], ends) == 2
    assert bench.writes_inside([(9.0, 11.0), (19.0, 21.0), (12.0, 13.0)], ends) == 1  # one began before, one ended after
    assert bench.writes_inside([(11.0, 12.0)], []) == 0


def test_the_cli_runs_it_with_its_own_default_sizes():
    p = argparse.ArgumentParser()
    add_bench_args(p)
    args = p.parse_args(["checkpoint"])
    assert args.name == "checkpoint" and args.hidden is None
    assert bench.parse_hidden(bench.DEFAULT_HIDDEN) == [3072, 10000]


def test_spare_core_trains_one_rank_on_a_node_of_two_cpus_with_one_compute_thread():
    p = argparse.ArgumentParser()
    add_bench_args(p)
    assert p.parse_args(["checkpoint"]).spare_core is False
    assert p.parse_args(["checkpoint", "--spare-core"]).spare_core is True
    assert bench.SPARE_CORE_LAYOUT == {"num_workers": 1, "cpus_per_node": 2}
    job = bench.elastic_job(3072, "s3://b/x", {}, every=25, num_steps=125,
                            num_workers=bench.SPARE_CORE_LAYOUT["num_workers"])
    # One compute thread (threads follow cpus_per_worker): the node's other CPU is the persist's.
    assert job["scaling"] == {"num_workers": 1, "cpus_per_worker": 1}
