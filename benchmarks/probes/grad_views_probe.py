"""Does keeping gradients as views of the all-reduce buckets (torch DDP's gradient_as_bucket_view)
save anything over elastic's way (fresh gradients each step, one copy into the bucket)? One process,
one thread, the overhead benchmark's MLP; forward and backward of 48 samples, median of 15, each way
twice, alternated. Usage: python benchmarks/probes/grad_views_probe.py HIDDEN (1024: 1.3 M, 3072: 10.3 M)."""
import time, statistics, torch, sys
torch.set_num_threads(1)
from elastic.workload import build_mlp
H = int(sys.argv[1])
torch.manual_seed(0)
m = build_mlp(H); x = torch.randn(48, 256); y = torch.randint(0, 10, (48,))
params = list(m.parameters())
buf = torch.empty(sum(p.numel() for p in params))
def fresh():
    for p in params: p.grad = None
    torch.nn.functional.cross_entropy(m(x), y).backward()
    torch.cat([p.grad.reshape(-1) for p in reversed(params)], out=buf)
def views():
    buf.zero_()
    torch.nn.functional.cross_entropy(m(x), y).backward()
off = 0
for p in reversed(params):
    p.grad = buf[off:off+p.numel()].view_as(p); off += p.numel()
for name, f in (("fresh+copy", fresh), ("views", views), ("fresh+copy", fresh), ("views", views)):
    if name == "views":
        off = 0
        for p in reversed(params):
            p.grad = buf[off:off+p.numel()].view_as(p); off += p.numel()
    for _ in range(3): f()
    ts = []
    for _ in range(15):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    print(H, name, f"{statistics.median(ts)*1e3:.2f} ms")
    if name == "views": assert params[0].grad.data_ptr() >= buf.data_ptr()
