"""`python -m benchmarks overhead`: its pure parts and its command line (no cluster, no timing).

The benchmark's figures are its own business; these check that every system gets the same
model and plan, that the windows it times are the ones its docstring names, and that its
arguments are checked.
"""
from __future__ import annotations

import pytest

from benchmarks import overhead as bench
from benchmarks import plain_ddp
from benchmarks.cli import add_bench_args
from elastic.config import parse_job


def test_parameter_count_matches_the_model_every_system_builds():
    for hidden in (16, 1024, 3072):
        assert bench.num_params(hidden) == sum(p.numel() for p in bench.build_mlp(hidden).parameters())
    assert bench.num_params(1024) == 1_323_018  # the common workload's MLP
    assert bench.num_params(10000) >= 100_000_000


def test_elastic_builds_the_width_its_environment_names(monkeypatch):
    monkeypatch.setenv(bench.HIDDEN_ENV, "32")
    assert sum(p.numel() for p in bench.build_model().parameters()) == bench.num_params(32)


def test_hidden_widths_are_parsed_and_checked():
    assert bench.parse_hidden("1024,3072,10000") == [1024, 3072, 10000]
    for bad in ("", "a,b", "0,1024", "1024,-1"):
        with pytest.raises(ValueError, match="--hidden"):
            bench.parse_hidden(bad)


def test_plan_fits_whole_checkpoint_periods_and_runs_large_models_once():
    small, large = bench.plan(1024, reps=3), bench.plan(10000, reps=3)
    assert small == {"num_steps": 2 * bench.CKPT_EVERY, "warmup_steps": 10, "reps": 3}
    assert large == {"num_steps": 2 * bench.CKPT_EVERY, "warmup_steps": 5, "reps": 1}
    assert bench.plan(10000, reps=3, reps_large=2)["reps"] == 2  # --reps-large
    assert bench.plan(1024, reps=3, reps_large=2)["reps"] == 3
    for p in (small, large):
        assert p["num_steps"] % bench.CKPT_EVERY == 0 and p["warmup_steps"] < bench.CKPT_EVERY


def test_step_figures_time_the_windows_they_name():
    every, warmup = 10, 2
    # Step s ends at t[s-1]; steps take 1 s, except the interval holding the checkpoint of
    # step 10 (ending at step 11: +5 s) and of step 20 (ending at step 21: +3 s), and a slow
    # warm-up step 1 -> 2 that must not count.
    times, t = [], 0.0
    for s in range(1, 31):
        t += 1.0 + (5.0 if s == 11 else 3.0 if s == 21 else 0.0) + (9.0 if s == 2 else 0.0)
        times.append(t)
    figs = bench.step_figures(times, warmup, every)
    off, on = figs["off"], figs[f"every {every}"]
    assert off["timed_steps"] == every - warmup and off["step_s"] == 1.0 and off["num_checkpoints"] == 0
    # From the end of step 10 to the end of step 30: two checkpoints in 20 intervals.
    assert on["timed_steps"] == 20 and on["num_checkpoints"] == 2
    assert on["step_s"] == pytest.approx((20 + 5 + 3) / 20) and on["median_step_s"] == 1.0
    assert on["max_step_s"] == 6.0
    # Every interval after step 1: the slow warm-up step and both checkpoints count.
    whole = figs["whole run"]
    assert whole["timed_steps"] == 29 and whole["num_checkpoints"] == 2
    assert whole["step_s"] == pytest.approx((29 + 9 + 5 + 3) / 29) and whole["max_step_s"] == 10.0


def test_step_figures_need_a_whole_period():
    with pytest.raises(ValueError, match="whole checkpoint period"):
        bench.step_figures([float(i) for i in range(15)], 2, 10)
    with pytest.raises(ValueError, match="warm-up"):
        bench.step_figures([float(i) for i in range(30)], 0, 10)


def test_run_figures_refuse_a_log_with_missing_steps():
    lines = [{"t": float(i), "threads": 1} for i in range(99)]
    with pytest.raises(RuntimeError, match="missed steps"):
        bench.run_figures(lines, 100, 5)
    figs = bench.run_figures(lines + [{"t": 99.0, "threads": 1}], 100, 5)
    assert all(f["steps_per_s"] == pytest.approx(1.0) and f["threads"] == 1 for f in figs.values())


def test_systems_take_turns_going_first():
    firsts = {bench.rotated(bench.SYSTEMS, rep)[0] for rep in range(len(bench.SYSTEMS))}
    assert firsts == set(bench.SYSTEMS)
    assert all(sorted(bench.rotated(bench.SYSTEMS, rep)) == sorted(bench.SYSTEMS) for rep in range(5))


def test_ratios_are_against_torch_ddp_of_the_same_size_mode_and_repetition():
    def rec(system, rep, rate, mode="off"):
        return {"system": system, "params": 1, "checkpoints": mode, "rep": rep, "steps_per_s": rate,
                "step_s": 1 / rate, "median_step_s": 1 / rate}
    records = [rec("torch-ddp", 0, 10.0), rec("elastic", 0, 9.0), rec("ray-train", 0, 5.0),
               rec("torch-ddp", 1, 20.0), rec("elastic", 1, 19.0), rec("elastic", 0, 1.0, mode="every 50")]
    bench.add_ratios(records)
    assert [r.get("overhead_ratio") for r in records] == [None, 0.9, 0.5, None, 0.95, None]
    rows, table = bench.summarise(records)
    elastic_off = next(r for r in rows if r["system"] == "elastic" and r["checkpoints"] == "off")
    assert elastic_off["overhead_ratio"] == pytest.approx(14.0 / 15.0)  # median 14 over median 15
    assert "| elastic |" in table


def test_the_elastic_job_is_valid_and_checkpoints_every_period(tmp_path):
    job = parse_job(bench.elastic_job(3072, 150, "file://" + str(tmp_path)))
    assert job.scaling.num_workers == bench.NUM_WORKERS and job.checkpoint.every_steps == bench.CKPT_EVERY
    assert job.train.global_batch_size == bench.GLOBAL_BATCH and job.run.num_steps == 150
    assert job.train.optimizer == "benchmarks.overhead:timed_optimizer"


def test_the_plain_peer_parses_the_command_the_benchmark_builds():
    cmd = bench.plain_command(3072, 150, "/tmp/ckpt")
    args = plain_ddp.parse_args(cmd[cmd.index("benchmarks.plain_ddp") + 1:])
    assert (args.hidden, args.steps, args.global_batch, args.ckpt_every, args.ckpt_dir) == (
        3072, 150, bench.GLOBAL_BATCH, bench.CKPT_EVERY, "/tmp/ckpt")
    with pytest.raises(SystemExit):
        plain_ddp.parse_args(["--hidden", "8", "--steps", "10", "--ckpt-every", "5"])  # no --ckpt-dir


def test_the_cli_knows_the_benchmark():
    import argparse
    p = argparse.ArgumentParser()
    add_bench_args(p)
    args = p.parse_args(["overhead", "--hidden", "64,128", "--reps", "2"])
    assert (args.name, args.hidden, args.reps) == ("overhead", "64,128", 2)
    assert p.parse_args(["overhead"]).hidden is None  # each benchmark has its own default sizes


def test_the_cli_refuses_bad_arguments_before_starting_anything(capsys):
    import argparse
    p = argparse.ArgumentParser()
    add_bench_args(p)
    assert bench.main(p.parse_args(["overhead", "--systems", "elastic,horovod"])) == 2
    assert bench.main(p.parse_args(["overhead", "--hidden", "0"])) == 2
    assert "--hidden" in capsys.readouterr().err


def test_a_gpu_run_puts_one_rank_on_each_gpu_up_to_the_cpu_world():
    # NCCL refuses two ranks on one GPU: one GPU is a world of one.
    assert [bench.gpu_world_size(n) for n in (1, 2, 8)] == [1, 2, bench.NUM_WORKERS]
    with pytest.raises(ValueError, match="--gpu"):
        bench.gpu_world_size(0)


def test_a_gpu_run_gives_every_size_the_same_plan():
    assert bench.plan(10000, reps=3, gpu=True) == bench.plan(1024, reps=3, gpu=True) == bench.plan(1024, reps=3)


def test_the_gpu_job_and_the_gpu_plain_peer_use_the_gpu(tmp_path):
    job = parse_job(bench.elastic_job(1024, 100, "file://" + str(tmp_path), num_workers=1, gpu=True))
    assert job.scaling.use_gpu and job.scaling.num_workers == 1
    assert not parse_job(bench.elastic_job(1024, 100, "file://" + str(tmp_path))).scaling.use_gpu
    cmd = bench.plain_command(1024, 100, "/tmp/ckpt", num_workers=1, gpu=True)
    assert "--nproc-per-node=1" in cmd
    assert plain_ddp.parse_args(cmd[cmd.index("benchmarks.plain_ddp") + 1:]).gpu
    cpu = bench.plain_command(1024, 100, "/tmp/ckpt")
    assert not plain_ddp.parse_args(cpu[cpu.index("benchmarks.plain_ddp") + 1:]).gpu


def test_the_cli_takes_gpu_and_refuses_it_without_a_gpu(capsys, monkeypatch):
    import argparse
    p = argparse.ArgumentParser()
    add_bench_args(p)
    assert p.parse_args(["overhead", "--gpu"]).gpu and not p.parse_args(["overhead"]).gpu
    monkeypatch.setattr(bench, "gpu_devices", lambda: 0)
    assert bench.main(p.parse_args(["overhead", "--gpu"])) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_ray_train_peers_save_the_model_whether_or_not_prepare_model_wrapped_it():
    # prepare_model wraps in DDP only above world size one: a one-GPU run has no `.module`.
    from torch import nn

    from benchmarks.ray_train_peer import unwrapped
    model = nn.Linear(2, 2)
    wrapped = nn.Module()
    wrapped.module = model
    assert unwrapped(model) is model and unwrapped(wrapped) is model
