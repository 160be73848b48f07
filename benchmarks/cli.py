"""`python -m benchmarks NAME [options]`: one subcommand per benchmark, each with its own options
(`python -m benchmarks NAME --help`); every benchmark prints one JSON object per result."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

# name -> (what it measures, the module whose main(args) runs it)
BENCHMARKS = {
    "recovery": ("fault to the first step after it, against Ray Train (and torchft)", "benchmarks.recovery"),
    "straggler": ("whole-run steps/s with one rank slowed, swapped for a spare", "benchmarks.straggler"),
    "resize": ("shrink and grow of a running job, live re-sharding against a restart", "benchmarks.resize"),
    "controller": ("the controller's own cost at 1,000 to 100,000 simulated ranks (no Ray)", "benchmarks.controller"),
    "churn": ("goodput under random node faults, against Ray Train", "benchmarks.churn"),
    "pipeline": ("pipeline-parallel throughput against plain torch.distributed.pipelining", "benchmarks.pipeline"),
    "overhead": ("steady-state steps/s against plain DDP/FSDP scripts", "benchmarks.overhead"),
    "checkpoint": ("what a checkpoint costs training: stall and persist", "benchmarks.checkpoint"),
    "data": ("Parquet on S3: read time hidden behind compute", "benchmarks.data"),
    "parallel": ("tensor, fully sharded and data parallel layouts: throughput, or peak memory", "benchmarks.parallel"),
    "compression": ("gradient compression modes: bytes per step, steps/s, loss curve (no Ray)",
                    "benchmarks.compression"),
}


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    kwargs: dict
    used_by: tuple[str, ...]  # the benchmarks that read it
    default: object = field(default=None)

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.flags[0].lstrip("-").replace("-", "_")


def _opt(*flags: str, used_by: tuple[str, ...], **kwargs) -> Option:
    return Option(flags, kwargs, used_by, kwargs.get("default", False if kwargs.get("action") == "store_true" else None))


ALL = tuple(BENCHMARKS)
OPTIONS = (
    _opt("--reps", type=int, default=3, help="repetitions per system",
         used_by=tuple(n for n in ALL if n != "checkpoint")),
    _opt("--reps-large", type=int, default=1,
         help="repetitions per system at 50 M parameters and more, where one run takes minutes",
         used_by=("recovery", "overhead")),
    _opt("--out", default=None, help="also write results.jsonl, results.md and a plot here", used_by=ALL),
    _opt("--systems", default=None, help="comma-separated systems (for data: modes) to compare (default: all of them)",
         used_by=("recovery", "resize", "churn", "pipeline", "overhead", "data", "parallel",
                  "compression")),
    _opt("--storage", choices=["file", "s3"], default="file", help="checkpoint storage under test",
         used_by=("recovery", "resize", "pipeline")),
    _opt("--fault", default="kill_node",
         help="kill_node (sockets close), freeze_node (silence, as a power loss), kill_process (the rank's process "
              "is killed, its node stays), comma-separated (interleaved in one run); with --gpu: kill_process only",
         used_by=("recovery",)),
    _opt("--params", default=None,
         help="model sizes in parameters, comma-separated (900K, 9M, 90M: about 10 MB, 100 MB, 1 GB of model + AdamW "
              "state); default: the common workload's 1.3 M", used_by=("recovery", "resize")),
    _opt("--strategy", choices=["ddp", "fsdp"], default="ddp",
         help="what every system trains with: ddp (default) or fsdp (elastic: FSDP2 with its in-memory copies; "
              "Ray Train: FSDP2 and distributed checkpointing; straggler: elastic's strategy)",
         used_by=("recovery", "straggler")),
    _opt("--copy-budget", type=float, default=None,
         help="elastic's checkpoint.memory_max_overhead with --strategy fsdp: the share of step time the in-memory "
              "copies may cost (1: a copy every step, whatever it costs; default: the job's, 0.03)",
         used_by=("recovery",)),
    _opt("--copy-sync", action="store_true",
         help="elastic's checkpoint.memory_sync with --strategy fsdp (recovery) or --tp (pipeline's stage loss): a "
              "copy every step, each at its buddy before the step is reported (no step redone after a fault)",
         used_by=("recovery", "pipeline")),
    _opt("--mtbf-s", type=float, default=30.0, help="mean time between faults, seconds", used_by=("churn",)),
    _opt("--duration-s", type=float, default=600.0, help="length of the fault schedule, seconds", used_by=("churn",)),
    _opt("--replace-after-s", type=float, default=10.0,
         help="a lost node is replaced by a fresh one this long after the fault", used_by=("churn",)),
    _opt("--fault-free-s", type=float, default=30.0,
         help="fault-free window (each system's own baseline steps/s) before the faults start", used_by=("churn",)),
    _opt("--seed", type=int, default=0, help="seed of the fault schedule (rep r uses seed + r)", used_by=("churn",)),
    _opt("--schedule", choices=["gpipe", "1f1b", "interleaved_1f1b"], default="1f1b",
         help="the schedule every system runs", used_by=("pipeline",)),
    _opt("--tp", type=int, default=1,
         help="pipeline: tensor-parallel ranks per stage (the built-in plan in every system; throughput layouts "
              "that do not fit the cluster's 4 one-CPU nodes are left out; stage loss: 2 stages x 1 replica x tp, "
              "the node of stage 0's whole tp group killed); "
              "recovery: 2 trains examples/gpt.py at dp 2 x tp 2 and kills the node of a whole tp group",
         used_by=("pipeline", "recovery")),
    _opt("--gpt", default=None,
         help="GPT_LAYERS,GPT_DIM,GPT_CONTEXT of examples/gpt.py, the model every system trains (default 4,64,64 "
              "for pipeline, 4,256,64 for parallel and recovery --tp)", used_by=("pipeline", "parallel", "recovery")),
    _opt("--memory", action="store_true",
         help="peak memory per rank per layout (eager vs meta init, activation checkpointing off/on) instead of "
              "throughput",
         used_by=("parallel",)),
    _opt("--gpt-sizes", default=None, help="with --memory: model sizes as LAYERS,DIM,CONTEXT separated by ';' "
                                           "(default: --gpt)", used_by=("parallel",)),
    _opt("--world-sizes", default=None,
         help="with --memory: ranks per run, comma-separated (e.g. 2,4,8): per-rank peak memory over the "
              "interpreter's baseline against the 1/N bound, FSDP with meta init, copies and staging off and on",
         used_by=("parallel",)),
    _opt("--layouts", default=None,
         help="STRATEGY:dpDxtpT[+sp] layouts, comma-separated; +sp: sequence parallelism (default "
              "ddp:dp2xtp2,fsdp:dp2xtp2,ddp:dp4,fsdp:dp4; with --memory fsdp:dp4)",
         used_by=("parallel",)),
    _opt("--latency-ms", default=None,
         help="milliseconds a relay adds to every S3 request, one setting each, comma-separated (0: loopback, no "
              "relay; default 0,15)", used_by=("data",)),
    _opt("--spare-core", action="store_true",
         help="one rank on a worker node of 2 CPUs, so the background persist has a core training does not use "
              "(default: 2 ranks on one-CPU nodes, sharing it)", used_by=("checkpoint",)),
    _opt("--gpu", action="store_true",
         help="train on GPUs with NCCL, one GPU per rank (world size: the smaller of the CPU run's and the GPUs on "
              "this machine, as NCCL refuses two ranks on one GPU)", used_by=("overhead", "recovery")),
    _opt("--hidden", default=None,
         help="hidden widths of the MLP, one model size each (1024: 1.3 M parameters, 3072: 10.3 M, 10000: "
              "102.7 M; default 1024,3072,10000 for overhead, 3072,10000 for checkpoint, one width for data, "
              "default 3072; compression: one width, default 1024)",
         used_by=("overhead", "checkpoint", "data", "compression")),
    _opt("--workers", type=int, default=2, help="gloo ranks (processes on this machine)",
         used_by=("compression",)),
    _opt("--steps", type=int, default=60, help="training steps per mode", used_by=("compression",)),
    _opt("--ranks", default=None, help="simulated ranks, comma-separated (default 1000,10000)",
         used_by=("controller",)),
    _opt("--ranks-per-node", type=int, default=8,
         help="simulated ranks on each node, each node polled through its agent (default 8, as on a GPU node)",
         used_by=("controller",)),
)
DEFAULT_GPT = {"pipeline": "4,64,64", "parallel": "4,256,64"}


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """One subcommand per benchmark (`name` in the parsed args), each with the options it reads;
    the others are set to their defaults, so every benchmark's main sees the same fields."""
    sub = p.add_subparsers(dest="name", required=True, metavar="NAME", help="which benchmark")
    for name, (what, _) in BENCHMARKS.items():
        bp = sub.add_parser(name, help=what, description=what, allow_abbrev=False)  # --fault is not --fault-free-s
        mine = [o for o in OPTIONS if name in o.used_by]
        for o in mine:
            bp.add_argument(*o.flags, **o.kwargs)
        bp.set_defaults(**{o.dest: o.default for o in OPTIONS if o not in mine})


def run_bench(args) -> int:
    import importlib
    if args.name in DEFAULT_GPT:
        args.gpt = args.gpt or DEFAULT_GPT[args.name]
    return importlib.import_module(BENCHMARKS[args.name][1]).main(args)
