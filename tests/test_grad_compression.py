"""train.grad_compression: each compressor reduces DataParallel's buckets to the right values at
2 real gloo ranks (spawned processes), top-k's error feedback keeps exactly what was not sent,
a step cut short leaves the state as it was, and the state taken after a step and loaded into a
fresh strategy gives the next step's gradients bit for bit. The config refuses what does not
apply, and a fault with rank-private state restores from storage (docs/grad-compression.md)."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from elastic.config import FailureConfig, TrainSpec
from elastic.parallel.compression import PowerSgd, orthogonalize
from elastic.policies.restore import FromPeer, FromStorage, choose_restore
from tests.support.spawned import run_spawned

pytestmark = pytest.mark.timeout(180)

WORLD = 2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 64)
        self.b = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def loss_fn(model, b):
    return torch.nn.functional.mse_loss(model(b[0]), b[1])


def _spec(mode: str) -> TrainSpec:
    return TrainSpec(model="m:f", dataset="m:f", loss="m:f", global_batch_size=2,
                     grad_compression={"mode": mode, "powersgd_start_step": 1, "topk_ratio": 0.05})


def _step(strat, model, rank, step):
    model.zero_grad(set_to_none=True)
    strat.train_step(model, [rank], lambda ids: batch(ids[0], step), loss_fn, micro=1)
    strat.reduce_gradients(model)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _plain(t):
    return {k: (_plain(v) if isinstance(v, dict) else v.clone().numpy()) for k, v in t.items()}


def _state(strat, model) -> tuple[dict, dict]:
    """(shared, own) compressor state, as copies."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shared = strat.state_dict(model, opt).get("compression", {})
    return _plain(shared), _plain(strat.own_state(model))


def _rank(rank, world, port, mode, q):
    from torch.distributed.device_mesh import init_device_mesh

    from elastic.parallel import ddp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    ddp.BUCKET_BYTES = 2048  # several buckets: a.weight (4 KiB) alone in one
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    strat, model = ddp.DataParallel(mesh, _spec(mode), seed=7), Net()
    # The same, with a step cut short:
    cut, cut_model = ddp.DataParallel(mesh, _spec(mode), seed=7), Net()
    out = {"own_grads": [], "grads": [], "state": [], "cut_grads": []}
    names = [n for n, _ in model.named_parameters()]
    for step in range(3):
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch(rank, step)).backward()  # this rank's own gradient, not reduced
        out["own_grads"].append({n: p.grad.numpy().copy() for n, p in model.named_parameters()})
        out["grads"].append(_plain(_step(strat, model, rank, step)))
        out["state"].append(_state(strat, model))
        if step == 1:  # backward launched its buckets, then the step was lost before the reduction
            cut_model.zero_grad(set_to_none=True)
            cut.train_step(cut_model, [rank], lambda ids: batch(ids[0], 9), loss_fn, micro=1)
            dist.barrier()  # after the launched collectives, on every rank alike
        out["cut_grads"].append(_plain(_step(cut, cut_model, rank, step)))
    out["buckets"] = [[names[i] for i in b] for b in strat._buckets]
    # The state after step 1 loaded into a fresh strategy and model: step 2 as the original's.
    fresh, model2 = ddp.DataParallel(mesh, _spec(mode), seed=7), Net()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    saved = fresh.state_dict(model2, opt2)
    shared, own = out["state"][1]
    for key, arr in shared.items():
        saved["compression"][key].copy_(torch.from_numpy(arr))
    fresh.load_state_dict(model2, opt2, saved)
    for key, arr in own.items():
        fresh.own_state(model2)[key].copy_(torch.from_numpy(arr))
    out["restored"] = _plain(_step(fresh, model2, rank, 2))
    blank, model3 = ddp.DataParallel(mesh, _spec(mode), seed=7), Net()  # no state loaded
    out["blank"] = _plain(_step(blank, model3, rank, 2))
    q.put((rank, out))
    dist.destroy_process_group()


def _run(mode: str) -> list[dict]:
    return [o for _, o in run_spawned(_rank, WORLD, mode, timeout_s=150)]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        _equal(a[k], b[k]) if isinstance(a[k], dict) else (a[k] == b[k]).all() for k in a)


def _flat(grads: dict, names: list[str]) -> torch.Tensor:
    return torch.cat([torch.from_numpy(grads[n]).reshape(-1) for n in names])


@pytest.fixture(scope="module", params=["bf16", "topk", "powersgd"])
def ranks(request):
    return request.param, _run(request.param)


def test_every_rank_ends_each_step_with_the_same_gradient(ranks):
    _, (r0, r1) = ranks
    assert all(_equal(a, b) for a, b in zip(r0["grads"], r1["grads"]))


def test_each_mode_reduces_to_its_own_approximation_of_the_mean(ranks):
    mode, results = ranks
    got, buckets = results[0]["grads"], results[0]["buckets"]
    own = [[{n: torch.from_numpy(a) for n, a in r["own_grads"][s].items()} for r in results]
           for s in range(3)]
    if mode == "bf16":  # each half rounded to bfloat16, summed, rounded again
        for name, g in got[0].items():
            ref = (own[0][0][name] * 0.5).bfloat16() + (own[0][1][name] * 0.5).bfloat16()
            assert torch.equal(torch.from_numpy(g), ref.float()), name
    elif mode == "topk":  # per bucket: each rank's largest 5% of (its half + residual), summed
        residual = [[None] * len(buckets) for _ in results]
        for step in range(3):
            for k, names in enumerate(buckets):
                total = 0
                for r in range(WORLD):
                    acc = _flat({n: own[step][r][n].numpy() for n in names}, names) * 0.5
                    if residual[r][k] is not None:
                        acc = acc + residual[r][k]
                    keep = torch.zeros_like(acc, dtype=torch.bool)
                    keep[acc.abs().topk(max(1, -(-acc.numel() * 5 // 100))).indices] = True
                    total = total + torch.where(keep, acc, 0.0)
                    residual[r][k] = torch.where(keep, 0.0, acc)
                    # What the rank did not send is exactly its residual.
                    held = results[r]["state"][step][1][f"residual{k}"]
                    assert torch.equal(torch.from_numpy(held), residual[r][k])
                assert torch.equal(_flat(got[step], names), total)
    else:  # step 0 plain (start step 1); step 1: each matrix projected on one direction of the mean
        for name, g in got[0].items():
            assert torch.equal(torch.from_numpy(g), own[0][0][name] * 0.5 + own[0][1][name] * 0.5)
        mean = own[1][0]["a.weight"] * 0.5 + own[1][1]["a.weight"] * 0.5
        approx = torch.from_numpy(got[1]["a.weight"]).double()
        assert torch.linalg.matrix_rank(approx, rtol=1e-5) == 1  # float32's rounding aside
        u = torch.linalg.svd(approx).U[:, :1]
        torch.testing.assert_close(approx, u @ u.T @ mean.double(), rtol=1e-4, atol=1e-6)
        bias = own[1][0]["a.bias"] * 0.5 + own[1][1]["a.bias"] * 0.5
        assert torch.equal(torch.from_numpy(got[1]["a.bias"]), bias)
        steps = [int(r["state"][s][0]["step"]) for r in results for s in range(3)]
        assert steps == [1, 2, 3] * WORLD


def test_a_step_cut_short_leaves_the_state_as_it_was(ranks):
    _, results = ranks
    assert all(_equal(a, b) for r in results for a, b in zip(r["grads"], r["cut_grads"]))


def test_the_state_loaded_into_a_fresh_strategy_gives_the_next_step_bit_for_bit(ranks):
    mode, results = ranks
    assert all(_equal(r["restored"], r["grads"][2]) for r in results)
    # Not vacuous: without the state, the stateful modes reduce to other values.
    assert all(_equal(r["blank"], r["grads"][2]) == (mode == "bf16") for r in results)


def test_the_mode_alone_or_a_mapping_is_accepted_and_what_does_not_apply_is_refused():
    assert _spec("topk").grad_compression.error_feedback
    assert TrainSpec(model="m:f", dataset="m:f", loss="m:f", global_batch_size=2,
                     grad_compression="bf16").grad_compression.mode == "bf16"
    for extra, named in (({"strategy": "fsdp"}, "train.strategy: ddp"),
                         ({"tp": {"size": 2}}, "train.tp.size=2"),
                         ({"grad_compression": {"mode": "topk", "topk_ratio": 0}}, "topk_ratio")):
        with pytest.raises(ValueError, match=named):
            TrainSpec(model="m:f", dataset="m:f", loss="m:f", global_batch_size=2,
                      **{"grad_compression": "powersgd", **extra})


def test_a_fault_with_rank_private_state_restores_every_rank_from_storage():
    plan, why = choose_restore({0: 5, 1: 5}, FailureConfig(), private=True)
    assert isinstance(plan, FromStorage) and "error feedback" in why
    assert isinstance(choose_restore({0: 5, 1: 5}, FailureConfig())[0], FromPeer)


def test_orthogonalize_leaves_orthonormal_columns():
    p = torch.randn(10, 3, generator=torch.Generator().manual_seed(1))
    orthogonalize(p)
    torch.testing.assert_close(p.T @ p, torch.eye(3), atol=1e-5, rtol=0)
    assert PowerSgd.MIN_COMPRESSION_RATE == 2


@pytest.mark.parametrize("mode", ["topk", "powersgd"])
def test_a_run_resumed_from_a_checkpoint_ends_bit_identical_with_its_compression(tmp_path, mode):
    """Real Workers, one process per rank, no Ray: the checkpoint of step 6 holds PowerSGD's
    factors and step count and every rank's error feedback (each under its own rank), and a run
    restored from it ends as the uninterrupted one. Not vacuous: the compression changes the
    result (an uncompressed run ends elsewhere)."""
    from tests.spawn_ranks import run_ranks
    from tests.test_training_features import mlp_job

    comp = {"mode": mode, "powersgd_start_step": 3, "topk_ratio": 0.05}
    env = {"ELASTIC_BENCH_HIDDEN": "64"}
    whole = run_ranks(mlp_job(tmp_path / "a", grad_compression=comp), env=env)
    # Stopped at its step-6 checkpoint:
    run_ranks(mlp_job(tmp_path / "b", grad_compression=comp), steps=6, env=env)
    resumed = run_ranks(mlp_job(tmp_path / "c", grad_compression=comp), env=env,
                        candidates=[f"file://{tmp_path}/b/f/checkpoints/step_000000006"])
    assert resumed[0][4] == "storage" and resumed[0][5] == 6
    assert [o[2] for o in resumed] == [o[2] for o in whole]
    plain = run_ranks(mlp_job(tmp_path / "d"), env=env)
    assert plain[0][2] != whole[0][2]
