"""The head-pod-loss story of k8s/README.md, on one machine: a whole Ray cluster (head with its
dashboard, and its worker nodes) is killed hard in the middle of a `ray job submit` run; a fresh
cluster is started and the same job is submitted again. The new run resumes from the latest
committed checkpoint in storage (file:// here, s3:// on Kubernetes) and ends bit-identical to an
uninterrupted run of the same job.

That is what a KubeRay RayJob with `backoffLimit >= 1` does when its head pod is lost: it deletes the
RayCluster, creates a new one and submits the same entrypoint, with the same `run.name`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from elastic.checkpoint.lease import Lease
from elastic.storage import Storage
from tests.ray_fixtures import free_port
from tests.spawn_ranks import uninterrupted_digests

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

BIN = os.path.dirname(sys.executable)
NUM_WORKER_NODES = 2  # one rank each; the head has no CPUs, as in k8s/base/rayjob.yaml
NUM_STEPS = 60  # killed after its second checkpoint (step 20): most of the run is left to resume
EVERY_STEPS = 10
LEASE_TTL_S = 5  # the first driver's lease: the retry waits until it has expired, as KubeRay's does

JOB = """
run: {name: NAME, num_steps: %d, seed: 3, lease_ttl_s: %d}
scaling: {num_workers: 2}
checkpoint: {storage_uri: "file://STORAGE", every_steps: %d, num_to_keep: 3}
train:
  model: elastic.workload:build_model
  dataset: elastic.workload:build_dataset
  loss: elastic.workload:loss_fn
  optimizer: elastic.workload:build_optimizer
  global_batch_size: 16
""" % (NUM_STEPS, LEASE_TTL_S, EVERY_STEPS)




class RayCluster:
    """A Ray cluster of `ray start --block` processes (a head with its dashboard, and worker nodes),
    each in its own process group, so this test stops or kills exactly its own nodes and no other
    Ray on the machine (`ray stop` would stop them all)."""

    def __init__(self, log_dir: Path, label: str):
        self.log_dir, self.label = log_dir, label
        self.procs: list[subprocess.Popen] = []
        # Token auth off: this test is about the resume; tests/test_job_submit.py submits with it on.
        self.env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "RAY_AUTH_MODE": "disabled"}
        self.env.pop("RAY_ADDRESS", None)
        self.gcs_port, dash = free_port(), free_port()
        self.url = f"http://127.0.0.1:{dash}"
        self._start("head", "--head", f"--port={self.gcs_port}", "--num-cpus=0", "--include-dashboard=true",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--disable-usage-stats")

    def _start(self, name: str, *args: str) -> None:
        # Free ports for each node's agents: their defaults are fixed, and several nodes share this host.
        ports = [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                 f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
                 "--object-store-memory=300000000"]  # a small job; leave /dev/shm to the rest of the machine
        log = open(self.log_dir / f"{self.label}-{name}.log", "w")
        self.procs.append(subprocess.Popen([os.path.join(BIN, "ray"), "start", "--block", *args, *ports],
                                           stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))

    def start(self, num_worker_nodes: int, timeout_s: float = 120) -> "RayCluster":
        deadline = time.monotonic() + timeout_s
        self._wait(lambda: self._get("/api/version") is not None, deadline, "the head's dashboard")
        for i in range(num_worker_nodes):
            # One at a time: nodes started together on one host race for the same free ports.
            self._start(f"worker{i}", f"--address=127.0.0.1:{self.gcs_port}", "--num-cpus=1",
                        f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}")
            self._wait(lambda: self.num_alive_nodes() == 2 + i, deadline, f"worker node {i}")
        return self

    def _get(self, path: str):
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def num_alive_nodes(self) -> int:
        reply = self._get("/api/v0/nodes?limit=100")
        try:
            nodes = reply["data"]["result"]["result"]
        except (TypeError, KeyError):
            return 0
        return sum(n.get("state") == "ALIVE" for n in nodes)

    def _wait(self, ready, deadline: float, what: str) -> None:
        while not ready():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.stop()  # never leave a half-started cluster behind for the next test
                logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                                 for p in sorted(self.log_dir.glob(f"{self.label}-*.log")))
                pytest.fail(f"Ray cluster {self.label}: {what} did not come up\n{logs}")
            time.sleep(0.5)

    def own_processes(self) -> list[psutil.Process]:
        """Every live process of this cluster: each `ray start` and everything under it (GCS, raylets,
        dashboard and agents, workers, the job's driver)."""
        out = []
        for p in self.procs:
            try:
                root = psutil.Process(p.pid)
                out += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return out

    def kill(self) -> None:
        """The whole cluster lost at once, the way a RayJob loses its head pod (and with it the GCS,
        the controller and the driver): SIGKILL, no shutdown of any kind."""
        victims = self.own_processes()
        for proc in victims:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # anything started between the listing and the kill
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
        psutil.wait_procs(victims, timeout=30)

    def stop(self) -> None:
        # Worker nodes first: a node asked to stop drains through the GCS, and waits for it if it is gone.
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill()  # whatever did not stop in time


def submit(cluster: RayCluster, workdir: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [os.path.join(BIN, "ray"), "job", "submit", "--address", cluster.url, "--working-dir", str(workdir), "--",
         "elastic", "train", "--no-progress", "job.yaml"],
        env=cluster.env, text=True, **popen)


def job_text(name: str, storage: Path) -> str:
    return JOB.replace("NAME", name).replace("STORAGE", str(storage))


def job_dir(tmp_path: Path, name: str, storage: Path) -> Path:
    d = tmp_path / f"job-{name}"
    d.mkdir()
    (d / "job.yaml").write_text(job_text(name, storage))
    return d


def committed_steps(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name.removeprefix("step_")) for p in folder.glob("step_*") if (p / "COMMITTED").exists())


def events(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # the last line of a log cut by SIGKILL may be half-written
            pass
    return out


def run_to_end(cluster: RayCluster, workdir: Path) -> str:
    proc = submit(cluster, workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    return out


def test_whole_cluster_killed_mid_run_then_resubmitted_resumes_bit_identical(tmp_path):
    storage = tmp_path / "runs"  # outlives both clusters, as an S3 bucket outlives a RayJob's clusters
    name = "resubmitted"
    workdir = job_dir(tmp_path, name, storage)
    run_dir = storage / name

    first = RayCluster(tmp_path, "first").start(NUM_WORKER_NODES)
    try:
        log = open(tmp_path / "first-submit.log", "w")
        proc = submit(first, workdir, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while len(committed_steps(run_dir)) < 2:  # mid-run, with more than one checkpoint to choose from
            assert proc.poll() is None, "the run ended before its second checkpoint:\n" + \
                (tmp_path / "first-submit.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no second committed checkpoint after 180 s"
            time.sleep(0.05)
        first.kill()
    finally:
        first.stop()
    try:
        proc.wait(timeout=60)  # `ray job submit` loses its cluster and gives up, as a RayJob's submitter does
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("`ray job submit` went on waiting for a cluster that is gone")
    assert proc.returncode != 0

    # What survived the cluster: the committed checkpoints, and an event log with no final state.
    survived = committed_steps(run_dir)
    latest = survived[-1]
    assert 0 < latest < NUM_STEPS, survived
    assert not [e for e in events(run_dir) if e["kind"] == "final_state"], "the first run was not cut short"

    # The first driver's controller died with its cluster without releasing the run's lease. A
    # retry is refused until the lease is lease_ttl_s old (a KubeRay retry comes after a new
    # cluster's pods are scheduled, usually later than that); then it takes the run over.
    lease = Lease(Storage(f"file://{storage}"), f"file://{run_dir}", LEASE_TTL_S)
    while lease.newest().age_s(time.time()) < LEASE_TTL_S:
        time.sleep(0.2)
    second = RayCluster(tmp_path, "second").start(NUM_WORKER_NODES)
    try:
        out = run_to_end(second, workdir)  # the same job, the same run.name: a RayJob retry
    finally:
        second.stop()

    ev = events(run_dir)
    assert sum(e["kind"] == "run_started" for e in ev) == 2, "the resubmitted run appends to the first run's log"
    # Its groups number on from the first run's (the fence it left), so a zombie of the first run
    # holds an older generation than every group of the second.
    gens = [e["generation"] for e in ev if e["kind"] == "group_formed"]
    starts = [i for i, e in enumerate(ev) if e["kind"] == "run_started"]
    first_gens = [e["generation"] for e in ev[:starts[1]] if e["kind"] == "group_formed"]
    (cont,) = [e for e in ev if e["kind"] == "generations_continued"]
    assert cont["after"] == max(first_gens) and gens == sorted(set(gens)), (cont, gens)
    restored = [e for e in ev if e["kind"] == "restored"]
    assert restored[-1]["step"] == latest and restored[-1]["source"] == "storage", restored[-1]
    assert restored[-1]["uri"].endswith(f"step_{latest:09d}"), restored[-1]
    final = [e for e in ev if e["kind"] == "final_state"]
    assert len(final) == 1 and final[0]["step"] == NUM_STEPS
    # The uninterrupted run's digests, from its ranks forked without Ray (tests/spawn_ranks.py).
    base_digests = set(uninterrupted_digests(yaml.safe_load(job_text("uninterrupted", storage))).values())
    assert len(base_digests) == 1, base_digests
    assert set(final[0]["digests"].values()) == base_digests, (final[0], base_digests)
    assert f"steps: {NUM_STEPS}" in out and "all ranks hold identical final state: True" in out
    print(f"\nresubmitted run: cluster killed with checkpoints at steps {survived}, resumed at step {latest}, "
          f"final digest {final[0]['digests']['0'][:16]}... = uninterrupted {next(iter(base_digests))[:16]}...")
