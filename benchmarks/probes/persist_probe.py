"""Where a checkpoint persist to S3 spends its time, and whose CPU it uses, in one process.

Same bytes as `python -m benchmarks checkpoint` at 10.3 M parameters (about 120 MB: 2 model and 4 Adam
tensors of N floats each), a SeaweedFS S3 endpoint on loopback, world size 1 on gloo.
1. elastic's AsyncCheckpointer (agreement, DCP plan and local staging, upload, commit), 5
   checkpoints, timed per phase: with nothing else running, then with the benchmark's MLP
   training on one thread of the same process (as a rank's persist runs beside its training).
2. The raw figure the benchmark compares with: one s3fs `pipe` of the same files from memory,
   after each persist, in the same setting (idle, or beside the same training thread): the
   throughput ratio of elastic's persist to raw s3fs with the machine's contention the same for both.
3. The CPU one upload of those files costs: this process (s3fs, aiobotocore) and the SeaweedFS
   server, which here shares the machine's cores with training.
Usage: python benchmarks/probes/persist_probe.py [N] [REPS]   (default 5000000: 120 MB; 5 of each per setting)"""
import os, statistics, sys, threading, time, warnings
warnings.filterwarnings("ignore")
import psutil, torch, torch.distributed as dist
import elastic.checkpoint.dcp_io as D
import elastic.checkpoint.persister as C
from training_thread import train
from elastic.storage import Storage
from tests.support.seaweedfs import seaweedfs_server

torch.set_num_threads(1)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 5_000_000
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
dist.init_process_group("gloo", rank=0, world_size=1)
pg = dist.new_group(backend="gloo")
torch.manual_seed(0)
state = {"model": {f"w{i}": torch.randn(N) for i in range(2)}, "opt": {f"m{i}": torch.randn(N) for i in range(4)}}
phases: dict[str, list[float]] = {}


def timed(name, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            phases.setdefault(name, []).append(time.perf_counter() - t0)
    return wrapper


C.AsyncCheckpointer._agree = timed("agree", C.AsyncCheckpointer._agree)
C.AsyncCheckpointer._commit_with_retries = timed("commit", C.AsyncCheckpointer._commit_with_retries)
D.dcp.save = timed("DCP plan + staging", D.dcp.save)
D.upload = timed("upload", D.upload)  # in the worker's process (D.UPLOAD_IN_CHILD False)
D.uploader.put = timed("upload", D.uploader.put)  # in the uploader's child process (the default)


def cpu_s(procs) -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def raw_write(fs, bucket: str, blobs: dict, i: int, weed) -> tuple[float, float, float]:
    """One s3fs `pipe` of the files from memory: (seconds, this process's CPU, SeaweedFS's CPU)."""
    c0, w0, t0 = time.process_time(), cpu_s(weed), time.perf_counter()
    fs.pipe({f"{bucket}/raw{i}/{k}": v for k, v in blobs.items()})
    return time.perf_counter() - t0, time.process_time() - c0, cpu_s(weed) - w0


with seaweedfs_server() as s3:
    fs = s3.filesystem()
    weed = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "weed"]
    blobs: dict = {}
    for mode in ("idle", "training"):
        phases.clear()
        stop, steps = threading.Event(), [0]
        trainer = threading.Thread(target=train, args=(stop, steps), daemon=True)
        if mode == "training":
            trainer.start()
            time.sleep(2)
        ck = C.AsyncCheckpointer(Storage(f"{s3.uri}/probe-{mode}", s3.storage_options), f"{s3.uri}/probe-{mode}/c",
                                 0, 1, "ddp", pg, 2, 0.5, 2)
        D.uploader.prestart(s3.uri, s3.storage_options)  # else the first persist uploads in this process
        D.uploader.ready(60)
        persist, raw = [], []
        for i in range(1, REPS + 1):  # a persist, then a raw write of the same files, alternated
            ck.save(i, 0, state, {})
            ck.wait()
            (r,) = ck.drain()
            assert r.committed, r.error
            persist.append(r.persist_s)
            if not blobs:  # the files of a persist, the bytes every raw write sends
                folder = f"{s3.bucket}/probe-{mode}/c/" + sorted(fs.ls(f"{s3.bucket}/probe-{mode}/c"))[-1].rsplit("/", 1)[1]
                blobs = {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.find(folder)}
                print(f"{len(blobs)} files, {sum(len(b) for b in blobs.values()) / 1e6:.0f} MB")
            raw.append(raw_write(fs, s3.bucket, blobs, f"{mode}{i}", weed))
        stop.set()
        trainer.join() if trainer.is_alive() else None
        p, w = statistics.median(persist), statistics.median(x[0] for x in raw)
        print(f"{mode}: persist median {p:.2f} s (" + ", ".join(f"{x:.2f}" for x in persist) + "); raw s3fs pipe "
              f"median {w:.2f} s (" + ", ".join(f"{x[0]:.2f}" for x in raw) + f"); persist / raw time {w / p:.2f} as a "
              f"throughput ratio; CPU per raw write: this process {statistics.median(x[1] for x in raw):.2f} s, "
              f"SeaweedFS {statistics.median(x[2] for x in raw):.2f} s")
        for name, ts in phases.items():
            print(f"  {name}: median {statistics.median(ts):.2f} s")
dist.destroy_process_group()
