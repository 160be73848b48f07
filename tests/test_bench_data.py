"""`python -m benchmarks data`: its S3 dataset against real SeaweedFS, the relay that adds latency, the
figures it derives (pure), and its command line. The benchmark itself runs a cluster:
`python -m benchmarks data`."""
import argparse
import pickle
import socket
import threading
import time
import uuid

import pytest
import torch

from benchmarks import data as bench
from benchmarks.cli import add_bench_args
from elastic.workload import TeacherDataset
from elastic.data.prefetch import collate
from tests.support.slow_link import SlowLink


@pytest.mark.s3
def test_the_object_store_dataset_reads_back_the_workload_sample_for_sample(s3_server):
    fs = s3_server.filesystem()
    prefix = f"data-{uuid.uuid4().hex[:8]}"
    ref = TeacherDataset()
    # Only the samples read below (all 8,192 took 40 s of a 2-core machine's CI time).
    n = bench.write_samples(fs, f"{s3_server.bucket}/{prefix}", ids=(0, 1, 3, 7, 4097, 8000, len(ref) - 1))
    assert n == len(ref)
    ds = bench.ObjectStoreDataset(f"{s3_server.uri}/{prefix}", n, s3_server.storage_options)
    # As a DataLoader worker gets it: pickled before any read, and again after one (no live connection travels).
    fresh = pickle.loads(pickle.dumps(ds))
    for d in (fresh, ds, pickle.loads(pickle.dumps(ds))):
        for i in (0, 1, 4097, n - 1):
            x, y = d[i]
            assert torch.equal(x, ref[i][0]) and torch.equal(y, ref[i][1]) and y.dtype == ref[i][1].dtype
    # A batch read at once: the samples asked for, in the order asked (repeats included).
    batched = bench.BatchedObjectStoreDataset(f"{s3_server.uri}/{prefix}", n, s3_server.storage_options)
    ids = [7, 3, 8000, 3, 0]
    got = collate(batched, ids)
    want = collate(ref, ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    fs.rm(f"{s3_server.bucket}/{prefix}", recursive=True)


def test_a_sample_object_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="1032 bytes, got 4"):
        bench.decode(b"abcd")


def _reply_server(chunks: list[bytes]):
    """A TCP server that answers each request with `chunks`, written separately."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while c.recv(100):
                for chunk in chunks:
                    c.sendall(chunk)
    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_the_relay_delivers_every_reply_whole_in_order_and_no_sooner_than_its_latency():
    chunks = [bytes([k]) * 5000 for k in range(20)]  # 100 kB in 20 writes: many reads on the relay's side
    srv = _reply_server(chunks)
    want = b"".join(chunks)
    with SlowLink("127.0.0.1", srv.getsockname()[1], None, latency_s=0.05) as link:
        with socket.create_connection(("127.0.0.1", link.port)) as c:
            for _ in range(3):
                t0 = time.monotonic()
                c.sendall(b"request")
                got = b""
                while len(got) < len(want):
                    got += c.recv(65536)
                # A lower bound only: the relay holds each reply back; how much later it arrives is the machine's.
                assert time.monotonic() - t0 >= 0.05
                assert got == want
    srv.close()


def test_a_negative_latency_is_refused():
    with pytest.raises(ValueError, match="latency_s must be >= 0"):
        SlowLink("127.0.0.1", 1, None, latency_s=-1)


def test_the_step_is_the_median_interval_after_the_warm_up():
    # t[s-1] ends step s; with a 2-step warm-up, steps 3.. count: 1.0, 3.0, 1.5 -> 1.5.
    assert bench.median_step([0.0, 9.0, 10.0, 13.0, 14.5], warmup_steps=2) == 1.5
    with pytest.raises(ValueError, match="nothing after"):
        bench.median_step([0.0, 1.0], warmup_steps=2)


def test_speed_is_against_the_in_memory_floor_and_hidden_is_the_share_of_inline_read_time_saved():
    group = [{"mode": "in-memory", "step_s": 0.2}, {"mode": "inline", "step_s": 1.0},
             {"mode": "workers-4", "step_s": 0.4}, {"mode": "thread", "step_s": 1.1}]
    bench.add_figures(group)
    by = {r["mode"]: r for r in group}
    assert by["in-memory"]["speed"] == 1.0 and by["in-memory"]["hidden"] is None
    assert by["inline"]["speed"] == pytest.approx(0.2) and by["inline"]["hidden"] == 0.0
    assert by["workers-4"]["speed"] == pytest.approx(0.5) and by["workers-4"]["hidden"] == pytest.approx(0.75)
    assert by["thread"]["hidden"] == pytest.approx(-0.125)  # slower than inline: a negative share, not hidden away
    rows, table = bench.summarise([{**r, "latency_ms": 15.0} for r in group])
    assert [r["mode"] for r in rows] == ["in-memory", "inline", "thread", "workers-4"]  # MODES order
    assert "| 15 ms | workers-4 | 1 | 0.400 | 0.50 | 75% |" in table


def _args(*argv):
    p = argparse.ArgumentParser()
    add_bench_args(p)
    return p.parse_args(["data", *argv])


def test_the_cli_refuses_bad_settings_before_starting_anything(capsys):
    assert bench.main(_args("--latency-ms", "15,-3")) == 2
    assert "--latency-ms wants milliseconds >= 0" in capsys.readouterr().err
    assert bench.main(_args("--systems", "inline,workers-2")) == 2
    assert "must include in-memory and inline" in capsys.readouterr().err
    assert bench.main(_args("--systems", "inline,in-memory,workers-9")) == 2
    assert "unknown ['workers-9']" in capsys.readouterr().err
    assert bench.main(_args("--hidden", "1024,3072")) == 2
    assert "--hidden takes one width here, got 2" in capsys.readouterr().err
    assert bench.parse_latencies(bench.DEFAULT_LATENCY_MS) == [0.0, 15.0]


def test_each_mode_is_the_job_setting_it_names(tmp_path):
    jobs = {m: bench.job(m, str(tmp_path))["train"] for m in bench.MODES}
    assert jobs["in-memory"]["dataset"] == "elastic.workload:build_dataset"
    assert jobs["batched"]["dataset"] == "benchmarks.data:build_batched_dataset"
    assert {jobs[m]["dataset"] for m in bench.MODES if m not in ("in-memory", "batched")} == {
        "benchmarks.data:build_dataset"}
    assert jobs["thread"]["prefetch"] is True and "data_workers" not in jobs["thread"]
    assert jobs["workers-4"]["data_workers"] == 4 and "prefetch" not in jobs["inline"]
    from elastic.config import JobConfig
    for m in bench.MODES:  # every mode is a valid job
        JobConfig.model_validate(bench.job(m, str(tmp_path)))
