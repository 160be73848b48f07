"""`python -m benchmarks recovery`'s plan (pure): model sizes, their MLP widths, fault offsets."""
import pytest

from benchmarks import recovery as bench
from benchmarks.overhead import num_params


def test_sizes_take_suffixes_and_map_to_the_nearest_mlp_width():
    assert bench.parse_params("900K, 9M,0.09G") == [900_000, 9_000_000, 90_000_000]
    assert bench.parse_params(None) == [None]  # the common workload
    for n in (900_000, 9_000_000, 90_000_000):
        h = bench.hidden_for(n)
        assert abs(num_params(h) - n) <= min(abs(num_params(w) - n) for w in (h - 1, h + 1))
    # About 10 MB, 100 MB and 1 GB of model + AdamW state.
    assert [round(num_params(bench.hidden_for(n)) * bench.STATE_BYTES_PER_PARAM / 1e6)
            for n in (900_000, 9_000_000, 90_000_000)] == [11, 108, 1080]


@pytest.mark.parametrize("bad", ["", "lots", "9X", "100"])
def test_a_bad_size_is_refused_naming_the_flag(bad):
    with pytest.raises(ValueError, match="--params"):
        bench.parse_params(bad or ",")


def test_the_fault_lands_at_a_different_offset_from_the_last_checkpoint_in_each_repetition():
    steps = [bench.fault_step(r) for r in range(len(bench.FAULT_STEPS))]
    assert len({s % bench.CKPT_EVERY for s in steps}) == len(steps)
    assert all(bench.CKPT_EVERY < s < bench.NUM_STEPS for s in steps)
    assert bench.fault_step(len(bench.FAULT_STEPS)) == steps[0]


def test_the_resize_bench_reads_a_runs_events_from_an_object_store_as_they_are_written():
    """On an object store the event log is numbered segments, not one events.jsonl: the resize
    benchmark waits on a committed checkpoint there before it adds the node."""
    import json
    import uuid

    from benchmarks.resize import _events
    from elastic.storage import Storage
    run = f"memory://resize-{uuid.uuid4().hex[:6]}/run"
    assert _events(run) == []  # nothing written yet
    Storage(run).write_bytes(f"{run}/events/000001.jsonl",
                             (json.dumps({"t": 1.0, "kind": "checkpoint_committed", "step": 20}) + "\n").encode())
    assert [e["step"] for e in _events(run)] == [20]


def test_a_gpu_run_faults_a_rank_that_exists_and_compares_only_what_the_gpus_allow():
    one = bench.gpu_layout(1)  # NCCL refuses two ranks on one GPU: no survivor, no spare
    assert one == {"num_workers": 1, "fault_rank": 0, "systems": ["elastic", "ray-train"]}
    two = bench.gpu_layout(2)
    assert two["num_workers"] == 2 and two["fault_rank"] == 1 and "elastic-spare" not in two["systems"]
    assert "elastic-spare" in bench.gpu_layout(bench.NUM_WORKERS + 1)["systems"]
    with pytest.raises(ValueError, match="--gpu"):
        bench.gpu_layout(0)


def test_the_gpu_job_faults_the_named_rank_on_the_gpu(tmp_path):
    from elastic.config import parse_job
    job = parse_job(bench.elastic_job("elastic", "file://" + str(tmp_path), {}, "kill_process", 25,
                                      num_workers=1, fault_rank=0, gpu=True))
    assert job.scaling.use_gpu and job.scaling.num_workers == 1
    assert (job.chaos[0].action, job.chaos[0].rank, job.chaos[0].at_step) == ("kill_process", 0, 25)
    cpu = parse_job(bench.elastic_job("elastic-spare", "file://" + str(tmp_path), {}))
    assert not cpu.scaling.use_gpu and cpu.scaling.num_workers == bench.NUM_WORKERS and cpu.scaling.num_spares == 1


def test_a_gpu_run_refuses_a_node_fault(capsys, monkeypatch):
    import argparse

    from benchmarks import overhead
    from benchmarks.cli import add_bench_args
    p = argparse.ArgumentParser()
    add_bench_args(p)
    monkeypatch.setattr(overhead, "gpu_devices", lambda: 1)
    assert bench.main(p.parse_args(["recovery", "--gpu"])) == 2  # the default fault, kill_node
    assert "kill_process" in capsys.readouterr().err
    assert bench.main(p.parse_args(["recovery", "--gpu", "--fault", "kill_process", "--systems", "elastic-spare"])) == 2


def test_the_ray_train_peers_results_are_checked_before_they_are_compared():
    """The Ray Train peer's sanity check, which every benchmark result of it carries (`sanity`):
    a run that did not finish, never restarted, resumed where no checkpoint is, miscounts its
    lost steps or has impossible times is named, not compared."""
    from benchmarks.ray_train_peer import sanity_problems
    good = {"final_step": 30, "fault_step": 15, "resumed_step": 10, "lost_steps": 5, "num_restarts": 1,
            "recover_s": 30.0, "restart_s": 25.0, "total_s": 60.0, "detect_s": 5.0}
    kw = dict(num_steps=30, fault_step=15, ckpt_every=10)
    assert sanity_problems(good, **kw) == []
    assert sanity_problems({**good, "resumed_step": 0, "lost_steps": 15, "detect_s": None}, **kw) == []
    for bad, why in [({"final_step": 20}, "final_step"), ({"resumed_step": 12}, "resumed_step"),
                     ({"resumed_step": 20}, "resumed_step"), ({"lost_steps": 4}, "lost_steps"),
                     ({"num_restarts": 0}, "no restart"), ({"total_s": float("nan")}, "not all positive"),
                     ({"detect_s": 26.0}, "detect_s")]:
        problems = sanity_problems({**good, **bad}, **kw)
        assert len(problems) == 1 and why in problems[0], (bad, problems)


def test_a_tp_job_trains_the_gpt_example_at_dp2_x_tp2_with_a_spare_per_lost_rank(tmp_path):
    from elastic.config import parse_job
    lay = bench.tp_layout(2)
    assert (lay["num_workers"], lay["fault_rank"]) == (4, 1)  # ranks 0 and 1: replica 0's tp group, one node
    job = parse_job(bench.elastic_job("elastic-spare", "file://" + str(tmp_path), {}, num_workers=4, tp=2,
                                      strategy="fsdp"))
    assert job.train.tp.size == 2 and job.train.model == "examples.gpt:build_model" and job.train.strategy == "fsdp"
    assert job.scaling.num_workers == 4 and job.scaling.num_spares == 2 and job.scaling.cpus_per_worker == 0.5
    assert job.train.global_batch_size == bench.TP_GLOBAL_BATCH
    plain = parse_job(bench.elastic_job("elastic", "file://" + str(tmp_path), {}, num_workers=4, tp=2))
    assert plain.scaling.num_spares == 0 and plain.train.strategy == "ddp"


@pytest.mark.parametrize("argv, says", [
    (["--tp", "3"], "only 2 here"),
    (["--tp", "2", "--gpu"], "not with --gpu"),
    (["--tp", "2", "--params", "9M"], "not with --params"),
    (["--tp", "2", "--systems", "elastic,ray-train-torchft"], "not with --systems ray-train-torchft"),
    (["--tp", "2", "--gpt", "4,66,64"], "--gpt: "),
])
def test_a_tp_run_refuses_what_it_cannot_compare_before_any_cluster_starts(argv, says, capsys):
    import argparse

    from benchmarks.cli import add_bench_args
    p = argparse.ArgumentParser()
    add_bench_args(p)
    assert bench.main(p.parse_args(["recovery", *argv])) == 2
    assert says in capsys.readouterr().err


def _local(model):
    """This rank's parameters after a step (which the optimizer state decides), as one tensor."""
    import torch

    from elastic.parallel.tensor import local
    return torch.cat([local(p).detach().flatten() for p in model.parameters()])


def _tp_peer_resumes(rank: int, world: int, init_file: str, out: str) -> None:
    """One rank of the Ray Train peer's tp model without Ray, ddp then fsdp: 2 steps, its
    distributed checkpoint, a third step; then a fresh model from the seed, the checkpoint read
    back, the same third step."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    for strategy in ("ddp", "fsdp"):
        _tp_peer_resume(rank, world, f"{out}/{strategy}", strategy, out)
    dist.destroy_process_group()


def _tp_peer_resume(rank: int, world: int, ckpt: str, strategy: str, out: str) -> None:
    import torch

    from benchmarks import ray_train_fsdp, ray_train_tp
    from elastic.data.order import GlobalOrder
    from examples import gpt
    data = gpt.build_dataset()
    order = GlobalOrder(len(data), 0)
    model, optimizer, mesh = ray_train_tp.build(0, strategy, 2, world, False)
    for step in range(2):
        ray_train_tp.train_step(model, optimizer, data, order, step, 8, mesh, strategy)
    ray_train_fsdp.save(model, optimizer, 2, ckpt, rank)
    first = [ray_train_tp.train_step(model, optimizer, data, order, 2, 8, mesh, strategy).detach(), _local(model)]
    model, optimizer, mesh = ray_train_tp.build(0, strategy, 2, world, False)
    step = ray_train_fsdp.load(model, optimizer, ckpt)
    again = [ray_train_tp.train_step(model, optimizer, data, order, step, 8, mesh, strategy).detach(), _local(model)]
    torch.save({"step": step, "first": first, "again": again}, f"{out}/{strategy}-{rank}.pt")


@pytest.mark.timeout(300)
def test_the_ray_train_tp_peer_resumes_from_its_distributed_checkpoint_exactly(tmp_path):
    import torch
    import torch.multiprocessing as mp
    mp.spawn(_tp_peer_resumes, args=(4, str(tmp_path / "init"), str(tmp_path)), nprocs=4)
    for strategy in ("ddp", "fsdp"):
        for rank in range(4):
            r = torch.load(tmp_path / f"{strategy}-{rank}.pt")
            assert r["step"] == 2 and all(torch.equal(a, b) for a, b in zip(r["first"], r["again"])), (strategy, rank)
