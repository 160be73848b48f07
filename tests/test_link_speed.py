"""benchmarks/probes/link_speed.py: its arguments (a size from --params or --bytes, refused
naming the flag before any process starts) and one small send between two spawned gloo ranks."""
from __future__ import annotations

import json

import pytest

from benchmarks.probes import link_speed

pytestmark = pytest.mark.timeout(120)


def test_the_buffer_is_the_state_of_the_named_size_or_the_bytes_given():
    assert link_speed.parse_args([]).bytes == 90_000_000 * 12  # the recovery bench's 90 M: 1.08 GB
    assert link_speed.parse_args(["--params", "9M"]).bytes == 108_000_000
    args = link_speed.parse_args(["--bytes", "4096", "--reps", "5"])
    assert (args.bytes, args.reps, args.backend) == (4096, 5, "gloo")


@pytest.mark.parametrize("argv, says", [
    (["--params", "9M,90M"], "--params: expected one size"),
    (["--params", "lots"], "--params: expected sizes like"),
    (["--params", "5"], "--params: 5 is too small"),
    (["--bytes", "0"], "--bytes: expected a positive size"),
    (["--reps", "0"], "--reps: expected at least 1"),
    (["--params", "9M", "--bytes", "3"], "not allowed with argument --params"),
    (["--backend", "mpi"], "--backend: invalid choice"),
])
def test_a_bad_argument_is_refused_naming_the_flag(argv, says, capsys, monkeypatch):
    monkeypatch.setattr(link_speed, "measure",
                        lambda *a: pytest.fail("measured despite a bad argument"))
    with pytest.raises(SystemExit) as e:
        link_speed.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_nccl_without_two_gpus_is_refused_before_any_process_starts(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as e:
        link_speed.parse_args(["--backend", "nccl"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--backend nccl: needs 2 GPUs here, this machine has 1" in err


def test_one_buffer_crosses_from_rank_0_to_rank_1_and_its_rate_is_printed(capsys):
    assert link_speed.main(["--bytes", "65536", "--reps", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    got = (out["probe"], out["backend"], out["bytes"], out["reps"])
    assert got == ("link_speed", "gloo", 65536, 2)
    assert len(out["s"]) == 2 and out["gb_per_s"] > 0  # the receiver checked every byte arrived
