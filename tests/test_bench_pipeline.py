"""`python -m benchmarks pipeline`: its pure parts and its command line (no cluster, no timing).

The benchmark's figures are its own business; these check that the systems it compares are
set up alike (same cut, same batch plan, a job elastic accepts, a command the plain peer
parses) and that its arithmetic and argument checks hold.
"""
from __future__ import annotations

import pytest

from benchmarks import pipeline as bench
from benchmarks import plain_pipeline as plain
from benchmarks.__main__ import main as bench_main
from elastic.config import parse_job
from elastic.parallel.pipeline import plan_chunks, units_of


def test_gpt_size_becomes_the_environment_examples_gpt_reads():
    assert bench.gpt_env("6,128,64") == {"GPT_LAYERS": "6", "GPT_DIM": "128", "GPT_CONTEXT": "64"}
    for bad in ("6,128", "a,b,c", "0,64,64", "4,66,64"):
        with pytest.raises(ValueError, match="--gpt"):
            bench.gpt_env(bad)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
@pytest.mark.parametrize("stages", [2, 3])
def test_peers_cut_the_model_where_elastic_does(stages, schedule):
    from examples.gpt import build_model
    model = build_model()
    names = [n for n, _ in model.named_children()]
    split = bench.split_points(stages, schedule)
    num_chunks = stages * bench.chunks_per_rank(schedule)
    assert len(split) == num_chunks - 1
    assert plain.chunks_from_split(names, split) == plan_chunks(units_of(model), num_chunks)


def test_chunks_from_split_rejects_names_out_of_order():
    with pytest.raises(ValueError, match="in order"):
        plain.chunks_from_split(["0", "1", "2"], ["2", "1"])
    with pytest.raises(ValueError, match="in order"):
        plain.chunks_from_split(["0", "1", "2"], ["0"])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_every_elastic_job_of_the_benchmark_is_valid(schedule, tmp_path):
    uri = "file://" + str(tmp_path)
    for stages, replicas in bench.THROUGHPUT_LAYOUTS:
        job = parse_job(bench.elastic_job(stages, replicas, schedule=schedule, num_steps=bench.THROUGHPUT_STEPS,
                                          every_steps=bench.THROUGHPUT_STEPS, storage_uri=uri, storage_options={}))
        assert job.scaling.num_workers == stages * replicas and job.train.pipeline.schedule == schedule
    for _, stages, replicas, fault in bench.RECOVERY_SCENARIOS:
        for rep in range(3):
            at = bench.fault_step(rep)
            job = parse_job(bench.elastic_job(
                stages, replicas, schedule=schedule, num_steps=bench.RECOVERY_STEPS, every_steps=bench.CKPT_EVERY,
                storage_uri=uri, storage_options={},
                chaos=[{"action": fault, "rank": bench.FAULT_RANK, "at_step": at}]))
            assert job.chaos[0].at_step == at < job.run.num_steps
    job = parse_job(bench.elastic_job(2, 1, schedule=schedule, num_steps=bench.THROUGHPUT_STEPS, tp=2,
                                      every_steps=bench.THROUGHPUT_STEPS, storage_uri=uri, storage_options={}))
    assert job.scaling.num_workers == 4 and job.train.tp.size == 2
    # Faults land at several offsets from the last checkpoint, all before the next one.
    offsets = {bench.fault_step(r) % bench.CKPT_EVERY for r in range(3)}
    assert len(offsets) == 3 and 0 not in offsets
    assert len({bench.fault_step(r) // bench.CKPT_EVERY for r in range(3)}) == 1  # all after the same checkpoint


def test_plain_command_runs_the_same_plan_under_torchrun():
    cmd = bench.plain_command(2, 2, schedule="interleaved_1f1b", split=["2", "3", "4"], num_steps=7)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    i = cmd.index("benchmarks.plain_pipeline")
    args = plain.parse_args(cmd[i + 1:])
    assert (args.stages, args.split, args.schedule, args.stages_per_rank) == (2, "2,3,4", "interleaved_1f1b", 2)
    assert (args.microbatches, args.global_batch, args.steps, args.seed, args.tp) == (
        bench.MICROBATCHES, bench.GLOBAL_BATCH, 7, bench.SEED, 1)
    cmd = bench.plain_command(2, 1, schedule="1f1b", split=["3"], num_steps=7, tp=2)
    assert cmd[4] == "--nproc-per-node=4" and plain.parse_args(cmd[cmd.index("benchmarks.plain_pipeline") + 1:]).tp == 2


@pytest.mark.timeout(300)
def test_plain_pipeline_trains_with_tp_under_torchrun(tmp_path):
    """The plain peer at 2 stages x tp 2: a (dp, pp, tp) mesh, each stage split by the plan's styles."""
    import json
    import os
    import subprocess
    import sys
    log = tmp_path / "steps.jsonl"
    env = {**os.environ, plain.STEP_LOG_ENV: str(log), "GPT_LAYERS": "2", "GPT_DIM": "64"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
           "benchmarks.plain_pipeline", "--stages", "2", "--split", "2", "--tp", "2", "--steps", "3",
           "--microbatches", "2", "--global-batch", "8"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len([json.loads(x) for x in log.read_text().splitlines()]) == 3  # one line per optimizer step


def test_step_rate_leaves_out_warm_up_and_times_the_rest():
    times = [0.0, 5.0, 5.5] + [6.0 + 0.1 * i for i in range(11)]  # a slow start, then 10 intervals of 0.1 s
    fig = plain.step_rate(times, warmup_steps=3)
    assert fig["timed_steps"] == 10
    assert fig["steps_per_s"] == pytest.approx(10.0) and fig["median_step_s"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="fewer than 3"):
        plain.step_rate(times[:4], warmup_steps=3)


def test_a_step_log_with_missing_steps_is_an_error():
    lines = [{"t": float(i), "threads": 1} for i in range(bench.THROUGHPUT_STEPS)]
    assert bench.throughput_figures(lines, bench.THROUGHPUT_STEPS)["steps_per_s"] == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="missed steps"):
        bench.throughput_figures(lines[1:], bench.THROUGHPUT_STEPS)


def test_the_step_clock_writes_only_on_global_rank_zero(tmp_path, monkeypatch):
    import torch
    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv(plain.STEP_LOG_ENV, str(log))
    opt = plain.timed_optimizer([torch.nn.Parameter(torch.zeros(2))])
    opt.step()  # no process group: not rank 0 of anything, nothing written
    assert not log.exists()


def test_summary_divides_medians_of_the_same_run():
    recs = [{"part": "throughput", "system": s, "layout": "2x1", "steps_per_s": v, "step_s": 1 / v,
             "median_step_s": 1 / v, **({"pipeline_ratio": v / 10} if s == "elastic" else {})}
            for s, v in [("elastic", 9.0), ("torch-pipelining", 10.0), ("elastic", 9.6), ("torch-pipelining", 12.0),
                         ("elastic", 9.5), ("torch-pipelining", 10.0)]]
    recs += [{"part": "recovery", "system": s, "scenario": "3x1 kill_node", "recover_s": v, "lost_steps": n,
              "detect_s": 1.0} for s, v, n in [("elastic", 4.0, 2), ("ray-train", 20.0, 12), ("elastic-spare", 2.0, 0)]]
    summary, table = bench.summarise(recs)
    assert summary["throughput"]["2x1"]["pipeline_ratio"] == pytest.approx(9.5 / 10.0)
    assert summary["recovery"]["3x1 kill_node"]["recover_s_ratio"] == pytest.approx(0.2)
    assert summary["recovery"]["3x1 kill_node"]["ray_train_lost_steps"] == 12
    assert summary["recovery"]["3x1 kill_node"]["elastic_spare_recover_s_ratio"] == pytest.approx(0.1)
    assert "pipeline throughput" in table and "pipeline stage loss" in table


def test_cli_refuses_unknown_systems_and_sizes_before_starting_anything(capsys):
    assert bench_main(["pipeline", "--systems", "elastic,torchrun"]) == 2
    assert "unknown ['torchrun']" in capsys.readouterr().err
    assert bench_main(["pipeline", "--gpt", "4,64"]) == 2
    assert "--gpt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["pipeline", "--schedule", "zero_bubble"])


def test_every_elastic_job_of_the_tp_stage_loss_is_valid(tmp_path):
    for _, stages, replicas, fault in bench.TP_RECOVERY_SCENARIOS:
        job = parse_job(bench.elastic_job(
            stages, replicas, schedule="1f1b", num_steps=bench.RECOVERY_STEPS, every_steps=bench.CKPT_EVERY,
            storage_uri="file://" + str(tmp_path), storage_options={}, tp=2, cpus_per_worker=0.5,
            chaos=[{"action": fault, "rank": bench.FAULT_RANK, "at_step": bench.fault_step(0)}]))
        # Two ranks of half a CPU: stage 0's tp group fits one one-CPU node, and the fault takes it whole.
        assert job.scaling.num_workers == 4 and job.scaling.cpus_per_worker == 0.5 and job.train.tp.size == 2
        assert replicas == 1 and bench.FAULT_RANK < job.train.tp.size  # rank 1: stage 0, tp index 1


def _peer_checkpoint_rank(rank: int, init_file: str, ckpt: str, out: str) -> None:
    """One rank of the Ray Train pipeline peer's checkpoint at pp 2 x tp 2: train a step, save with
    its DCP save, build again from another seed, load, train one more step on both, and write
    the states' digests."""
    import hashlib
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from benchmarks import ray_train_fsdp
    from elastic.data.order import GlobalOrder
    from examples.gpt import build_dataset, build_model, stage_loss

    def digest(me) -> str:
        h = hashlib.sha256()
        tensors = list(me.modules[0].state_dict().items())
        tensors += sorted((f"{k}.{n}", t) for k, s in me.optimizer.state_dict()["state"].items()
                          for n, t in s.items() if torch.is_tensor(t))
        for name, t in tensors:
            t = t.to_local() if isinstance(t, DTensor) else t
            h.update(name.encode() + t.detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    split = bench.split_points(2, "1f1b")
    dataset = build_dataset()
    torch.manual_seed(0)
    me = plain.build_pipeline(mesh, build_model(), split, "1f1b", 2, stage_loss)
    plain.run_step(me, dataset, GlobalOrder(len(dataset), 0), 0, 8)
    ray_train_fsdp.save(me.modules[0], me.optimizer, 1, ckpt, rank, ray_train_fsdp.PIPELINE)
    torch.manual_seed(1)
    again = plain.build_pipeline(mesh, build_model(), split, "1f1b", 2, stage_loss)
    before = digest(again)
    step = ray_train_fsdp.load(again.modules[0], again.optimizer, ckpt, ray_train_fsdp.PIPELINE)
    saved, loaded = digest(me), digest(again)
    for p in (me, again):  # and both train on alike
        plain.run_step(p, dataset, GlobalOrder(len(dataset), 0), 1, 8)
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump({"saved": saved, "fresh": before, "loaded": loaded, "step": step,
                   "next": [digest(me), digest(again)]}, f)
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_the_ray_train_peer_restores_a_tp_stage_exactly(tmp_path, monkeypatch):
    """What the Ray Train peer's restart reads back at pp 2 x tp 2 is what it saved: every rank's
    tensor slices and optimizer state, bit for bit, and the next step runs alike from both (a peer
    restoring less would look faster)."""
    import json

    import torch.multiprocessing as mp
    monkeypatch.setenv("GPT_LAYERS", "2")
    monkeypatch.setenv("GPT_DIM", "64")
    (tmp_path / "ckpt").mkdir()
    mp.spawn(_peer_checkpoint_rank, args=(str(tmp_path / "init"), str(tmp_path / "ckpt"), str(tmp_path)), nprocs=4)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for g in got:
        assert g["loaded"] == g["saved"] != g["fresh"] and g["step"] == 1, g
        assert g["next"][0] == g["next"][1] != g["saved"], g
    assert len({g["saved"] for g in got}) == 4  # each rank holds its own stage's own slice


def test_a_spare_run_keeps_one_spare_per_rank_a_node_kill_takes_where_they_fit():
    assert bench.spares_for("elastic", 2, 1, 2, "kill_node") == 0 and bench.spares_for("ray-train", 3, 1, 1, "kill_node") == 0
    assert bench.spares_for("elastic-spare", 2, 1, 2, "kill_node") == 2  # stage 0's whole tp group
    assert bench.spares_for("elastic-spare", 3, 1, 1, "kill_node") == 1  # the middle stage
    assert bench.spares_for("elastic-spare", 2, 2, 1, "kill_process") is None  # replaced in its own slot
    assert bench.spares_for("elastic-spare", 4, 1, 1, "kill_node") is None  # no node left for it
