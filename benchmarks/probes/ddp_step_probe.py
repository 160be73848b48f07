"""elastic's DDP step against torch DDP in the same two torchrun processes: no Ray, no data path.

Both ranks train the overhead benchmark's MLP on one fixed batch of 48 samples each, one compute
thread, gloo, AdamW. Three variants, each its own model, run in rounds of STEPS steps whose order
rotates, and the median of the rounds' mean step times is printed:
  * torch DDP: `DistributedDataParallel(gradient_as_bucket_view=True)`, as in `python -m benchmarks overhead`;
  * elastic before: the DataParallel strategy as it was before this probe was written: gradients
    concatenated into their bucket, divided by the world size after the all-reduce, and the
    step's statistics in an all-reduce of their own after the gradients';
  * elastic now: `elastic.parallel.ddp.DataParallel` as it is, the statistics handed to
    `reduce_gradients`.
The two elastic variants start from the same weights and must stay bit-identical (checked).
Usage: python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/probes/ddp_step_probe.py \
           [HIDDEN] [STEPS] [ROUNDS]   (default 3072: 10.3 M parameters, 10 steps, 16 rounds)"""
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic.workload import build_mlp
from elastic.parallel.ddp import DataParallel



class Before(DataParallel):
    """Concatenate, sum, then divide; no statistics carried."""

    def _launch(self, k):
        torch.cat([self._params[i].grad.reshape(-1) for i in self._buckets[k]], out=self._bufs[k])
        self._works.append(dist.all_reduce(self._bufs[k], group=self.mesh.get_group("dp"), async_op=True))

    def reduce_gradients(self, model, extra=None):
        while self._next < len(self._buckets):
            self._launch(self._next)
            self._next += 1
        for k, work in enumerate(self._works):
            work.wait()
            buf, offset = self._bufs[k].mul_(self._scale), 0
            for i in self._buckets[k]:
                p = self._params[i]
                p.grad = buf[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self._works = []
        return None


def main() -> None:
    hidden, steps, rounds = (int(a) for a in (sys.argv[1:] + ["3072", "10", "16"][len(sys.argv) - 1:]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    x, y = torch.randn(48, 256), torch.randint(0, 10, (48,))
    loss_of = torch.nn.functional.cross_entropy
    ddp = DDP(build_mlp(hidden), gradient_as_bucket_view=True)
    ddp_opt = torch.optim.AdamW(ddp.parameters())

    def torch_ddp():
        ddp_opt.zero_grad(set_to_none=True)
        loss_of(ddp(x), y).backward()
        ddp_opt.step()

    first = build_mlp(hidden)

    def elastic(cls):
        model = build_mlp(hidden)
        model.load_state_dict(first.state_dict())
        opt, strategy = torch.optim.AdamW(model.parameters()), cls(mesh)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = strategy.train_step(model, [0], lambda ids: (x, y), lambda m, b: loss_of(m(b[0]), b[1]), 48)
            flags = [torch.full((), 0.0) for _ in range(3)]
            stats = torch.stack([loss.float(), flags[0], flags[1], (~torch.isfinite(loss)).float(), flags[2]])
            if strategy.reduce_gradients(model, stats) is None:
                dist.all_reduce(stats)
            stats.cpu()[1].item()
            opt.step()
        return step, model

    before, before_model = elastic(Before)
    now, now_model = elastic(DataParallel)
    variants = {"torch DDP": torch_ddp, "elastic before": before, "elastic now": now}
    for step in variants.values():
        for _ in range(3):
            step()
    same = all(torch.equal(a, b) for a, b in zip(before_model.parameters(), now_model.parameters()))
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            t = time.perf_counter()
            for _ in range(steps):
                variants[name]()
            dist.barrier()
            times[name].append((time.perf_counter() - t) / steps)
    if dist.get_rank() == 0:
        ddp_s = statistics.median(times["torch DDP"])
        print(f"{sum(p.numel() for p in first.parameters()) / 1e6:.1f} M parameters, {rounds} rounds of {steps} "
              f"steps; elastic before and now bit-identical after 3 steps: {same}")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"  {name:15s} median {med * 1e3:7.2f} ms/step, steps/s / torch DDP {ddp_s / med:.3f} "
                  f"(rounds {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
