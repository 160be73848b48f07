"""`python -m benchmarks data`: what reading ahead (`train.prefetch`, `train.data_workers`) buys when
every sample is an object in S3.

The common workload's samples (`workload.TeacherDataset`: 8192 of them, 256 float32 inputs and a
label), one S3 object each in a SeaweedFS bucket, read by `ObjectStoreDataset` with one GET per
sample, as a map-style dataset over a bucket of files (images, documents) reads. elastic DDP
trains the overhead benchmark's MLP on them, 2 ranks on the 2 one-CPU worker nodes of a local
cluster, global batch 96 (48 GETs per rank per step), one run per mode:

* in-memory: the same samples from memory (`workload.build_dataset`): the floor, nothing read;
* inline: read and collated on the training thread when the step needs them (the default);
* thread: `train.prefetch: true`, the next step's batch collated on one thread of the rank;
* workers-N: `train.data_workers: N` DataLoader worker processes per rank;
* batched: inline, from a dataset that reads a batch at once (`__getitems__`: the batch's GETs
  sent together, one s3fs `cat` of its paths), as torch's DataLoader and elastic both call it.

Every mode trains on the same samples in the same order, so every run must end with the same
model: each run's digests are compared with the in-memory run's, and a mismatch is an error.

`--latency-ms`: each setting puts a relay in front of the S3 endpoint that answers every request
that much later (`SlowLink(latency_s=...)`), as a remote object store's first byte comes later
than loopback's; 0 is SeaweedFS on loopback with no relay. Figures: the median step after the
warm-up (the overhead benchmark's step clock), `speed` = in-memory step ÷ the mode's step (1.0:
reading costs nothing), and `hidden` = the share of inline's read time the mode takes off the
step ((inline - mode) ÷ (inline - in-memory)).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import torch

from benchmarks.output import append_markdown, append_results, emit, parse_systems
from benchmarks.overhead import (HIDDEN_ENV, STEP_LOG_ENV, connect_with_env, num_params, parse_hidden,
                                    read_step_log, rotated)

NUM_WORKERS, GLOBAL_BATCH, SEED = 2, 96, 0
NUM_STEPS, WARMUP_STEPS = 40, 8
DEFAULT_HIDDEN = 3072  # 10.3 M parameters: a step's compute (~0.18 s here) and 48 loopback GETs (~0.16 s) alike
DEFAULT_LATENCY_MS = "0,15"
MODES = ["in-memory", "inline", "thread", "workers-2", "workers-4", "batched"]
URI_ENV = "ELASTIC_BENCH_DATA_URI"
OPTIONS_ENV = "ELASTIC_BENCH_DATA_STORAGE_OPTIONS"
X_BYTES = 4 * 256  # float32 inputs; the label follows as 8 bytes, little-endian


# ---------------------------------------------------------------- the dataset
def encode(x: torch.Tensor, y: torch.Tensor) -> bytes:
    return x.to(torch.float32).contiguous().numpy().tobytes() + int(y).to_bytes(8, "little", signed=True)


def decode(data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    if len(data) != X_BYTES + 8:
        raise ValueError(f"a sample object is {X_BYTES + 8} bytes, got {len(data)}")
    x = torch.frombuffer(bytearray(data[:X_BYTES]), dtype=torch.float32)
    return x, torch.tensor(int.from_bytes(data[X_BYTES:], "little", signed=True))


def sample_path(root: str, i: int) -> str:
    return f"{root.rstrip('/')}/{i:07d}"


class ObjectStoreDataset(torch.utils.data.Dataset):
    """Sample i is the object `<uri>/<i:07d>`: one GET each. The filesystem is opened lazily in
    each process that reads (a DataLoader worker gets the URI and options, not a connection)."""

    def __init__(self, uri: str, num_samples: int, storage_options: dict | None = None):
        self.uri, self.num_samples, self.storage_options = uri, num_samples, dict(storage_options or {})
        self._fs = self._root = self._kw = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fs": None, "_root": None, "_kw": None}

    def __len__(self) -> int:
        return self.num_samples

    def _open(self):
        """This process's filesystem, root and read options, opened on first use."""
        if self._fs is None:
            import fsspec
            self._fs, self._root = fsspec.core.url_to_fs(self.uri, **self.storage_options)
            # One GET a sample: s3fs asks for the object's size first (a HEAD) unless told not to split it.
            self._kw = {"max_concurrency": 1} if type(self._fs).__name__ == "S3FileSystem" else {}
        return self._fs, self._root, self._kw

    def __getitem__(self, i: int):
        fs, root, kw = self._open()
        return decode(fs.cat_file(sample_path(root, int(i)), **kw))


class BatchedObjectStoreDataset(ObjectStoreDataset):
    """The same objects; a batch's GETs are sent together (one s3fs `cat` of every path, run
    concurrently on fsspec's event loop) instead of one after the other."""

    def __getitems__(self, ids: list[int]) -> list:
        fs, root, kw = self._open()
        paths = [sample_path(root, int(i)) for i in ids]
        blobs = fs.cat(paths, **kw)
        return [decode(blobs[p]) for p in paths]


def build_dataset(cls: type[ObjectStoreDataset] = ObjectStoreDataset) -> ObjectStoreDataset:
    """The job's `train.dataset`: the objects at $ELASTIC_BENCH_DATA_URI."""
    from elastic.workload import NUM_SAMPLES
    uri = os.environ.get(URI_ENV)
    if not uri:
        raise ValueError(f"{URI_ENV} is not set: `python -m benchmarks data` sets it in the job's environment")
    return cls(uri, NUM_SAMPLES, json.loads(os.environ.get(OPTIONS_ENV) or "{}"))


def build_batched_dataset() -> BatchedObjectStoreDataset:
    return build_dataset(BatchedObjectStoreDataset)


def write_samples(fs, root: str, ids=None) -> int:
    """Every sample of the common workload (or those of `ids`) as its own object under root;
    returns the dataset's length."""
    from elastic.workload import TeacherDataset
    ds = TeacherDataset()
    fs.pipe({sample_path(root, i): encode(*ds[i]) for i in (range(len(ds)) if ids is None else ids)})
    return len(ds)


# ---------------------------------------------------------------- figures (pure)
def median_step(times: list[float], warmup_steps: int) -> float:
    """The median interval between step ends after the warm-up (t[s-1] ends step s)."""
    ts = sorted(times)
    steps = [b - a for a, b in zip(ts[warmup_steps - 1:], ts[warmup_steps:])]
    if not steps:
        raise ValueError(f"{len(ts)} step times leave nothing after a {warmup_steps}-step warm-up")
    return statistics.median(steps)


def add_figures(group: list[dict]) -> None:
    """speed and hidden for one latency and repetition, from its in-memory and inline runs."""
    by = {r["mode"]: r["step_s"] for r in group}
    floor, inline = by.get("in-memory"), by.get("inline")
    for r in group:
        r["speed"] = floor / r["step_s"] if floor else None
        read = inline - floor if inline is not None and floor is not None else None
        r["hidden"] = (inline - r["step_s"]) / read if read and r["mode"] != "in-memory" else None


def summarise(records: list[dict]) -> tuple[list[dict], str]:
    lines = ["| added latency | mode | runs | median step_s | speed (in-memory step ÷ step) | read time hidden |",
             "|---|---|---|---|---|---|"]
    rows = []
    for lat in sorted({r["latency_ms"] for r in records}):
        for mode in MODES:
            mine = [r for r in records if r["latency_ms"] == lat and r["mode"] == mode]
            if not mine:
                continue

            def med(key):
                vals = [r[key] for r in mine if r.get(key) is not None]
                return statistics.median(vals) if vals else None
            row = {"latency_ms": lat, "mode": mode, "n": len(mine), "step_s": med("step_s"), "speed": med("speed"),
                   "hidden": med("hidden")}
            rows.append(row)
            f = (lambda v, fmt: "-" if v is None else fmt.format(v))
            lines.append(f"| {lat:g} ms | {mode} | {len(mine)} | {row['step_s']:.3f} | {f(row['speed'], '{:.2f}')} | "
                         f"{f(row['hidden'], '{:.0%}')} |")
    return rows, "\n".join(lines) + "\n"


def plot(path: str, records: list[dict]) -> None:
    """Median step time per mode, one group of bars per latency; dots are the repetitions."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lats = sorted({r["latency_ms"] for r in records})
    modes = [m for m in MODES if any(r["mode"] == m for r in records)]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        for i, lat in enumerate(lats):
            vals = [r["step_s"] for r in records if r["latency_ms"] == lat and r["mode"] == mode]
            if not vals:
                continue
            x = i + (j - (len(modes) - 1) / 2) * width
            ax.bar(x, statistics.median(vals), width=width * 0.9, color=f"C{j}", label=mode if i == 0 else None)
            ax.scatter([x] * len(vals), vals, color="black", zorder=3, s=8)
    ax.set_xticks(range(len(lats)), [f"+{lat:g} ms per request" if lat else "loopback" for lat in lats])
    ax.set_ylabel("s/step (median)")
    ax.legend(fontsize=7)
    ax.set_title("python -m benchmarks data: one S3 GET per sample, 48 per rank per step", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- the runs
def job(mode: str, work: str) -> dict:
    train = {"model": "elastic.workload:build_model", "loss": "elastic.workload:loss_fn",
             "optimizer": "benchmarks.overhead:timed_optimizer", "global_batch_size": GLOBAL_BATCH,
             "dataset": {"in-memory": "elastic.workload:build_dataset",
                         "batched": "benchmarks.data:build_batched_dataset"}.get(
                             mode, "benchmarks.data:build_dataset")}
    if mode == "thread":
        train["prefetch"] = True
    elif mode.startswith("workers-"):
        train["data_workers"] = int(mode.split("-")[1])
    return {"run": {"name": f"bench-data-{uuid.uuid4().hex[:8]}", "num_steps": NUM_STEPS, "seed": SEED},
            "scaling": {"num_workers": NUM_WORKERS},
            # Only the final checkpoint, after the last timed step.
            "checkpoint": {"storage_uri": "file://" + os.path.join(work, "runs"), "every_steps": NUM_STEPS},
            "train": train}


def parse_latencies(arg: str) -> list[float]:
    try:
        out = [float(x) for x in arg.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(x < 0 for x in out):
        raise ValueError(f"--latency-ms wants milliseconds >= 0, comma-separated (e.g. {DEFAULT_LATENCY_MS}), "
                         f"got {arg!r}")
    return out


def main(args) -> int:
    from elastic import Trainer
    from elastic.local_cluster import local_cluster
    from tests.support.seaweedfs import seaweedfs_server
    from tests.support.slow_link import SlowLink

    modes = parse_systems("data", args.systems, list(MODES))
    if modes is None:
        return 2
    try:
        latencies = parse_latencies(args.latency_ms or DEFAULT_LATENCY_MS)
        widths = parse_hidden(args.hidden or str(DEFAULT_HIDDEN))
        if len(widths) != 1:
            raise ValueError(f"--hidden takes one width here, got {len(widths)}")
    except ValueError as e:
        print(f"python -m benchmarks data: {e}", file=sys.stderr)
        return 2
    (hidden,) = widths
    if "in-memory" not in modes or "inline" not in modes:
        print("python -m benchmarks data: --systems must include in-memory and inline (every figure is relative to them)",
              file=sys.stderr)
        return 2
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="elastic-bench-data-")
    step_log = os.path.join(work, "steps.jsonl")
    records: list[dict] = []
    t_start = time.time()
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(seaweedfs_server(data_dir=os.path.join(work, "s3")))
        fs = s3.filesystem()
        t0 = time.time()
        num_samples = write_samples(fs, f"{s3.bucket}/bench-data")
        print(f"[data] wrote {num_samples} sample objects in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
        cluster = stack.enter_context(local_cluster(num_worker_nodes=NUM_WORKERS, cpus_per_node=1))
        host, port = s3.endpoint_url.rsplit("/", 1)[1].split(":")
        for lat in latencies:
            link = stack.enter_context(SlowLink(host, int(port), None, latency_s=lat / 1e3)) if lat else None
            options = {**s3.storage_options, **({"endpoint_url": link.url} if link else {})}
            where = {URI_ENV: f"{s3.uri}/bench-data", OPTIONS_ENV: json.dumps(options)}
            os.environ.update(where)  # the driver builds the dataset too (its length)
            connect_with_env(cluster, {HIDDEN_ENV: str(hidden), STEP_LOG_ENV: step_log, **where})
            for rep in range(args.reps):
                group = []
                digests = None
                for mode in ["in-memory"] + rotated([m for m in modes if m != "in-memory"], rep):
                    cluster.ensure_worker_nodes(NUM_WORKERS)
                    open(step_log, "w").close()
                    t0 = time.time()
                    result = Trainer(job(mode, work)).fit(progress=False)
                    shutil.rmtree(os.path.join(work, "runs"), ignore_errors=True)
                    if result.events_of("recovered") or result.metrics["step"] != NUM_STEPS:
                        raise RuntimeError(f"the {mode} run was not fault-free: {result.summary()}")
                    digests = digests or result.digests
                    if result.digests != digests:
                        raise RuntimeError(f"the {mode} run ended with another model than the in-memory run: "
                                           f"it did not train on the same samples in the same order")
                    lines = read_step_log(step_log)
                    if len(lines) != NUM_STEPS:
                        raise RuntimeError(f"the step log has {len(lines)} lines for {NUM_STEPS} steps")
                    rec = {"bench": "data", "mode": mode, "latency_ms": lat, "rep": rep, "params": num_params(hidden),
                           "hidden": hidden, "step_s": median_step([x["t"] for x in lines], WARMUP_STEPS),
                           "num_steps": NUM_STEPS, "warmup_steps": WARMUP_STEPS, "num_workers": NUM_WORKERS,
                           "global_batch": GLOBAL_BATCH, "same_model": True, "total_s": time.time() - t0}
                    group.append(rec)
                    print(f"[data] +{lat:g} ms rep {rep} {mode}: {rec['step_s']:.3f} s/step", file=sys.stderr,
                          flush=True)
                add_figures(group)
                for r in group:
                    emit(r)
                if args.out:
                    append_results(args.out, group)
                records += group
    rows, table = summarise(records)
    summary = {"bench": "data", "summary": True, "rows": rows, "wall_s": time.time() - t_start}
    emit(summary)
    notes = (f"elastic DDP, {NUM_WORKERS} ranks on the one-CPU worker nodes of a local ray.cluster_utils.Cluster, MLP "
             f"256 -> {hidden} -> {hidden} -> 10 ({num_params(hidden) / 1e6:.1f} M parameters), AdamW, global batch "
             f"{GLOBAL_BATCH}; each sample one S3 object in SeaweedFS on loopback, one GET per sample; added latency: "
             f"a relay answering each request that much later. Median step after a {WARMUP_STEPS}-step warm-up of "
             f"{NUM_STEPS}; every run ended with the in-memory run's model.")
    title = "### data (reading ahead from S3, same run)\n\n"
    print(title + table + f"\n- {notes}")
    if args.out:
        append_markdown(args.out, title + table + f"\n- {notes}\n\n")
        command = (f"python -m benchmarks data --reps {args.reps} --latency-ms {args.latency_ms or DEFAULT_LATENCY_MS} "
                   f"--hidden {hidden}" + (f" --systems {args.systems}" if args.systems else "") + f" --out {args.out}")
        with open(os.path.join(args.out, "data.json"), "w") as f:
            json.dump({"command": command, "notes": notes, **summary}, f, indent=2)
        plot(os.path.join(args.out, "data.png"), records)
        print(f"wrote {args.out}/results.jsonl, results.md, data.json, data.png")
    shutil.rmtree(work, ignore_errors=True)
    return 0
