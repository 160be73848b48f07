"""Host reads and aten operators per steady-state step: a real elastic worker's step (no Ray: join,
restore, run, as tests/spawn_ranks.py builds one) against torch DDP's loop (as
`benchmarks/plain_ddp.py` writes it), in this process, world size 1, on the overhead benchmark's
MLP and data with the same optimizer: fused AdamW unless `--optimizer` names another.

A host read is the host reading a device tensor's value, which on a GPU waits for the stream:
`_local_scalar_dense` (`.item()`, `bool()`, `int()`, `float()`), `.tolist()`, `.numpy()`,
`.cpu()` / `.to("cpu")` and a blocking `copy_` into a host tensor, and the operators whose output
size depends on values (`nonzero`, `masked_select`, `unique`). On a CPU every tensor is a host
tensor, so the probe counts what the step would read of its device tensors: every tensor is taken
for a device tensor except the host ones, which are the destinations of non-blocking copies (a
step's copy into pinned memory, read later) and what torch keeps on the host on a GPU too (a
non-fused optimizer's step counters). On a GPU (`--device cuda`) a tensor's device says it.

Per step: the difference between a run of 2K steps and one of K (after a warm-up), so what a run
pays once (its last step's checkpoint and digest) cancels out. Operators are every aten operator
the training thread (and autograd's) dispatches, views included.

    python -m benchmarks.probes.host_syncs [--optimizer adamw-fused] [--hidden 1024] [--steps 8]
    python -m benchmarks.probes.host_syncs --device cuda --sync-debug error     # on a GPU
    python -m benchmarks.probes.host_syncs --metrics    # the loss returns (loss, {name: tensor})

Prints one JSON line: `host_reads_per_step` (elastic's), `ops_ratio` (elastic's aten operators per
step / torch DDP's), the same figures of each side, and where elastic's reads and extra operators
come from.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
import threading
import traceback

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten

# Operators that read values on the host (or size their output by them): a sync on a GPU.
READ_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.nonzero.default,
            aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten.repeat_interleave.Tensor}

# --optimizer NAME -> the job's `train.optimizer` (a function of this module).
OPTIMIZERS = {"adamw-fused": "adamw_fused", "adam-fused": "adam_fused", "sgd-fused": "sgd_fused",
              "adamw": "adamw", "adam": "adam", "sgd": "sgd"}
FUSED = {"adamw-fused", "adam-fused", "sgd-fused"}


def adamw_fused(params):
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def adam_fused(params):
    return torch.optim.Adam(params, lr=1e-3, fused=True)


def sgd_fused(params):
    return torch.optim.SGD(params, lr=0.002, momentum=0.9, fused=True)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)  # torch's default: foreach


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def sgd(params):
    return torch.optim.SGD(params, lr=0.002, momentum=0.9)


def loss_with_metrics(model, batch):
    """The workload's loss, and two metrics beside it as a user returns them (--metrics)."""
    x, y = batch
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    return loss, {"accuracy": (logits.argmax(1) == y).float().mean(), "loss_copy": loss.detach()}


class HostReads(TorchDispatchMode):
    """Counts, on the thread that enters it (and autograd's), every aten operator and every host
    read of a device tensor, with where each read came from. `host(t)` marks a tensor's memory as
    host memory (on a CPU; on a GPU the device says it)."""

    def __init__(self, gpu: bool = False):
        super().__init__()
        self.gpu = gpu
        self.ops: collections.Counter = collections.Counter()
        self.reads: collections.Counter = collections.Counter()  # "file:line in function: what" -> count
        self._host: dict[int, torch.Tensor] = {}  # storage address -> a tensor holding it (kept alive)
        self._saved: dict = {}

    # ---------------------------------------------------------------- what is a device tensor
    def host(self, t: torch.Tensor) -> None:
        if not self.gpu and isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
            ptr = _address(t)
            if ptr is not None:
                self._host[ptr] = t

    def on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.gpu or t.device.type != "cpu":
            return t.device.type != "cpu"
        return _address(t) not in self._host

    def mark_data(self, dataset, depth: int = 2) -> None:
        """The dataset's tensors (and those of the objects it holds) are host memory: a step
        copies its batch to the device."""
        for v in vars(dataset).values():
            if isinstance(v, torch.Tensor):
                self.host(v)
            elif depth > 1 and hasattr(v, "__dict__"):
                self.mark_data(v, depth - 1)

    def mark_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """A non-fused, non-capturable optimizer keeps its step counters on the host, on a GPU too."""
        for group in optimizer.param_groups:
            if group.get("fused") or group.get("capturable"):
                continue
            for p in group["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    self.host(step)

    # ---------------------------------------------------------------- counting
    def read(self, what: str) -> None:
        self.reads[f"{_where()}: {what}"] += 1

    @property
    def num_reads(self) -> int:
        return sum(self.reads.values())

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in READ_OPS and ins[:1] and self.on_device(ins[0]):
            self.read(func.__name__)
        elif func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if non_blocking:
                self.host(dst)  # a copy out to pinned memory, read later (on a CPU: marked host)
            elif self.on_device(src) and not self.on_device(dst):
                self.read("copy_ to the host")
        elif func is aten._to_copy.default and self.gpu:
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cpu" and self.on_device(args[0]) \
                    and not kwargs.get("non_blocking", False):
                self.read("to the host")
        out = func(*args, **kwargs)
        # Host work (the data path), tensors made from Python values (on a GPU, made on the host
        # first) and drawn from a CPU generator (a sample order's permutation): host memory too.
        gen = kwargs.get("generator")
        host_only = (func is aten.lift_fresh.default or (gen is not None and gen.device.type == "cpu")
                     or bool(ins) and not any(self.on_device(t) for t in ins))
        if host_only and not self.gpu:
            for t in pytree.tree_leaves(out):
                self.host(t)
        elif func.namespace == "aten" and not host_only:
            self.ops[str(func)] += 1
        return out

    # On a CPU `.cpu()`, `.to("cpu")`, `.tolist()` and `.numpy()` dispatch nothing: watched here.
    def __enter__(self):
        if not self.gpu:
            mode = self
            saved = self._saved = {n: getattr(torch.Tensor, n) for n in ("cpu", "tolist", "numpy", "to")}
            thread = threading.get_ident()  # the patches are process-wide, the mode is this thread's

            def watched(t) -> bool:
                return threading.get_ident() == thread and mode.on_device(t)

            def cpu(t, *a, **k):
                if not watched(t):
                    return saved["cpu"](t, *a, **k)
                mode.read(".cpu()")
                with _disable_current_modes():
                    out = t.clone()  # a new host tensor, as on a GPU
                mode.host(out)
                return out

            def to(t, *a, **k):
                # Only the string: on a CPU the step's own device is torch.device("cpu") too, and
                # `.to(device)` is a move to the device, not to the host.
                target = k.get("device", a[0] if a else None)
                if target == "cpu" and not k.get("non_blocking", False) and watched(t):
                    return cpu(t)
                return saved["to"](t, *a, **k)

            def reader(name):
                def f(t, *a, **k):
                    if watched(t):
                        mode.read(f".{name}()")
                    return saved[name](t, *a, **k)
                return f

            torch.Tensor.cpu, torch.Tensor.to = cpu, to
            torch.Tensor.tolist, torch.Tensor.numpy = reader("tolist"), reader("numpy")
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        self._saved = {}
        return super().__exit__(*exc)


def _address(t: torch.Tensor) -> int | None:
    """Where a tensor's memory is; None for one without its own (a DTensor, a freed FSDP buffer),
    which counts as device memory."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _where() -> str:
    """The innermost frame of the step's own code (elastic/, benchmarks/, tests/) outside this file."""
    here = os.path.abspath(__file__)
    for f in reversed(traceback.extract_stack()):
        path = os.path.abspath(f.filename)
        if path != here and any(f"{os.sep}{d}{os.sep}" in path for d in ("elastic", "benchmarks", "tests")):
            return f"{os.path.relpath(path)}:{f.lineno} in {f.name}"
    return "torch"


def counted(mode: HostReads, fn) -> HostReads:
    with mode:
        fn()
    return mode


def per_step(run, k: int, gpu: bool, optimizer, dataset) -> tuple[float, float, dict, dict]:
    """(reads, ops, reads by place, ops by name) per step: a run of 2k steps less one of k."""
    out = []
    for n in (k, 2 * k):
        mode = HostReads(gpu)
        mode.mark_optimizer(optimizer)
        mode.mark_data(dataset)
        out.append(counted(mode, lambda n=n: run(n)))
    a, b = out

    def diff(x: collections.Counter, y: collections.Counter) -> dict:
        return {key: (y[key] - x[key]) / k for key in set(x) | set(y) if y[key] != x[key]}

    return (b.num_reads - a.num_reads) / k, (b.num_ops - a.num_ops) / k, diff(a.reads, b.reads), diff(a.ops, b.ops)


# ---------------------------------------------------------------- the two systems
def elastic_worker(args, gpu: bool):
    from benchmarks.overhead import HIDDEN_ENV, elastic_job
    from benchmarks.probes.no_ray import prepare, start_rank
    os.environ[HIDDEN_ENV] = str(args.hidden)  # the job's model (workload.build_model) reads its width here
    work = tempfile.mkdtemp(prefix="host-syncs-")
    job = elastic_job(args.hidden, 10 ** 7, "file://" + work, num_workers=1, gpu=gpu)
    job["checkpoint"]["every_steps"] = 10 ** 7
    job["train"]["optimizer"] = f"benchmarks.probes.host_syncs:{OPTIMIZERS[args.optimizer]}"
    if args.metrics:
        job["train"]["loss"] = "benchmarks.probes.host_syncs:loss_with_metrics"
    job_json, root, store = prepare(job)
    w = start_rank(job_json, root, store.address()[1])
    w.restore([])
    return w, store  # the rendezvous store must live as long as the worker


def elastic_run(w, sync_debug: str | None):
    """run(n): n more steps of the worker's own run loop (each run ends with a checkpoint)."""
    if sync_debug:
        step = w.runner.train_step

        def guarded(micro):
            torch.cuda.set_sync_debug_mode(sync_debug)
            try:
                return step(micro)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        w.runner.train_step = guarded

    def run(n: int) -> None:
        target = w.step + n
        res = w.run(target, [])
        if res.status != "done" or w.step != target:
            raise RuntimeError(f"elastic's run ended {res.status} at step {w.step}: {res.error}")
    return run


def ddp_loop(args, device: torch.device, sync_debug: str | None):
    """run(n) for torch DDP's loop on the default group, its optimizer and its dataset."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import default_collate

    from benchmarks.overhead import GLOBAL_BATCH, SEED
    from elastic import workload
    from elastic.data.order import GlobalOrder

    torch.manual_seed(SEED)
    if device.type == "cuda":
        model = DDP(workload.build_mlp(args.hidden).to(device), device_ids=[device.index],
                    gradient_as_bucket_view=True)
    else:
        model = DDP(workload.build_mlp(args.hidden), gradient_as_bucket_view=True)
    optimizer = globals()[OPTIMIZERS[args.optimizer]](model.parameters())
    dataset = workload.build_dataset()
    order = GlobalOrder(len(dataset), SEED)
    state = {"step": 0}

    def run(n: int) -> None:
        for _ in range(n):
            idx = order.rank_indices(state["step"], GLOBAL_BATCH, 1, 0)
            batch = default_collate([dataset[j] for j in idx])
            with (_sync_debug(sync_debug) if sync_debug else contextlib.nullcontext()):
                if device.type == "cuda":
                    batch = [t.to(device, non_blocking=True) for t in batch]
                optimizer.zero_grad(set_to_none=True)
                workload.loss_fn(model, batch).backward()
                optimizer.step()
            state["step"] += 1
    return run, optimizer, dataset


@contextlib.contextmanager
def _sync_debug(level: str):
    torch.cuda.set_sync_debug_mode(level)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def measure(args) -> dict:
    gpu = args.device == "cuda"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    from benchmarks.overhead import num_params
    w, _store = elastic_worker(args, gpu)
    run_e = elastic_run(w, args.sync_debug)
    run_e(args.warmup)
    run_e(1)  # a second run: some of a run's end happens once more after the first (its staging)
    e_reads, e_ops, e_where, e_by_op = per_step(run_e, args.steps, gpu, w.optimizer, w.dataset)
    run_d, opt_d, data_d = ddp_loop(args, device, args.sync_debug)
    run_d(args.warmup)
    d_reads, d_ops, d_where, d_by_op = per_step(run_d, args.steps, gpu, opt_d, data_d)
    extra = {k: round(e_by_op.get(k, 0) - d_by_op.get(k, 0), 2) for k in set(e_by_op) | set(d_by_op)}
    extra = dict(sorted(((k, v) for k, v in extra.items() if v), key=lambda kv: -abs(kv[1]))[:25])
    w.leave()
    return {"probe": "host_syncs", "device": args.device, "sync_debug": args.sync_debug,
            "torch": torch.__version__, "optimizer": args.optimizer, "hidden": args.hidden,
            "metrics": args.metrics,
            "params": num_params(args.hidden), "steps": args.steps, "warmup": args.warmup,
            "host_reads_per_step": e_reads, "ops_ratio": round(e_ops / d_ops, 4) if d_ops else None,
            "elastic_ops_per_step": e_ops, "torch_ddp_ops_per_step": d_ops,
            "torch_ddp_host_reads_per_step": d_reads,
            "elastic_reads": {k: round(v, 3) for k, v in sorted(e_where.items())},
            "torch_ddp_reads": {k: round(v, 3) for k, v in sorted(d_where.items())},
            "extra_ops_per_step": extra}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.host_syncs", description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw-fused")
    p.add_argument("--hidden", type=int, default=1024, help="the MLP's hidden width (1024: 1.3 M parameters)")
    p.add_argument("--steps", type=int, default=8, help="K: per step = (a run of 2K steps - one of K) / K")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--sync-debug", choices=("warn", "error"), default=None,
                   help="with --device cuda: torch.cuda.set_sync_debug_mode during every counted step")
    p.add_argument("--metrics", action="store_true",
                   help="elastic's loss function returns two metrics beside the loss")
    args = p.parse_args(argv)
    if args.hidden < 1 or args.steps < 1 or args.warmup < 1:
        p.error("--hidden, --steps and --warmup must be >= 1")
    if args.sync_debug and args.device != "cuda":
        p.error("--sync-debug needs --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device on this machine")
    print(json.dumps(measure(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
