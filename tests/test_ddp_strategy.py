"""elastic's DataParallel: the gradients it leaves are the mean of every rank's, with real gloo
ranks (spawned processes), a parameter that gets no gradient included; the values handed to
`reduce_gradients` come back summed over the world; a model without buffers issues no broadcast,
and one with BatchNorm ends each step with the first rank's buffers, on both reduction paths."""

import pytest
import torch
import torch.distributed as dist

from tests.support.spawned import run_spawned

pytestmark = pytest.mark.timeout(120)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(7, 300)  # 2400 parameters: several buckets with a small cap below
        self.b = torch.nn.Linear(300, 3)
        self.unused = torch.nn.Linear(3, 3)  # never in the forward: no gradient, ever

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def batch(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)


def loss_fn(model, b):
    return torch.nn.functional.mse_loss(model(b[0]), b[1])


def _rank(rank, world, port, q):
    from torch.distributed.device_mesh import init_device_mesh

    from elastic.parallel import ddp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ddp.BUCKET_BYTES = 4096  # read as the model is hooked: three buckets, `a.weight` alone in one
    strat = ddp.DataParallel(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    model = Net()
    out = []
    broadcasts = []
    real = dist.broadcast
    dist.broadcast = lambda *a, **kw: broadcasts.append(1) or real(*a, **kw)
    for _ in range(2):  # the second step reuses the buckets and their buffers
        model.zero_grad(set_to_none=True)
        strat.train_step(model, [rank], lambda ids: batch(ids[0]), loss_fn, micro=1)
        extra = torch.tensor([rank + 1.0, 1.0])
        summed = strat.reduce_gradients(model, extra)  # the step's statistics ride on the same group
        assert summed is extra and extra.tolist() == [world * (world + 1) / 2, world]
        # As numpy arrays: pickled by value (a tensor would be shared by a file descriptor that
        # this process, about to exit, could no longer hand over).
        out.append({n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None})
    assert not broadcasts  # no buffers: nothing but the gradients' all-reduces
    q.put((rank, out, len(strat._buckets)))
    dist.destroy_process_group()


def reference(world: int) -> dict:
    """Each rank's own gradients, from one process."""
    grads = []
    for r in range(world):
        model = Net()
        loss_fn(model, batch(r)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    return grads


@pytest.mark.parametrize("world", [2, 3])
def test_the_gradients_are_the_mean_over_the_ranks(world):
    results = [(r, [{n: torch.from_numpy(a) for n, a in step.items()} for step in steps], nb)
               for r, steps, nb in run_spawned(_rank, world)]
    ref = reference(world)
    for rank, steps, num_buckets in results:
        assert num_buckets >= 3
        for got in steps:
            assert torch.equal(got["unused.weight"], torch.zeros(3, 3))  # reduced as zeros, like torch DDP
            for name in ref[0]:
                total = sum(g[name] for g in ref)
                if world == 2:  # halving is exact: the sum of halves is the half of the sum, bit for bit
                    assert torch.equal(got[name], total * 0.5), name
                else:  # each rank's share rounded before the sum: float32's own tolerance
                    torch.testing.assert_close(got[name], total / world)
    # Every rank holds the same averaged gradient, bit for bit.
    for _, steps, _ in results[1:]:
        for got, first in zip(steps, results[0][1]):
            assert all(torch.equal(got[n], first[n]) for n in first)


class BNNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(7, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.b = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


def _bn_rank(rank, world, port, overlap, q):
    from torch.distributed.device_mesh import init_device_mesh

    from elastic.parallel import ddp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    strat = ddp.DataParallel(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    strat.overlap = overlap  # False: one flat all-reduce after backward, as a pipeline's stages
    model = BNNet()
    out = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        # Two micro-batches: a step's buffers are the first rank's after both forwards.
        strat.train_step(model, [rank, rank + 10 * (step + 1)], lambda ids: batch(ids[0]), loss_fn, micro=1)
        strat.reduce_gradients(model, torch.zeros(2) if overlap else None)
        out.append({n: b.numpy().copy() for n, b in model.named_buffers()})
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("overlap", [True, False])
def test_every_rank_ends_the_step_with_the_first_ranks_buffers(overlap):
    (_, first), (_, second) = run_spawned(_bn_rank, 2, overlap)
    assert all(a[n].tobytes() == b[n].tobytes() for a, b in zip(first, second) for n in a)
    assert first[0]["bn.num_batches_tracked"] == 2 and first[1]["bn.num_batches_tracked"] == 4
    assert first[0]["bn.running_mean"].tobytes() != first[1]["bn.running_mean"].tobytes()  # they move
