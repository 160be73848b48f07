"""`ray job submit` against a real Ray head started with its dashboard, as a user of a Ray cluster
would run it: from a checkout, to a head whose Python environment has every dependency but not
`elastic` itself (Ray ships the package with the job: `py_modules`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.ray_fixtures import free_port
from tests.support.processes import answers, stop_group

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(420)]

BIN = os.path.dirname(sys.executable)
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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




def bare_python(where) -> str:
    """A virtual environment with this one's packages but without `elastic`: its site-packages
    names ours in a .pth line, and the .pth files there (elastic's editable install is one) are not
    read from a directory added that way. Returns its bin folder, which holds `python` and `ray`."""
    import site
    import venv
    venv.create(where, with_pip=False)
    lib = os.path.join(where, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages")
    ours = [p for p in site.getsitepackages() if p.startswith(sys.prefix)]
    with open(os.path.join(lib, "deps.pth"), "w") as f:
        f.write("\n".join(ours) + "\n")
    bin_dir = os.path.join(where, "bin")
    with open(os.path.join(bin_dir, "ray"), "w") as f:
        f.write(f"#!{bin_dir}/python\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n")
    os.chmod(os.path.join(bin_dir, "ray"), 0o755)
    found = subprocess.run([os.path.join(bin_dir, "python"), "-c", "import ray, torch, pydantic; import elastic"],
                           capture_output=True, text=True, cwd=where, timeout=120)
    assert "No module named 'elastic'" in found.stderr, found.stderr[-2000:]  # the rest imports
    return bin_dir


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head with its dashboard, in its own process group so teardown stops exactly it
    (`ray stop` would stop every Ray on the machine), running from an environment without
    `elastic` (`bare_python`)."""
    bare = bare_python(str(tmp_path / "bare"))
    gcs, dash, agent, agent_grpc, env_agent, metrics = (free_port() for _ in range(6))
    # No token auth, as on a plain cluster. Ray 2.60 turns it on for any `ray start` once a token file
    # exists (~/.ray/auth_token, which any local `ray.init()` on the machine creates), and the
    # dashboard then refuses this test's unauthenticated requests.
    env = {**os.environ, "PATH": bare + os.pathsep + os.environ["PATH"], "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONPATH", None)
    log = open(tmp_path / "head.log", "w")
    proc = subprocess.Popen(
        [os.path.join(bare, "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         # Free ports for the agents too: their defaults are fixed, and another Ray on the machine
         # (a user's, or a head leaked by a crashed run) would leave this head without a job agent.
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--runtime-env-agent-port={env_agent}", f"--metrics-export-port={metrics}",
         "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=tmp_path)
    url = f"http://127.0.0.1:{dash}"
    if not answers(url + "/api/version", proc, timeout_s=120, every_s=1):
        log.flush()
        stop_group(proc)  # never leave a half-started head behind for the next test
        pytest.fail("ray head did not come up:\n" + (tmp_path / "head.log").read_text()[-3000:])
    try:
        yield url, env
    finally:
        stop_group(proc)  # `ray start --block` was seen to outlast 30 s of SIGTERM: SIGKILL after 5


def test_ray_job_submit_from_a_checkout_to_a_head_without_elastic(ray_head, tmp_path):
    url, env = ray_head
    workdir = tmp_path / "job"
    workdir.mkdir()
    (workdir / "job.yaml").write_text(JOB.replace("STORAGE", str(tmp_path / "runs")))
    runtime_env = json.dumps({"py_modules": [os.path.join(CHECKOUT, "elastic")]})
    out = subprocess.run(
        [os.path.join(BIN, "ray"), "job", "submit", "--address", url, "--working-dir", str(workdir),
         "--runtime-env-json", runtime_env, "--", "python", "-m", "elastic", "train", "--no-progress", "job.yaml"],
        capture_output=True, text=True, env={**env, "PATH": BIN + os.pathsep + env["PATH"]}, timeout=360)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "succeeded" in text
    assert "steps: 12" in text and "all ranks hold identical final state: True" in text
    assert (tmp_path / "runs" / "submitted" / "checkpoints" / "step_000000012" / "COMMITTED").exists()
    assert (tmp_path / "runs" / "submitted" / "config.yaml").exists()
