"""`python -m benchmarks NAME`: one subcommand per benchmark, each with the options it reads."""
from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cli import BENCHMARKS, OPTIONS, add_bench_args

ROOT = Path(__file__).resolve().parents[1]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    add_bench_args(p)
    return p


def test_help_lists_every_benchmark_and_each_has_a_main():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60).stdout
    for name, (_, module) in BENCHMARKS.items():
        assert f"    {name}" in out, name
        assert callable(importlib.import_module(module).main)
    modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert {m.rsplit(".", 1)[1] for _, m in BENCHMARKS.values()} <= modules


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_takes_its_own_options_and_refuses_the_others(name, capsys):
    p = _parser()
    args = p.parse_args([name])
    assert args.name == name and all(hasattr(args, o.dest) for o in OPTIONS)  # every field, for every main
    for o in OPTIONS:
        flag = o.flags[0]
        argv = [name, flag] if o.kwargs.get("action") == "store_true" else [name, flag, str(o.default or "1")]
        if "choices" in o.kwargs:
            argv[-1] = o.kwargs["choices"][-1]
        if name in o.used_by:
            p.parse_args(argv)
        else:
            with pytest.raises(SystemExit):
                p.parse_args(argv)
            assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_controller_ranks_default_and_refusals():
    from benchmarks.controller import RANKS, parse_ranks
    assert parse_ranks(None) == list(RANKS)
    assert parse_ranks("1000,100000") == [1000, 100000]
    for bad in ("ten", "1"):
        with pytest.raises(ValueError, match="--ranks"):
            parse_ranks(bad)
