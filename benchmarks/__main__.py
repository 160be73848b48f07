"""`python -m benchmarks NAME [options]`, from a checkout: see docs/benchmarks/README.md."""
from __future__ import annotations

import argparse
import os
import sys

from benchmarks.cli import add_bench_args, run_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description="elastic's benchmarks: one JSON object per result on stdout.")
    add_bench_args(parser)
    args = parser.parse_args(argv)
    # Job files name the workload by module path; workers import it from the checkout.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
