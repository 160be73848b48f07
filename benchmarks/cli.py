"""`python -m benchmarks <name>`: benchmarks that print one JSON object per result."""
from __future__ import annotations


def add_bench_args(p) -> None:
    p.add_argument("name", choices=["recovery", "straggler", "resize", "controller", "churn", "pipeline", "overhead", "checkpoint",
                                     "data", "parallel"],
                   help="which benchmark")
    p.add_argument("--reps", type=int, default=3, help="repetitions per system")
    p.add_argument("--reps-large", type=int, default=1,
                   help="recovery, overhead: repetitions per system at 50 M parameters and more, where one run takes minutes")
    p.add_argument("--out", default=None, help="also write results.jsonl, results.md and a plot here")
    p.add_argument("--systems", default=None,
                   help="recovery, resize, churn, pipeline, data (its modes): comma-separated systems to compare "
                        "(default: all of that benchmark's)")
    p.add_argument("--storage", choices=["file", "s3"], default="file", help="checkpoint storage under test")
    p.add_argument("--fault", default="kill_node",
                   help="recovery: kill_node (sockets close), freeze_node (silence, as a power loss), or both "
                        "comma-separated (interleaved in one run); with --gpu: kill_process (the rank's process "
                        "is killed, its node and GPU stay)")
    p.add_argument("--params", default=None,
                   help="recovery: model sizes in parameters, comma-separated (900K, 9M, 90M: about 10 MB, 100 MB, "
                        "1 GB of model + AdamW state); default: the common workload's 1.3 M")
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp",
                   help="recovery: what every system trains with: ddp (default) or fsdp (elastic: FSDP2 with its "
                        "in-memory copies; Ray Train: FSDP2 and distributed checkpointing)")
    p.add_argument("--mtbf-s", type=float, default=30.0, help="churn: mean time between faults, seconds")
    p.add_argument("--duration-s", type=float, default=600.0, help="churn: length of the fault schedule, seconds")
    p.add_argument("--replace-after-s", type=float, default=10.0,
                   help="churn: a lost node is replaced by a fresh one this long after the fault")
    p.add_argument("--fault-free-s", type=float, default=30.0,
                   help="churn: fault-free window (each system's own baseline steps/s) before the faults start")
    p.add_argument("--seed", type=int, default=0, help="churn: seed of the fault schedule (rep r uses seed + r)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved_1f1b"], default="1f1b",
                   help="pipeline: the schedule every system runs")
    p.add_argument("--gpt", default=None,
                   help="pipeline, parallel: GPT_LAYERS,GPT_DIM,GPT_CONTEXT of examples/gpt.py (the model every system "
                        "trains; default 4,64,64 for pipeline, 4,256,64 for parallel)")
    p.add_argument("--memory", action="store_true",
                   help="parallel: peak memory per rank (eager vs meta init, activation checkpointing off/on) "
                        "instead of throughput")
    p.add_argument("--gpt-sizes", default=None,
                   help="parallel --memory: model sizes as LAYERS,DIM,CONTEXT separated by ';' (default: --gpt)")
    p.add_argument("--layouts", default=None,
                   help="parallel: STRATEGY:dpDxtpT layouts, comma-separated (default "
                        "ddp:dp2xtp2,fsdp:dp2xtp2,ddp:dp4,fsdp:dp4)")
    p.add_argument("--latency-ms", default=None,
                   help="data: milliseconds a relay adds to every S3 request, one setting each, comma-separated "
                        "(0: loopback, no relay; default 0,15)")
    p.add_argument("--spare-core", action="store_true",
                   help="checkpoint: one rank on a worker node of 2 CPUs, so the background persist has a core "
                        "training does not use (default: 2 ranks on one-CPU nodes, sharing it)")
    p.add_argument("--gpu", action="store_true",
                   help="overhead, recovery: train on GPUs with NCCL, one GPU per rank (world size: the smaller of "
                        "the CPU run's and the GPUs on this machine, as NCCL refuses two ranks on one GPU)")
    p.add_argument("--hidden", default=None,
                   help="overhead, checkpoint: hidden widths of the MLP, one model size each (1024: 1.3 M parameters, "
                        "3072: 10.3 M, 10000: 102.7 M; default 1024,3072,10000 for overhead, 3072,10000 for checkpoint, "
                        "one width for data, default 3072)")


def run_bench(args) -> int:
    if args.name == "data":
        from benchmarks.data import main as data_main
        return data_main(args)
    if args.name == "checkpoint":
        from benchmarks.checkpoint import main as checkpoint_main
        return checkpoint_main(args)
    if args.name == "overhead":
        from benchmarks.overhead import main as overhead_main
        return overhead_main(args)
    if args.name == "pipeline":
        from benchmarks.pipeline import main as pipeline_main
        args.gpt = args.gpt or "4,64,64"
        return pipeline_main(args)
    if args.name == "parallel":
        from benchmarks.parallel import main as parallel_main
        args.gpt = args.gpt or "4,256,64"
        return parallel_main(args)
    if args.name == "churn":
        from benchmarks.churn import main as churn_main
        return churn_main(args)
    if args.name == "controller":
        from benchmarks.controller import main as controller_main
        return controller_main(args)
    if args.name == "resize":
        from benchmarks.resize import main as resize_main
        return resize_main(args)
    if args.name == "straggler":
        from benchmarks.straggler import main as straggler_main
        return straggler_main(args)
    from benchmarks.recovery import main as recovery_main
    return recovery_main(args)
