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
