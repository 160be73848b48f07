"""The optimizer state made before a state dict is taken of an optimizer that has not stepped
(elastic/parallel/optim_state.py): the same structure and values DCP's own init makes by running
a step on zero gradients, without the step's arithmetic; DTensors like the parameters under FSDP2."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import _init_optim_state, get_state_dict

from elastic.parallel.optim_state import prime_optimizer_state


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    m[0].bias.requires_grad_(False)  # a frozen parameter gets no state either way
    return m


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for i in a:
        if a[i].keys() != b[i].keys():
            return False
        for k, x in a[i].items():
            y = b[i][k]
            if isinstance(x, torch.Tensor):
                if type(x) is not type(y) or x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                    return False
            elif x != y:
                return False
    return True


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.SGD([{"params": ps[:2], "lr": 0.1}, {"params": ps[2:], "lr": 0.01, "momentum": 0.5}]),
], ids=["adamw", "adam-amsgrad-foreach", "sgd-momentum", "sgd-two-groups"])
def test_primed_state_is_what_dcps_init_makes_without_a_step(make):
    m = _model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    by_dcp, primed = make(list(m.parameters())), make(list(m.parameters()))
    _init_optim_state(by_dcp)
    assert prime_optimizer_state(primed)
    assert _same(by_dcp.state_dict()["state"], primed.state_dict()["state"])
    assert all(p.grad is None for p in m.parameters())  # no gradients left behind
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())  # no parameter moved
    assert prime_optimizer_state(primed)  # a state already made is kept


def test_no_state_is_made_while_a_gradient_waits_for_its_step_as_dcp_makes_none():
    m = _model()
    m(torch.ones(2, 8)).sum().backward()  # a step computed, its update not taken (a skipped bad step)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    assert not prime_optimizer_state(opt) and not opt.state
    _init_optim_state(opt)
    assert not opt.state  # DCP makes none either: the first real step starts the count at 1


def test_an_optimizer_whose_step_needs_a_closure_is_left_to_dcp():
    m = _model()
    opt = torch.optim.LBFGS(m.parameters())
    assert not prime_optimizer_state(opt) and not opt.state


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_fsdp2_state_is_dtensors_like_the_parameters_and_get_state_dict_takes_no_step(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    mesh = init_device_mesh("cpu", (1,))
    m = fully_shard(_model(), mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ref = torch.optim.AdamW(m.parameters(), lr=1e-3)
    _init_optim_state(ref)
    assert prime_optimizer_state(opt)
    assert _same(ref.state_dict()["state"], opt.state_dict()["state"])
    states = [s for s in opt.state.values()]
    assert states and all(isinstance(s["exp_avg"], DTensor) and s["exp_avg"].placements == p.placements
                          for p, s in opt.state.items())
    _, osd = get_state_dict(m, opt)  # DCP finds the state made: no step of its own
    assert all(s["step"].item() == 1.0 for s in opt.state.values()) and osd["state"]
