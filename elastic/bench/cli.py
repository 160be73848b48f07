"""`elastic bench <name>`: benchmarks that print one JSON object per result."""
from __future__ import annotations


def add_bench_args(p) -> None:
    p.add_argument("name", choices=["recovery", "straggler", "resize"], help="which benchmark")
    p.add_argument("--reps", type=int, default=3, help="repetitions per system")
    p.add_argument("--out", default=None, help="also write results.jsonl, results.md and a plot here")
    p.add_argument("--systems", default=None,
                   help="recovery, resize: comma-separated systems to compare (default: all of that benchmark's)")
    p.add_argument("--storage", choices=["file", "s3"], default="file", help="checkpoint storage under test")
    p.add_argument("--fault", default="kill_node",
                   help="recovery: kill_node (sockets close), freeze_node (silence, as a power loss), or both "
                        "comma-separated (interleaved in one run)")


def run_bench(args) -> int:
    if args.name == "resize":
        from elastic.bench.resize import main as resize_main
        return resize_main(args)
    if args.name == "straggler":
        from elastic.bench.straggler import main as straggler_main
        return straggler_main(args)
    from elastic.bench.recovery import main as recovery_main
    return recovery_main(args)
