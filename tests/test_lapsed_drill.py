"""A driver frozen past its lease, together with its controller actor, on a real local cluster: a
second driver takes the run over and trains it to the end; then the first is thawed. Nothing of
the first lands in the run folder after that (every file with its contents' digest, before and
after the thaw), the first ends naming the driver that owns the run, and the second ends
bit-identical to an uninterrupted run (issue 52, "done means").

Before the fence only rose, the thawed controller counted its own freeze as a hang, formed
generation 2 and wrote it over the second driver's fence (seen in 2 of 4 runs from outside)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from elastic import Trainer
from elastic.checkpoint.fencing import read_fence
from elastic.storage import Storage, join
from tests.ray_fixtures import cluster, ray_cluster  # noqa: F401 - pytest fixtures
from tests.spawn_ranks import uninterrupted_digests

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

LEASE_TTL_S = 6.0


def _job(tmp_path, name: str, num_steps: int) -> dict:
    return {
        "run": {"name": name, "num_steps": num_steps, "seed": 7, "lease_ttl_s": LEASE_TTL_S},
        # Half a CPU each: the second driver's workers find room beside the first's, which train on.
        "scaling": {"num_workers": 2, "cpus_per_worker": 0.5},
        "failure": {"max_failures": 2, "hang_floor_s": 5},
        "checkpoint": {"storage_uri": f"file://{tmp_path}/runs", "every_steps": 10},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "global_batch_size": 16},
    }


def listing(folder: str) -> dict[str, str]:
    out = {}
    for base, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(base, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = hashlib.sha256(fh.read()).hexdigest()[:16]
    return out


def _actor_pids(cls: str) -> list[int]:
    """The pids of the actors of class `cls` running now (Ray titles an actor's process after it)."""
    import psutil
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and p.info["cmdline"][0].startswith(f"ray::{cls}")]


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# What freezes: the first driver and its controller (a head that stops; its workers train on,
# fenced off once the second driver's fence lands: the run is long enough that they are still
# training when it does), or its whole job, workers too (they come back mid-run, as zombies).
CASES = {"driver_and_controller": ("Controller", 600), "whole_job": ("Controller", "WorkerActor", 120)}


@pytest.mark.parametrize("frozen_part", list(CASES))
def test_a_driver_thawed_after_a_takeover_writes_nothing_and_the_new_holder_ends_exact(  # noqa: F811
        cluster, tmp_path, frozen_part):  # noqa: F811
    *classes, num_steps = CASES[frozen_part]
    name = f"lapse-{uuid.uuid4().hex[:6]}"
    j = _job(tmp_path, name, num_steps)
    run_dir = str(tmp_path / "runs" / name)
    script = textwrap.dedent(f"""
        import json, ray
        from elastic import Trainer, TrainingFailed
        ray.init(address={cluster.address!r}, log_to_driver=False)
        try:
            Trainer(json.loads({json.dumps(json.dumps(j))})).fit(progress=False)
            print("RESULT finished")
        except TrainingFailed as e:
            print("RESULT failed:", e)
    """)
    first = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, cwd=os.getcwd())
    frozen: list[int] = []
    try:
        ckpts = os.path.join(run_dir, "checkpoints")
        _wait(lambda: os.path.isdir(ckpts) and any(os.path.exists(os.path.join(ckpts, d, "COMMITTED"))
                                                    for d in os.listdir(ckpts) if d.startswith("step_")),
              120, "the first driver's first committed checkpoint")
        (controller,) = _actor_pids("Controller")
        frozen = [first.pid, controller] + [pid for cls in classes[1:] for pid in _actor_pids(cls)]
        assert len(frozen) == 2 + 2 * (len(classes) - 1), frozen
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        # The second driver comes while the lease is past half its ttl: it waits the rest out.
        time.sleep(LEASE_TTL_S * 0.6)
        result = Trainer(j).fit(progress=False)
        assert time.monotonic() - frozen_at > LEASE_TTL_S
        assert result.events_of("run_started")[0]["lease"] == 2
        before = listing(run_dir)
        fence_before = read_fence(Storage(f"file://{ckpts}"), f"file://{ckpts}")
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        frozen = []
        out, _ = first.communicate(timeout=120)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        if first.poll() is None:
            first.kill()
    after = listing(run_dir)
    restored = result.events_of("restored")
    print(f"[lapse] the second driver restored at step {restored[0]['step'] if restored else 0} "
          f"({restored[0]['source'] if restored else 'nothing'}); the first said: {out.strip()[-300:]}")
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"the thawed driver wrote {changed}"
    assert "RESULT failed" in out and "no longer owns the run" in out, out[-3000:]
    assert fence_before == read_fence(Storage(f"file://{ckpts}"), f"file://{ckpts}")
    assert fence_before == result.events_of("group_formed")[-1]["generation"] > 1_000_000
    assert result.metrics["step"] == num_steps
    assert restored and restored[0]["step"] < num_steps  # the second driver trained, not only restored
    assert result.digests == uninterrupted_digests(_job(tmp_path / "baseline", name, num_steps))
    # The log of the run tells both stories, in lease order, and none of the first driver's
    # events comes after the takeover.
    from elastic.observability.events import read_events
    events = read_events(Storage(f"file://{tmp_path}/runs"), run_dir)
    took = next(e["t"] for e in events if e["kind"] == "run_started" and e.get("lease") == 2)
    assert not [e for e in events if e["kind"] == "lease_lapsed" and e["t"] > took]
