"""`ray job submit --working-dir . -- elastic train job.yaml` against a real Ray head
started with its dashboard, as a user of a Ray cluster would run it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.ray_fixtures import free_port

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(420)]

BIN = os.path.dirname(sys.executable)

JOB = """
run: {name: submitted, num_steps: 12, seed: 1}
scaling: {num_workers: 2}
checkpoint: {storage_uri: "file://STORAGE", every_steps: 5}
train:
  model: elastic.workload:build_model
  dataset: elastic.workload:build_dataset
  loss: elastic.workload:loss_fn
  global_batch_size: 16
"""




@pytest.fixture
def ray_head(tmp_path):
    """A Ray head with its dashboard, in its own process group so teardown stops exactly it
    (`ray stop` would stop every Ray on the machine)."""
    gcs, dash, agent, agent_grpc, env_agent, metrics = (free_port() for _ in range(6))
    # No token auth, as on a plain cluster. Ray 2.60 turns it on for any `ray start` once a token file
    # exists (~/.ray/auth_token, which any local `ray.init()` on the machine creates), and the
    # dashboard then refuses this test's unauthenticated requests.
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "head.log", "w")
    proc = subprocess.Popen(
        [os.path.join(BIN, "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         # Free ports for the agents too: their defaults are fixed, and another Ray on the machine
         # (a user's, or a head leaked by a crashed run) would leave this head without a job agent.
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--runtime-env-agent-port={env_agent}", f"--metrics-export-port={metrics}",
         "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/api/version", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                log.flush()
                _stop(proc)  # never leave a half-started head behind for the next test
                pytest.fail("ray head did not come up:\n" + (tmp_path / "head.log").read_text()[-3000:])
            time.sleep(1)
    try:
        yield url, env
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_ray_job_submit_runs_a_yaml_job(ray_head, tmp_path):
    url, env = ray_head
    workdir = tmp_path / "job"
    workdir.mkdir()
    (workdir / "job.yaml").write_text(JOB.replace("STORAGE", str(tmp_path / "runs")))
    out = subprocess.run(
        [os.path.join(BIN, "ray"), "job", "submit", "--address", url, "--working-dir", str(workdir), "--",
         "elastic", "train", "--no-progress", "job.yaml"],
        capture_output=True, text=True, env=env, timeout=360)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "succeeded" in text
    assert "steps: 12" in text and "all ranks hold identical final state: True" in text
    assert (tmp_path / "runs" / "submitted" / "checkpoints" / "step_000000012" / "COMMITTED").exists()
