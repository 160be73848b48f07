"""The update decided on the device (elastic/runtime/step.py). With a fused optimizer a step
reads nothing of the device: a bad step's update is masked by `found_inf`, fp16's loss scale and
clipping move on the device, and the step's statistics are read a step late. Each run here ends
bit for bit as the same run with the same kernels whose host reads the statistics before every
update (tests/support/optimizers.py), with the same steps skipped, on real Workers (gloo, a
process per rank, no Ray); each train_step's host reads are counted as
`python -m benchmarks.probes.host_syncs` counts them."""
from __future__ import annotations

import os

import pytest
import torch

from tests.spawn_ranks import run_ranks
from tests.test_training_features import FEATURES, POISON, _poisoned_steps, mlp_job

pytestmark = pytest.mark.timeout(300)

OPT = "tests.support.optimizers:"


def count_reads(w) -> list[int]:
    """From now on, each of the worker's train_step calls appends its host reads to the list."""
    from benchmarks.probes.host_syncs import HostReads
    reads: list[int] = []
    step = w.runner.train_step
    mode = HostReads()  # one for the run: what it learns is host memory (a copy out) stays so
    mode.mark_data(w.dataset)

    def counted(micro):
        mode.mark_optimizer(w.optimizer)
        before = mode.num_reads
        try:
            with mode:
                return step(micro)
        finally:
            reads.append(mode.num_reads - before)

    w.runner.train_step = counted
    return reads


def _rank(rank, world, pp, job_json, root, port, steps, env, q):
    os.environ.update(env)
    from elastic.runtime.actor import import_worker
    w = import_worker()(job_json, root)
    w.join("127.0.0.1", port, rank, world, generation=1, pp=pp)
    w.restore([])
    reads = count_reads(w)
    res = w.run(steps, [])
    q.put((rank, res.status, res.digest or res.error, w._progress["loss"], w._progress["grad_norm"],
           [s for s, _ in w.runner.skipped], reads, w.optimizer.param_groups[0]["lr"]))
    w.leave()


def _stop_rank(rank, world, pp, job_json, root, port, steps, env, q):
    """Rank 0 alone is asked to stop after step 5, as a planned change asks one rank."""
    from elastic.runtime.actor import import_worker
    w = import_worker()(job_json, root)
    w.join("127.0.0.1", port, rank, world, generation=1)
    w.restore([])
    first = w.run(5, [])
    if rank == 0:
        w.request_stop(w.generation)
    res = w.run(steps, [])
    q.put((rank, first.status, res.status, res.step, w._progress["step"]))
    w.leave()


def run_counted(job: dict, pp: int = 1, env: dict | None = None, target=_rank) -> list[tuple]:
    """Every rank of `job` in its own process, its host reads counted per train_step. Per rank:
    (rank, status, digest or error, loss, grad_norm, skipped steps, reads per step, lr)."""
    from benchmarks.probes.no_ray import prepare
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.spawn_ranks", "tests.support.rank_preload"])
    job_json, root, store = prepare(job)
    world, q = job["scaling"]["num_workers"], ctx.Queue()
    args = (world, pp, job_json, root, store.address()[1], job["run"]["num_steps"], env or {}, q)
    procs = [ctx.Process(target=target, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    out = sorted((q.get(timeout=240) for _ in procs), key=lambda o: o[0])
    for p in procs:
        p.join(timeout=60)
    return out


def _pipeline(tmp_path, **train):
    j = mlp_job(tmp_path, strategy="pipeline", **train)
    j["train"].update(loss=None, pipeline={"stages": 2, "microbatches": 2,
                                           "loss": "tests.test_training_features:mlp_stage_loss"})
    return j


def _ddp(**extra):
    return lambda path, **train: mlp_job(path, **extra, **train)


def _fsdp(**extra):
    return lambda path, **train: mlp_job(path, strategy="fsdp", **extra, **train)


CASES = {  # name: (job maker, optimizer, pipeline stages, poisoned steps)
    "ddp, schedule, clipping, bf16": (_ddp(**FEATURES), "fused_adamw", 1, 0),
    "ddp, fused SGD, clipping": (_ddp(clip_grad_norm=0.5), "fused_sgd", 1, 0),
    # The first steps' gradients overflow fp16 at the initial loss scale: skipped, the scale halved.
    "ddp, fp16 overflows, clipping": (_ddp(precision="fp16", clip_grad_norm=1.0,
                                           loss="tests.test_step_on_device:overflowing_loss"),
                                      "fused_adamw", 1, 0),
    "ddp, two bad steps skipped": (_ddp(bad_step="skip", **POISON), "fused_adamw", 1, 2),
    "fsdp, clipping": (_fsdp(clip_grad_norm=0.5), "fused_adamw", 1, 0),
    "pipeline, clipping": (lambda p, **t: _pipeline(p, clip_grad_norm=0.5, **t),
                           "fused_adamw", 2, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_decided_on_the_device_ends_as_one_decided_on_the_host(tmp_path, case):
    make, opt, pp, poisoned = CASES[case]
    ids, bad = _poisoned_steps(poisoned, 12) if poisoned else ("", [])
    env = {"ELASTIC_POISONED_SAMPLES": ids} if poisoned else {}
    device = run_counted(make(tmp_path / "device", optimizer=OPT + opt), pp, env)
    host = run_counted(make(tmp_path / "host", optimizer=OPT + opt + "_host_decided"), pp, env)
    assert all(o[1] == "done" for o in device + host), device + host
    # The same state, bit for bit, and the same report: loss, norm, skipped steps, schedule.
    assert [o[2:6] + (o[7],) for o in device] == [o[2:6] + (o[7],) for o in host]
    if poisoned:
        assert all(o[5] == bad for o in device), device
    if "overflows" in case:
        assert all(o[5] and o[5] == list(range(1, len(o[5]) + 1)) for o in device), device
    # No step of the device-decided run read the device after the first (a pipeline's schedule
    # learns its shapes in its first step); the other read once per step.
    assert all(len(o[6]) == 12 and set(o[6][1:]) == {0} for o in device), [o[6] for o in device]
    assert all(len(o[6]) == 12 and set(o[6][1:]) == {1} for o in host), [o[6] for o in host]


def test_bad_step_verdicts_read_a_step_late_stop_the_run_at_the_bad_step(tmp_path):
    """Step 3 is bad: its verdict is read in step 4, which makes no update, and the run ends
    naming step 3; no step read the device on the way."""
    ids, _ = _poisoned_steps(1, 12)
    out = run_counted(mlp_job(tmp_path / "a", optimizer=OPT + "fused_adamw", **POISON),
                      env={"ELASTIC_POISONED_SAMPLES": ids})
    named = "step 3: non-finite loss on some rank (train.bad_step=raise)"
    assert all(o[1] == "bad_step" and named in o[2] for o in out), out
    assert all(o[6] == [0, 0, 0, 0] for o in out), [o[6] for o in out]
    ids, _ = _poisoned_steps(2, 12)
    out = run_counted(mlp_job(tmp_path / "b", optimizer=OPT + "fused_adamw", bad_step="skip",
                              bad_step_limit=2, **POISON), env={"ELASTIC_POISONED_SAMPLES": ids})
    named = "steps [3, 4]: 2 bad steps in a row"
    assert all(o[1] == "bad_step" and named in o[2] for o in out), out
    assert all(o[6] == [0, 0, 0, 0, 0] for o in out), [o[6] for o in out]


def test_a_device_decided_run_resumes_bit_identical_from_a_checkpoint_and_a_peer(tmp_path):
    """Checkpoints and peer copies are taken at steps whose statistics were read (settled):
    restored from either, a run ends as the uninterrupted one, which read nothing of the device."""
    def job(name: str) -> dict:
        return mlp_job(tmp_path / name, optimizer=OPT + "fused_adamw", **FEATURES)

    whole = run_counted(job("a"))
    assert all(o[1] == "done" and set(o[6][1:]) == {0} for o in whole), whole
    run_ranks(job("b"), steps=6)  # stopped at its step-6 checkpoint
    resumed = run_ranks(job("c"), candidates=[f"file://{tmp_path}/b/f/checkpoints/step_000000006"])
    assert resumed[0][4] == "storage" and resumed[0][5] == 6
    assert [o[2] for o in resumed] == [o[2] for o in whole]
    # Rank 1 replaced after step 5 and restored from rank 0's memory.
    peer = run_ranks(job("d"), peer_sources=[0], peer_at=5)
    assert [o[2] for o in peer] == [o[2] for o in whole]


@pytest.mark.parametrize("optimizer,stopped_at",
                         [("fused_adamw", 7), ("fused_adamw_host_decided", 6)])
def test_a_stop_asked_of_one_rank_is_agreed_a_step_later_where_the_device_decides(
        tmp_path, optimizer, stopped_at):
    """The stop rides on step 6's statistics. Read a step late, every rank sees it in step 7 and
    stops after it, together; read before each update, after step 6. (No checkpoint is due at
    step 6: a step that saves reads its own statistics.)"""
    job = mlp_job(tmp_path, optimizer=OPT + optimizer)
    job["checkpoint"]["every_steps"] = 100
    out = run_counted(job, target=_stop_rank)
    assert all(o[1:] == ("done", "stopped", stopped_at, stopped_at) for o in out), out


def test_the_bad_step_flag_is_one_exactly_where_the_loss_or_the_norm_is_not_finite():
    from elastic.runtime.step_stats import StepStats, StepTensors
    t = StepTensors()
    nan, inf = float("nan"), float("inf")
    cases = {(1.0, 2.0): 0.0, (nan, 2.0): 1.0, (inf, 2.0): 1.0, (-inf, 2.0): 1.0,
             (1.0, nan): 1.0, (1.0, inf): 1.0, (3.4e38, 3.4e38): 0.0}
    got = {}
    for (loss, sumsq), want in cases.items():
        stats = torch.zeros(StepStats.GRAD_SUMSQ + 1)
        stats[StepStats.LOSS], stats[StepStats.GRAD_SUMSQ], stats[StepStats.STOP] = loss, sumsq, 1.0
        got[(loss, sumsq)] = t.found(stats).item()
    assert got == cases


def overflowing_loss(model, batch):
    """The workload's loss, large enough that its gradients overflow fp16 at the first scales."""
    from elastic.workload import loss_fn
    return loss_fn(model, batch) * 64.0


def _hooks_rank(port, cap, q):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from elastic.parallel import ddp
    from tests.test_ddp_strategy import Net, batch, loss_fn
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if cap:
        ddp.BUCKET_BYTES = cap
    strat = ddp.DataParallel(init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
    model, ref = Net(), Net()
    loss_fn(ref, batch(0)).backward()
    strat.train_step(model, [0], lambda ids: batch(ids[0]), loss_fn, micro=1)
    strat.reduce_gradients(model)
    same = all(torch.equal(p.grad, r.grad) for p, r in zip(model.parameters(), ref.parameters())
               if r.grad is not None)
    unused = [p.grad for n, p in model.named_parameters() if n.startswith("unused")]
    q.put((len(model.elastic_grad_hooks), [len(b) for b in strat._buckets], same,
           all(g is not None and not g.any() for g in unused)))
    dist.destroy_process_group()


@pytest.mark.parametrize("cap,hooks", [(None, 0), (4096, 5)])
def test_the_last_gradient_bucket_is_launched_after_backward_without_hooks(cap, hooks):
    """Buckets are launched in order, so the last waits for every gradient whatever hooks it
    has: its parameters get none, and a model of one bucket runs no Python per parameter during
    backward. The gradients are the same, an unused parameter's zeros included."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.spawn_ranks", "tests.support.rank_preload"])
    q = ctx.Queue()
    p = ctx.Process(target=_hooks_rank, args=(port, cap, q))
    p.start()
    n_hooks, buckets, same, unused_zero = q.get(timeout=120)
    p.join(timeout=60)
    # Net's 6 parameters: one bucket at 25 MiB; three at 4096 bytes, the last a.weight alone.
    assert n_hooks == hooks and buckets == ([6] if cap is None else [4, 1, 1]), (n_hooks, buckets)
    assert same and unused_zero
