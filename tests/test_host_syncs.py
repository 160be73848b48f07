"""The host-read probe (`python -m benchmarks.probes.host_syncs`): its counter on known functions,
and the probe itself on a real worker and torch DDP's loop (no Ray, a subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from benchmarks.probes.host_syncs import HostReads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reads(fn) -> HostReads:
    mode = HostReads()
    with mode:
        fn(mode)
    return mode


def test_each_kind_of_read_of_a_device_tensor_is_counted_once():
    x = torch.arange(4.0)
    cases = {
        "item": lambda m: x.sum().item(),
        "bool": lambda m: bool(x[0] > 0),
        "float": lambda m: float(x[1]),
        "tolist": lambda m: x.tolist(),
        "cpu then tolist": lambda m: x.cpu().tolist(),  # one copy to the host, then host reads
        'to("cpu")': lambda m: x.to("cpu"),
        "nonzero": lambda m: x.nonzero(),
        "copy_ into a host tensor": lambda m: (m.host(buf := torch.empty(4)), buf.copy_(x)),
    }
    counts = {name: _reads(fn).num_reads for name, fn in cases.items()}
    assert counts and all(n == 1 for n in counts.values()), counts


def test_what_the_host_holds_is_read_freely():
    x = torch.arange(4.0)
    data = type("Data", (), {})()
    data.x = torch.ones(8, 2)

    def step(m: HostReads):
        m.mark_data(data)
        batch = torch.stack([data.x[i] for i in range(3)])  # the data path: host work
        assert batch.sum().item() == 6.0
        host = torch.empty(4)
        host.copy_(x * 2, non_blocking=True)  # a copy out, read later: no read of the device
        assert host.tolist() == [0.0, 2.0, 4.0, 6.0]
        x.to(torch.device("cpu"))  # on a CPU the step's own device: a move to it, not a read

    mode = _reads(step)
    assert mode.num_reads == 0, mode.reads
    # The device's operators are counted (mul, copy_); the data path's (select, stack, sum) are not.
    assert mode.ops["aten.mul.Tensor"] == 1 and mode.ops["aten.copy_.default"] == 1, mode.ops
    assert not any(k.startswith(("aten.stack", "aten.select")) for k in mode.ops), mode.ops


def test_a_read_says_where_it_was_made():
    x = torch.ones(2)
    mode = _reads(lambda m: x.sum().item())
    (where, n), = mode.reads.items()
    assert n == 1 and "tests/test_host_syncs.py" in where and "_local_scalar_dense" in where, where


def test_a_non_fused_optimizers_step_counters_are_host_memory():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)  # foreach: its step counters stay on the host
    p.grad = torch.ones(3)
    opt.step()

    def step(m: HostReads):
        m.mark_optimizer(opt)
        p.grad = torch.ones(3)
        opt.step()  # reads its step counter with .item(): a host tensor

    mode = _reads(step)
    assert mode.num_reads == 0 and mode.num_ops > 0, (mode.reads, mode.num_ops)


def _probe(*args: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.probes.host_syncs", "--hidden", "64", "--steps", "2",
           "--warmup", "4", *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, out.stdout
    return json.loads(lines[0])


def test_the_probe_prints_one_json_line_of_both_systems():
    rec = _probe()
    assert (rec["probe"], rec["optimizer"], rec["device"]) == ("host_syncs", "adamw-fused", "cpu")
    for key in ("host_reads_per_step", "ops_ratio", "elastic_ops_per_step",
                "torch_ddp_ops_per_step", "torch_ddp_host_reads_per_step"):
        assert isinstance(rec[key], (int, float)) and rec[key] >= 0, (key, rec)
    assert rec["elastic_ops_per_step"] > 10 and rec["torch_ddp_ops_per_step"] > 10, rec
    assert rec["ops_ratio"] == round(rec["elastic_ops_per_step"] / rec["torch_ddp_ops_per_step"], 4)
    # torch DDP's loop reads nothing on the host.
    assert rec["torch_ddp_host_reads_per_step"] == 0 and rec["torch_ddp_reads"] == {}, rec
    assert sum(rec["elastic_reads"].values()) == rec["host_reads_per_step"], rec
    # Issue 55: with a fused optimizer elastic's steady step reads nothing of the device either,
    # and launches at most 1.2 x torch DDP's operators; with one that takes no found_inf
    # (AdamW's foreach kernels), the step reads its statistics once, before the update.
    assert rec["host_reads_per_step"] == 0 and rec["ops_ratio"] <= 1.2, rec
    other = _probe("--optimizer", "adamw")
    assert other["host_reads_per_step"] == 1 and other["ops_ratio"] <= 1.2, other
    (where,) = other["elastic_reads"]
    assert "elastic/runtime/step.py" in where, where
