"""One Worker in this process, in a world of one (gloo, no Ray): the stop flag's lifetime."""
from __future__ import annotations

import os

import pytest

from elastic.checkpoint.layout import checkpoints_root
from elastic.config import JobConfig
from elastic.protocol import WorkerInfo
from elastic.runtime.worker import Worker
from tests.spawn_ranks import rendezvous_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def no_ray():
    """These workers run outside Ray: a call that reaches Ray would start a local cluster (or join
    a stale one) and leave it initialized for the modules after this one."""
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()  # one failure here, not a broken set-up in every module after this one
        pytest.fail("a test in this module started Ray")


def _fence_before_join(w) -> None:
    """What the controller does before every formation: the group's generation in the fence, which
    a persist must find there before it writes (fencing.py fails closed: no fence, no write)."""
    from elastic.checkpoint.fencing import write_fence
    real_join = w.join

    def join(*args, generation, **kwargs):
        write_fence(w.storage, w.root, generation)
        return real_join(*args, generation=generation, **kwargs)
    w.join = join


def _one_rank(tmp_path, checkpoint=None, failure=None, joined: bool = True) -> Worker:
    """A worker in a world of one, joined (generation 1) and restored from nothing."""
    job = JobConfig.model_validate({
        "run": {"name": "w", "num_steps": 20, "seed": 1},
        "scaling": {"num_workers": 1},
        "checkpoint": {"storage_uri": f"file://{tmp_path}", "every_steps": 100, **(checkpoint or {})},
        "failure": failure or {},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "global_batch_size": 8},
    })
    w = Worker(job.model_dump_json(), checkpoints_root(f"file://{tmp_path}", "w"))
    # Its identity comes from Ray's runtime context in an actor; outside Ray, asking would start Ray.
    w.info = lambda: WorkerInfo(node_id="local", ip="127.0.0.1", pid=os.getpid(), actor_id="local")
    _fence_before_join(w)
    if joined:
        w.join("127.0.0.1", rendezvous_port(), 0, 1, generation=1)
        w.restore([])
    return w


@pytest.fixture
def worker(tmp_path):
    w = _one_rank(tmp_path)
    yield w
    w.leave()


def test_a_worker_started_for_a_recovery_allocates_its_model_without_its_init(tmp_path):
    """Started for a recovery (no calibration), a worker's model will be loaded over before it
    trains: it is allocated without running the model's init, NaN where the load must write, so
    a tensor a load missed cannot pass for trained values. A spare, which times its compute
    first, builds the seed's values. Either, restored, holds the seed's values."""
    import torch

    from elastic.workload import build_model

    torch.manual_seed(1)
    seeded = build_model().state_dict()
    on_demand = _one_rank(tmp_path, joined=False)
    on_demand.warm(calibrate=False)
    assert all(torch.isnan(p).all() for p in on_demand.model.parameters())
    spare = _one_rank(tmp_path / "spare", joined=False)
    assert spare.warm(calibrate=True).calib_s > 0
    assert all(torch.equal(t, seeded[k]) for k, t in spare.model.state_dict().items())
    on_demand.join("127.0.0.1", rendezvous_port(), 0, 1, generation=1)
    on_demand.restore([])  # no checkpoint: the seed's init
    try:
        assert all(torch.equal(t, seeded[k]) for k, t in on_demand.model.state_dict().items())
    finally:
        on_demand.leave()


def test_a_replicated_rank_that_takes_a_peers_copy_builds_without_its_init(worker):
    """A DDP rank built for a restore from a peer's memory (a spare, a replacement) receives every
    tensor of the state next: allocated without the model's init, NaN where the copy must write
    (the init took 0.4-1.0 s at 90 M here). A restore from storage keeps the eager build."""
    import torch

    from elastic.runtime import state
    state.build(worker, fill=False, copied=True)
    assert all(torch.isnan(p).all() for p in worker.model.parameters())
    state.build(worker, fill=False)
    assert all(torch.isfinite(p).all() for p in worker.model.parameters())


def test_a_ddp_spare_holds_its_optimizer_state_before_it_joins(tmp_path):
    """A calibrated DDP spare joins with the model it built: its optimizer's state is made while
    it waits, so a restore's copy lands in memory already touched (zeros, as DCP's init)."""
    import torch

    spare = _one_rank(tmp_path, joined=False)
    spare.warm(calibrate=True)
    params = list(spare.model.parameters())
    assert len(spare.optimizer.state) == len(params)
    assert all(torch.equal(spare.optimizer.state[p]["exp_avg"], torch.zeros_like(p))
               for p in params)


def test_a_stop_requested_before_run_starts_is_kept(worker):
    """The controller may ask for a stop (a swap, a resize) between a restore and the start of run();
    run() used to reset the flag, so that stop was lost and the planned change waited forever."""
    worker.request_stop(generation=1)
    out = worker.run(20, [])
    assert out.status == "stopped" and out.step == 1


def test_a_stop_of_an_older_generation_is_ignored_and_a_new_group_clears_a_pending_one(worker):
    worker.request_stop(generation=0)  # stale: meant for a group that no longer exists
    assert worker.run(3, []).status == "done"
    worker.request_stop(generation=1)
    worker.join("127.0.0.1", rendezvous_port(), 0, 1, generation=2)  # a stop belongs to the group it was asked in
    worker.restore([])
    assert worker.run(3, []).status == "done"



def test_a_model_replaced_by_a_restore_is_freed(worker):
    """A storage restore builds a fresh model and optimizer. The replaced model's gradient hooks
    (held by its parameters in C++, holding the strategy, its parameter list and bucket buffers)
    kept it alive for good: two model-sized copies leaked per restore, on every rank."""
    import gc
    import weakref

    param = weakref.ref(next(worker.model.parameters()))
    assert worker.run(3, []).status == "done"  # gradients and AdamW state exist
    worker.join("127.0.0.1", rendezvous_port(), 0, 1, generation=2)
    worker.restore([])
    gc.collect()
    assert param() is None


def test_what_set_up_left_alive_is_frozen_and_what_training_builds_is_not(worker):
    """A full collection of everything the worker's set-up left alive (~300,000 objects) held a
    rank ~180 ms every few hundred steps; frozen, a collection scans only what training creates.
    The model is built later and stays collectable (a frozen cycle would never be freed)."""
    import gc

    alive = {id(o) for o in gc.get_objects()}  # the collector's generations, not the frozen objects
    assert gc.get_freeze_count() > 0
    assert id(worker.dataset) not in alive and id(worker.fns) not in alive
    assert id(worker.model) in alive and id(worker.optimizer) in alive


def test_a_restore_whose_checkpoints_all_fail_to_load_does_not_start_from_step_0(worker, tmp_path):
    """Committed checkpoints that do not load (storage out after the listing) used to give a fresh
    init at step 0, silently; now the rank says none loaded and the controller decides."""
    assert worker.run(3, []).status == "done"
    worker.join("127.0.0.1", rendezvous_port(), 0, 1, generation=2)
    gone = f"file://{tmp_path}/w/checkpoints/step_000000002"  # listed, then unreadable
    out = worker.restore([gone])
    assert out.source == "none loaded" and out.uri is None
    assert [u for u, _ in out.skipped] == [gone]
    assert worker.restore([]).source == "init"  # no checkpoint at all: a fresh start, as before


def test_a_checkpoint_that_failed_on_storage_is_saved_again_at_the_next_step_not_the_next_checkpoint_step(tmp_path):
    """Storage out at step 5's checkpoint (every 5 steps): the run used to go without a commit
    until step 10, however soon storage came back. Now every rank agrees (in the step's
    all-reduce) to save again at the first step after the wait, and that commits."""
    from elastic.checkpoint.layout import committed_checkpoints
    from elastic.storage import Storage
    from tests.support.flaky_fs import flaky_memory_fs

    fs = flaky_memory_fs("flakyretry")
    uri = f"flakyretry://{tmp_path.name}"
    job = JobConfig.model_validate({
        "run": {"name": "w", "num_steps": 12, "seed": 1}, "scaling": {"num_workers": 1},
        "checkpoint": {"storage_uri": uri, "every_steps": 5, "persist_retries": 0, "persist_retry_backoff_s": 0},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "global_batch_size": 8},
    })
    root = checkpoints_root(uri, "w")
    w = Worker(job.model_dump_json(), root)
    _fence_before_join(w)
    w.join("127.0.0.1", rendezvous_port(), 0, 1, generation=1)
    w.restore([])
    try:
        fs.failures = 10 ** 6  # every write fails: storage is out
        assert w.run(6, []).status == "done"  # step 5's checkpoint, and the end's (6), fail
        failed = w.poll().persists
        assert [(p.step, p.committed) for p in failed] == [(5, False), (6, False)]
        assert "storage unavailable" in failed[0].error
        fs.failures = 0  # storage is back
        assert w.run(9, []).status == "done"
        out = w.poll()
        assert out.retried == (7,)  # the first step trained once the failure was known
        assert [(p.step, p.committed) for p in out.persists] == [(7, True), (9, True)]  # 9: the end
        assert [c.step for c in committed_checkpoints(Storage(uri), root)] == [9, 7]
        assert w.run(12, []).status == "done" and w.poll().retried == ()  # settled: no more retries
    finally:
        fs.failures = 0
        w.leave()


def test_checkpoints_record_the_datasets_fingerprint(worker, tmp_path):
    """What the driver's resume check compares against (elastic/trainer.py, _check_resume)."""
    from elastic.checkpoint.layout import latest_committed
    from elastic.data.fingerprint import dataset_fingerprint
    from elastic.storage import Storage
    from elastic.workload import build_dataset

    assert worker.run(2, []).status == "done"
    latest = latest_committed(Storage(f"file://{tmp_path}"), worker.root)
    assert latest.step == 2
    assert latest.manifest.data_order["dataset_fingerprint"] == dataset_fingerprint(build_dataset())


def test_each_step_seeds_cuda_too_once_cuda_has_started(worker, monkeypatch):
    """A CPU rank whose code started CUDA draws from CUDA's generators too: every device is seeded
    per step, as the CPU's is (on a GPU rank CUDA has always started by its first step)."""
    import torch

    from elastic.runtime.step import step_seed

    seeded = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    assert worker.run(2, []).status == "done"
    assert seeded == [step_seed(1, 0, 0), step_seed(1, 1, 0)]


def test_deterministic_sets_torchs_flags_in_the_worker_and_cublas_only_on_gpu(tmp_path, monkeypatch):
    import torch

    from elastic.runtime.determinism import CUBLAS_VAR

    monkeypatch.delenv(CUBLAS_VAR, raising=False)
    job = JobConfig.model_validate({
        "run": {"name": "w", "num_steps": 3, "seed": 1}, "scaling": {"num_workers": 1},
        "checkpoint": {"storage_uri": f"file://{tmp_path}", "every_steps": 100},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "global_batch_size": 8, "deterministic": True},
    })
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        w = Worker(job.model_dump_json(), checkpoints_root(f"file://{tmp_path}", "w"))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        import os
        assert CUBLAS_VAR not in os.environ  # a CPU rank: cuBLAS is not used
        _fence_before_join(w)
        w.join("127.0.0.1", rendezvous_port(), 0, 1, generation=1)
        w.restore([])
        assert w.run(3, []).status == "done"  # the step's CPU ops all have deterministic kernels
        w.leave()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


def test_a_last_persist_that_never_ends_is_given_up_at_its_bound_and_the_run_goes_on(tmp_path, monkeypatch):
    """The run's end waits for its last persist (`_wait_persist`): a persist that hangs used to hold
    the rank there forever. Now it is given up past checkpoint.persist_timeout_s and reported;
    one that cannot even be cut short is left running, and the next save is reported not made."""
    import threading

    import elastic.checkpoint.persister as persister
    from elastic.checkpoint.retry import owes_retry
    from elastic.checkpoint.uploader import UploadCut

    release = threading.Event()
    cuttable = [True]

    def hung(*a, cancel=None, **kw):  # an upload that hangs: cut short only where it can be
        while not release.wait(0.02):
            if cuttable[0] and cancel is not None and cancel.is_set():
                raise UploadCut("upload cut short")
        raise ConnectionError("released")

    w = _one_rank(tmp_path, checkpoint={"persist_timeout_s": 0.5}, failure={"ping_timeout_s": 0.5})
    monkeypatch.setattr(persister, "save_shards", hung)
    try:
        assert w.run(3, []).status == "done"  # its last persist hung, and was given up
        (failed,) = w.poll().persists
        assert failed.step == 3 and not failed.committed and failed.error.startswith("timed out:")
        assert "checkpoint.persist_timeout_s=0.5" in failed.error and owes_retry(failed.error)

        cuttable[0] = False  # a call nothing can cut: the wait still ends, and nothing runs beside it
        w._save(w.job.train, None)
        assert w.save_again() == 3
        report = w.poll()
        assert w.ckpt.in_flight() and [p.step for p in report.persists] == [3]
        assert report.persists[0].error.startswith("timed out:") and "step 3 not saved" in report.persists[0].error
    finally:
        release.set()
        w.ckpt.wait()
        w.leave()


def test_after_a_formation_cut_mid_join_the_next_group_has_the_names_every_member_uses(tmp_path):
    """A join cut short (its peer never came; the controller aborted it) raised inside torch's group
    creation. torch's per-process group counter stayed up, so this member's next group published
    its rendezvous keys under another name than a fresh member's, and that formation never
    completed with every member alive. The next group must be named as a fresh process names it."""
    import threading

    import torch.distributed as dist

    w = _one_rank(tmp_path)
    w.leave()
    cut = threading.Timer(1.0, lambda: w.abort(generation=2))
    cut.start()
    with pytest.raises(Exception):
        w.join("127.0.0.1", rendezvous_port(), 0, 2, generation=2)  # rank 1 never comes
    cut.join()
    assert not dist.is_initialized()
    w.join("127.0.0.1", rendezvous_port(), 0, 1, generation=3)
    try:
        assert dist.distributed_c10d._get_default_group().group_name == "0"
    finally:
        w.leave()



def test_where_names_the_frames_run_is_blocked_in_and_none_once_it_returned(worker):
    """What the controller puts in the event when a survivor's run() does not return after an abort."""
    import threading
    entered, release = threading.Event(), threading.Event()
    real = worker.runner.train_step

    def blocked_step(micro):
        entered.set()
        release.wait(30)
        return real(micro)
    worker.runner.train_step = blocked_step
    assert worker.where() is None
    t = threading.Thread(target=worker.run, args=(2, []))
    t.start()
    assert entered.wait(30)
    where = worker.where()
    release.set()
    t.join(30)
    frames = where.split(" > ")  # innermost last: run() called the step, which waits on the event
    assert len(frames) == 4 and frames[0].startswith("worker.py:") and frames[0].endswith(" in run")
    assert frames[1].startswith("test_worker.py:") and frames[1].endswith(" in blocked_step")
    assert frames[-1].startswith("threading.py:") and frames[-1].endswith(" in wait")
    assert worker.where() is None
