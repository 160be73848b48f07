"""`python -m benchmarks parallel --memory --world-sizes 2,4,8`: does each rank's memory fall as
1/N? (issue 55 item 6). FSDP with `train.meta_init` over N real gloo ranks (forked processes, no
Ray), with the in-memory copies and checkpoint staging off, then on.

Per rank: the interpreter's own baseline (VmRSS once torch, the worker and its process group are
up, before the model), the peak over the run (VmHWM, its mark reset at the baseline), and the
whole state (weights + gradients + optimizer moments, summed over the ranks). The bound (issue
55): off, peak - baseline <= 1.25 x state/N + one gathered block + activations; on, 2.5 x
state/N + the same (the rank's shard, one staging copy that also serves as the copy sent to the
buddy, and the buddy's copy received). One gathered block: the largest FSDP unit's parameters at
full size. Activations: the bytes the first step's forward saved for backward (autograd's saved
tensors, the weights left out), counted on the rank.

"Off": no checkpoint and no copy in the measured steps (checkpoint.memory_every_steps 0, the
worker's checkpoint save left out): what training alone holds. "On": a checkpoint every step
(its staging copy) and checkpoint.memory_sync with a copy every step, each rank's buddy the next
rank (copies rank to rank over gloo: the one copy path that needs no Ray).
"""
from __future__ import annotations

import os
import statistics

import torch

from benchmarks.output import emit, scratch_dir, write_report
from benchmarks.pipeline import gpt_env

MIB = 2 ** 20
BATCH, STEPS = 16, 3
BOUND = {False: 1.25, True: 2.5}  # x state/N, for copies and staging off / on


def parse_world_sizes(arg: str) -> list[int]:
    """'2,4,8' -> [2, 4, 8]; ValueError naming the flag for anything but integers >= 2."""
    try:
        sizes = [int(x) for x in arg.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2:
        raise ValueError(f"--world-sizes: expected ranks per run as integers >= 2, comma-separated "
                         f"(e.g. 2,4,8: FSDP shards over at least 2 ranks), got {arg!r}")
    return sizes


def memory_job(world: int, copies: bool, storage_uri: str) -> dict:
    return {"run": {"name": "mem", "num_steps": STEPS, "seed": 0},
            "scaling": {"num_workers": world},
            "checkpoint": {"storage_uri": storage_uri, "every_steps": 1 if copies else 100,
                           "memory_every_steps": 1 if copies else 0, "memory_sync": copies},
            "train": {"model": "examples.gpt:build_model",
                      "dataset": "examples.gpt:build_dataset", "loss": "examples.gpt:loss_fn",
                      "global_batch_size": BATCH, "strategy": "fsdp", "meta_init": True}}


def bound_mib(state_mib: float, world: int, block_mib: float, act_mib: float,
              copies: bool) -> float:
    return BOUND[copies] * state_mib / world + block_mib + act_mib


# ---------------------------------------------------------------- inside a rank
def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _state_bytes(w) -> int:
    """This rank's weights, their gradients (as large: FSDP keeps them sharded alike) and the
    optimizer's moments (its per-parameter tensors, the step counters left out)."""
    params = sum(_local_bytes(p) for p in w.model.parameters())
    moments = sum(_local_bytes(t) for s in w.optimizer.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0)
    return 2 * params + moments


def _largest_block_bytes(model) -> int:
    """The largest FSDP unit's own parameters at full size: what one all-gather materialises."""
    from torch.distributed.fsdp import FSDPModule

    def own(unit) -> int:
        inner = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)
                 for p in m.parameters()}
        return sum(p.numel() * p.element_size() for p in unit.parameters() if id(p) not in inner)
    return max(own(m) for m in model.modules() if isinstance(m, FSDPModule))


class _SavedBytes:
    """Bytes autograd saves for backward (each storage once), the weights left out: a Linear
    saves its weight (under FSDP the gathered block's, counted as the block, not here)."""

    def __init__(self, model):
        self.model = model
        self.seen: dict[int, int] = {}

    def pack(self, t):
        ptr = _storage(t)
        weights = {_storage(p, (0, 0))[0] for p in self.model.parameters()}
        if ptr is not None and ptr[0] not in weights:
            self.seen[ptr[0]] = ptr[1]
        return t


def _storage(t: torch.Tensor, default=None) -> tuple[int, int] | None:
    """(address, bytes) of a plain tensor's storage; `default` for a DTensor (a shard, not
    gathered) or a storage FSDP has freed."""
    if hasattr(t, "to_local"):
        return default
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except RuntimeError:
        return default


def _as_before() -> None:
    """The staging as it was before issue 55 (the "before" build): every checkpoint's snapshot
    of FSDP's shards a fresh copy (made while the last one is still held), none prestaged, and
    none taken from the step's in-memory copy."""
    from elastic.checkpoint import persister
    from elastic.runtime.memory_copies import MemoryCopies
    fresh = persister.snapshot
    persister.snapshot = lambda state, reuse=None: fresh(state, None)
    persister.staging_for = lambda state: None
    MemoryCopies._share_with_checkpoint = lambda *a: None


def rank_main(rank, world, job_json, root, port, copies, build, env, q):
    os.environ.update(env)
    from elastic.runtime.actor import import_worker
    worker_cls = import_worker()
    if build == "before":
        _as_before()
    w = worker_cls(job_json, root)
    w.join("127.0.0.1", port, rank, world, generation=1)
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here: the peak of what this run adds
    w.restore([])
    built = _status("VmHWM")
    if not copies:
        w._save = lambda tr, saved: saved  # training alone: no checkpoint, so no staging copy
        w.ckpt.needs_staging = lambda: False
    buddy = ((rank + 1) % world, None) if copies else None
    holds = ((rank - 1) % world,) if copies else ()
    saved = _SavedBytes(w.model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        res = w.run(1, [], buddy=buddy, holds_for=holds)
    if res.status.value == "done":
        res = w.run(STEPS, [], buddy=buddy, holds_for=holds)
    q.put((rank, res.status.value, res.error, {
        "baseline_mib": baseline, "build_peak_mib": built, "peak_mib": _status("VmHWM"),
        "state_mib": _state_bytes(w) / MIB, "block_mib": _largest_block_bytes(w.model) / MIB,
        "activations_mib": sum(saved.seen.values()) / MIB,
        "snapshot_is_the_copy": w.ckpt.shares_copies}))
    w.leave()


# ---------------------------------------------------------------- the benchmark
def run_once(size: str, world: int, copies: bool, env: dict[str, str],
             build: str = "after") -> list[dict]:
    """One run of `world` ranks; per rank its figures."""
    from elastic.checkpoint.fencing import write_fence
    from elastic.checkpoint.layout import checkpoints_root
    from elastic.config import JobConfig
    from elastic.storage import Storage
    from tests.spawn_ranks import gather_ranks, rendezvous_port

    work = scratch_dir("elastic-bench-mem-rank-")
    jc = JobConfig.model_validate(memory_job(world, copies, f"file://{work}"))
    root = checkpoints_root(jc.checkpoint.storage_uri, jc.run.name)
    write_fence(Storage(jc.checkpoint.storage_uri), root, 1)
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["benchmarks.memory_per_rank", "tests.support.rank_preload"])
    q = ctx.Queue()
    port = rendezvous_port()
    job_json = jc.model_dump_json()
    procs = [ctx.Process(target=rank_main,
                         args=(r, world, job_json, root, port, copies, build, env, q))
             for r in range(world)]
    out = gather_ranks(procs, q, timeout_s=900)
    bad = [o for o in out if o[1] != "done"]
    if bad:
        raise RuntimeError(f"ranks did not finish: {bad}")
    return [{"rank": o[0], **o[3]} for o in out]


def figures(ranks: list[dict], world: int, copies: bool) -> dict:
    """One run's record: the whole state from every rank's part, each rank's peak over its
    baseline, and the bound with whether the largest rank meets it."""
    state = sum(r["state_mib"] for r in ranks)
    block, act = max(r["block_mib"] for r in ranks), max(r["activations_mib"] for r in ranks)
    over = [r["peak_mib"] - r["baseline_mib"] for r in ranks]
    bound = bound_mib(state, world, block, act, copies)
    return {"state_mib": state, "state_per_rank_mib": state / world, "block_mib": block,
            "activations_mib": act,
            "baseline_mib": statistics.median(r["baseline_mib"] for r in ranks),
            "peak_mib": max(r["peak_mib"] for r in ranks), "over_baseline_mib": max(over),
            "over_baseline_per_state_n": max(over) / (state / world), "bound_mib": bound,
            "met": max(over) <= bound, "ranks": ranks}


def run(sizes: list[str], world_sizes: list[int], reps: int, out: str | None) -> int:
    """Per size, rep and world size: copies and staging off, then on as the code was before issue
    55 and as it is (`_as_before`), interleaved so both builds share the machine's state."""
    records = []
    for size in sizes:
        env = gpt_env(size)
        for rep in range(reps):
            for world in world_sizes:
                for copies, build in ((False, ""), (True, "before"), (True, "after")):
                    ranks = run_once(size, world, copies, env, build or "after")
                    r = {"bench": "parallel", "part": "memory_per_rank", "gpt": size,
                         "world": world, "copies_and_staging": copies, "build": build, "rep": rep,
                         **figures(ranks, world, copies)}
                    records.append(r)
                    emit(r)
    write_report(out, records, table(records), notes())
    return 0


def table(records: list[dict]) -> str:
    keys = sorted({(r["gpt"], r["world"], r["copies_and_staging"], r["build"]) for r in records})
    lines = ["| GPT | build | N | copies + staging | reps | baseline | peak RSS | "
             "peak - baseline | state | state/N | block | activations | bound | "
             "(peak - baseline) / (state/N) | met |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for gpt, world, copies, build in keys:
        rs = [r for r in records if (r["gpt"], r["world"], r["copies_and_staging"], r["build"])
              == (gpt, world, copies, build)]

        def med(k):
            return statistics.median(r[k] for r in rs)
        lines.append(f"| {gpt} | {build} | {world} | {'on' if copies else 'off'} | {len(rs)} | "
                     f"{med('baseline_mib'):.0f} | {med('peak_mib'):.0f} | "
                     f"{med('over_baseline_mib'):.0f} | {med('state_mib'):.0f} | "
                     f"{med('state_per_rank_mib'):.0f} | {med('block_mib'):.0f} | "
                     f"{med('activations_mib'):.0f} | {med('bound_mib'):.0f} | "
                     f"{med('over_baseline_per_state_n'):.2f} | "
                     f"{sum(r['met'] for r in rs)}/{len(rs)} |")
    return "\n".join(lines) + "\n"


def notes() -> str:
    return (f"MiB per rank, medians over reps; FSDP, meta init, AdamW, global batch {BATCH}, "
            f"{STEPS} steps, real gloo ranks forked without Ray; peak - baseline and the ratio are "
            f"the largest rank's; bound: {BOUND[False]} (off) or {BOUND[True]} (on) x state/N + "
            f"block + activations")
