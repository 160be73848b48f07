"""Module buffers (BatchNorm's running statistics) are equal on every replica after every step, and
a checkpoint holds the first rank's, under DDP and FSDP: real Workers, one process per rank, gloo,
no Ray. A model without buffers issues no broadcast at all. nn.SyncBatchNorm, which torch cannot
run on a CPU, is refused before any worker starts, with what to use instead."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from elastic.checkpoint.fencing import write_fence
from elastic.checkpoint.layout import checkpoints_root, step_dir
from elastic.config import ConfigError, JobConfig
from elastic.parallel.buffers import BufferSync, check_sync_batchnorm
from elastic.parallel.strategies import STRATEGIES
from elastic.storage import Storage
from tests.spawn_ranks import rendezvous_port

pytestmark = pytest.mark.timeout(300)

WORLD, STEPS, EVERY = 3, 4, 2
HIDDEN = "64"  # the workload's MLP, narrow: the buffers' behaviour does not depend on the width


def bn_job(tmp_path, strategy="ddp", model="tests.support.workloads:build_bn_model") -> dict:
    return {"run": {"name": "bn", "num_steps": STEPS, "seed": 5},
            "scaling": {"num_workers": WORLD},
            "checkpoint": {"storage_uri": f"file://{tmp_path}", "every_steps": EVERY},
            "train": {"model": model, "dataset": "elastic.workload:build_dataset",
                      "loss": "elastic.workload:loss_fn", "global_batch_size": 48, "strategy": strategy}}


def _rank(rank, world, job_json, root, port, q):
    import os
    import threading
    os.environ["ELASTIC_BENCH_HIDDEN"] = HIDDEN
    from elastic.runtime.worker import Worker
    w = Worker(job_json, root)
    w.join("127.0.0.1", port, rank, world, generation=1)
    w.restore([])
    # Collectives issued inside each step, by kind (a checkpoint's own go through DCP's wrappers,
    # outside the step); then every buffer's bytes after the step.
    calls: list[dict] = []
    for name in ("broadcast", "all_reduce"):
        real = getattr(dist, name)

        def counting(*a, _real=real, _name=name, **kw):
            # The training thread's only: a persist runs its own collectives (agreement, digests,
            # the fence) on a background thread, at times that depend on the machine's load.
            if calls and threading.current_thread() is threading.main_thread():
                calls[-1][_name] = calls[-1].get(_name, 0) + 1
            return _real(*a, **kw)
        setattr(dist, name, counting)
    buffers: list[dict] = []
    step = w.runner.train_step

    def recorded(micro):
        calls.append({})
        out = step(micro)
        buffers.append({n: b.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                        for n, b in w.model.named_buffers()})
        return out
    w.runner.train_step = recorded
    res = w.run(STEPS, [])
    q.put((rank, str(res.status), res.error, buffers, calls))
    w.leave()


def run(job: dict) -> list[tuple]:
    jc = JobConfig.model_validate(job)
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    root = checkpoints_root(jc.checkpoint.storage_uri, jc.run.name)
    write_fence(Storage(jc.checkpoint.storage_uri), root, 1)  # the controller's part: generation 1 may write
    port = rendezvous_port()
    procs = [ctx.Process(target=_rank, args=(r, WORLD, jc.model_dump_json(), root, port, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out = sorted(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert all(o[1] == "done" for o in out), [o[:3] for o in out]
    return out


def checkpoint_buffers(job: dict, step: int, out) -> dict[str, bytes]:
    """The model's buffers as the checkpoint of `step` holds them, loaded whole in this process."""
    jc = JobConfig.model_validate(job)
    folder = step_dir(checkpoints_root(jc.checkpoint.storage_uri, jc.run.name), step)
    dcp_to_torch_save(folder.removeprefix("file://"), out)
    model = torch.load(out, weights_only=False)["model"]
    return {k: v.reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in model.items()
            if k.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_replica_holds_the_first_ranks_buffers_after_every_step(tmp_path, strategy):
    job = bn_job(tmp_path, strategy)
    out = run(job)
    first = out[0][3]
    assert len(first) == STEPS and set(first[0]) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for rank, _, _, buffers, _ in out[1:]:
        assert all(b == f for b, f in zip(buffers, first)), f"rank {rank}'s buffers differ from rank 0's"
    # They moved: each step's running statistics are new (a sync that froze them would pass above).
    assert all(first[s]["1.running_mean"] != first[s + 1]["1.running_mean"] for s in range(STEPS - 1))
    # One broadcast a step, for the buffers; no other collective added to the step.
    assert all(c.get("broadcast") == 1 for _, _, _, _, calls in out for c in calls)
    # The checkpoints hold rank 0's buffers (DCP keeps one replica's copy, whichever balances the
    # ranks' writes: without the sync, another rank's).
    for step in range(EVERY, STEPS + 1, EVERY):
        saved = checkpoint_buffers(job, step, tmp_path / f"full_{step}.pt")
        assert saved and all(saved[k] == first[step - 1][k] for k in saved), f"step {step}"


def test_a_model_without_buffers_issues_no_broadcast(tmp_path):
    bn = run(bn_job(tmp_path / "bn"))
    plain = run(bn_job(tmp_path / "plain", model="elastic.workload:build_model"))
    assert all(not b for _, _, _, steps, _ in plain for b in steps)  # no buffers at all
    assert all(c.get("broadcast", 0) == 0 for _, _, _, _, calls in plain for c in calls)
    # The same all-reduces as the model with buffers: the broadcast is the only difference.
    assert [c.get("all_reduce") for c in plain[0][4]] == [c.get("all_reduce") for c in bn[0][4]]


# ---------------------------------------------------------------- without processes
class _Counters(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mask", torch.ones(2), persistent=False)


def test_only_floating_persistent_buffers_call_for_a_broadcast(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: r)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    group = object()
    assert BufferSync.of(nn.Linear(2, 2), group) is None  # no buffers
    assert BufferSync.of(_Counters(), group) is None  # an integer counter and a non-persistent mask
    bn = nn.Sequential(_Counters(), nn.BatchNorm1d(4))
    sync = BufferSync.of(bn, group)
    assert sync is not None
    # Every persistent buffer travels, the counters too; the non-persistent mask does not.
    assert [n for _, n in sync._slots] == ["count", "running_mean", "running_var", "num_batches_tracked"]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert BufferSync.of(bn, group) is None  # a group of one


def test_the_broadcast_copies_bytes_exactly(monkeypatch):
    """The source's bytes land in every buffer, whatever its dtype, shape or layout: a negative
    zero, a NaN and a non-contiguous buffer included."""
    src = nn.BatchNorm1d(3)
    with torch.no_grad():
        src.running_mean.copy_(torch.tensor([-0.0, float("nan"), 1e-40]))
        src.running_var.copy_(torch.tensor([2.0, 3.0, 4.0]))
        src.num_batches_tracked.fill_(7)
    src.register_buffer("t", torch.arange(6.0).reshape(2, 3).t())  # non-contiguous
    dst = nn.BatchNorm1d(3)
    dst.register_buffer("t", torch.zeros(2, 3).t())

    class Work:
        def wait(self):
            pass
    sent = {}

    def broadcast(flat, src, group, async_op):
        sent["flat"] = flat.clone()
        return Work()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: r)
    monkeypatch.setattr(dist, "broadcast", broadcast)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    BufferSync.of(src, object()).sync()
    payload = sent["flat"]
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    receiving = BufferSync.of(dst, object())
    work, flat, bufs = receiving.launch()
    flat.copy_(payload)  # what the broadcast leaves on the receiving rank
    receiving.finish((work, flat, bufs))
    for (name, a), (_, b) in zip(src.named_buffers(), dst.named_buffers()):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.contiguous().reshape(-1).view(torch.uint8).tolist() == b.contiguous().reshape(-1).view(torch.uint8).tolist(), name


def sync_bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.SyncBatchNorm(8), nn.ReLU(), nn.Linear(8, 2))


def _job(strategy: str, use_gpu: bool = False) -> JobConfig:
    return JobConfig.model_validate({
        "run": {"name": "s", "num_steps": 2}, "scaling": {"num_workers": 2, "use_gpu": use_gpu},
        "checkpoint": {"storage_uri": "file:///tmp/unused"},
        "train": {"model": "tests.test_buffers:sync_bn_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "global_batch_size": 8, "strategy": strategy,
                  **({"pipeline": {"stages": 2, "microbatches": 2, "loss": "elastic.workload:loss_fn"}}
                     if strategy == "pipeline" else {})}})


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "pipeline"])
def test_sync_batchnorm_is_refused_on_cpu_with_what_to_use_instead(strategy):
    with pytest.raises(ValueError) as e:
        STRATEGIES[strategy].check_job(_job(strategy), sync_bn_model)
    msg = str(e.value)
    assert "train.model" in msg and "nn.SyncBatchNorm at ['1']" in msg and "nn.BatchNorm1d/2d/3d" in msg


def test_sync_batchnorm_is_allowed_on_a_gpu_except_in_a_pipeline():
    check_sync_batchnorm(_job("ddp", use_gpu=True), sync_bn_model(), "ddp")
    check_sync_batchnorm(_job("fsdp", use_gpu=True), sync_bn_model(), "fsdp")
    with pytest.raises(ValueError, match="other stages never run that layer"):
        check_sync_batchnorm(_job("pipeline", use_gpu=True), sync_bn_model(), "pipeline")


def test_the_trainer_refuses_sync_batchnorm_before_any_worker_starts(tmp_path):
    from elastic import Trainer
    job = _job("ddp").model_dump()
    job["checkpoint"]["storage_uri"] = f"file://{tmp_path}"
    with pytest.raises(ConfigError, match="SyncBatchNorm"):
        Trainer(job)
