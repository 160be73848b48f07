"""`python -m benchmarks parallel`: its layout flag, and its plain peer training for real (torchrun,
gloo) with the same plan elastic applies."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.parallel import elastic_job, parse_layout


def test_layouts_parse_and_bad_ones_name_the_flag():
    assert parse_layout("fsdp:dp2xtp2") == ("fsdp", 2, 2, False)
    assert parse_layout("ddp:dp4") == ("ddp", 4, 1, False)
    assert parse_layout("fsdp:dp2xtp2+sp") == ("fsdp", 2, 2, True)
    for bad in ("fsdp:dp2xpp2", "zero:dp2", "ddp", "ddp:dp0", "ddp:dp4+sp"):
        with pytest.raises(ValueError, match="--layouts"):
            parse_layout(bad)
    job = elastic_job("fsdp", 2, 2, "file:///tmp/x")
    assert job["scaling"]["num_workers"] == 4 and job["train"]["tp"] == {"size": 2}
    assert elastic_job("ddp", 2, 2, "file:///tmp/x", sp=True)["train"]["tp"] == {"size": 2, "sequence_parallel": True}


@pytest.mark.timeout(300)
def test_plain_peer_trains_fsdp_with_tp_under_torchrun(tmp_path):
    log = tmp_path / "steps.jsonl"
    env = {**os.environ, "ELASTIC_BENCH_STEP_LOG": str(log), "GPT_LAYERS": "2", "GPT_DIM": "64"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
           "benchmarks.plain_tp", "--strategy", "fsdp", "--tp", "2", "--steps", "3", "--sequence-parallel"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fsdp dp 2 x tp 2 with sequence parallelism, 3 steps" in proc.stdout
    assert len([json.loads(x) for x in log.read_text().splitlines()]) == 3  # one line per optimizer step


def test_memory_world_sizes_parse_and_bad_ones_are_refused_before_any_run(capsys, monkeypatch):
    import argparse

    from benchmarks import memory_per_rank
    from benchmarks.cli import add_bench_args, run_bench
    assert memory_per_rank.parse_world_sizes("2,4,8") == [2, 4, 8]
    p = argparse.ArgumentParser()
    add_bench_args(p)
    ran = []
    monkeypatch.setattr(memory_per_rank, "run", lambda *a: ran.append(a) or 0)
    for bad in ("1,2", "two", "", "4,0"):
        assert run_bench(p.parse_args(["parallel", "--memory", "--world-sizes", bad])) == 2
        assert "--world-sizes" in capsys.readouterr().err
    odd = ["parallel", "--memory", "--world-sizes", "2,4", "--gpt", "4,30,64"]
    assert run_bench(p.parse_args(odd)) == 2
    assert "--gpt" in capsys.readouterr().err  # (dim not a multiple of 4)
    assert not ran
    args = p.parse_args(["parallel", "--memory", "--world-sizes", "2,4",
                         "--gpt-sizes", "2,64,32;4,1024,64", "--reps", "2", "--out", "/tmp/x"])
    assert run_bench(args) == 0
    assert ran == [(["2,64,32", "4,1024,64"], [2, 4], 2, "/tmp/x")]
    job = memory_per_rank.memory_job(4, True, "file:///tmp/x")
    assert job["train"]["meta_init"] and job["train"]["strategy"] == "fsdp"
    assert job["scaling"]["num_workers"] == 4 and job["checkpoint"]["memory_sync"]
    off = memory_per_rank.memory_job(4, False, "file:///x")["checkpoint"]
    assert off["memory_every_steps"] == 0 and not off["memory_sync"]
    assert memory_per_rank.bound_mib(400, 4, 10, 20, copies=False) == 1.25 * 100 + 30
    assert memory_per_rank.bound_mib(400, 4, 10, 20, copies=True) == 2.5 * 100 + 30
