"""`ray job submit` against a real Ray head started with its dashboard, as a user of a Ray cluster
would run it: from a checkout, to a head whose Python environment has every dependency but not
`elastic` itself (Ray ships the package with the job: `py_modules`), with Ray's token auth as a
user gets it by default, and the run kept in the folder the job names, never in Ray's unpacked copy
of the working directory."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.ray_fixtures import free_port
from tests.support.processes import stop_group

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

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


def dashboard_status(url: str, token: str | None = None) -> int | None:
    """The HTTP status of a GET (0 while nothing answers)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        return urllib.request.urlopen(request, timeout=2).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head with its dashboard, in its own process group so teardown stops exactly it
    (`ray stop` would stop every Ray on the machine), running from an environment without
    `elastic` (`bare_python`), with token auth as Ray 2.60 sets it up for a user by default:
    a `ray.init()` that starts a local cluster (a local `elastic train`) writes ~/.ray/auth_token,
    and every later `ray start` with that file and no RAY_AUTH_MODE turns token auth on (measured:
    the dashboard then answers 401 without the token, 200 to every request before the file
    exists). The home folder is the test's own, so the machine's token is neither read nor made."""
    bare = bare_python(str(tmp_path / "bare"))
    gcs, dash, agent, agent_grpc, env_agent, metrics = (free_port() for _ in range(6))
    home = tmp_path / "home"
    home.mkdir()
    unset = ("RAY_ADDRESS", "PYTHONPATH", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(PATH=bare + os.pathsep + os.environ["PATH"], HOME=str(home))
    # The token a local ray.init() writes (the same call: generate_and_save_token).
    subprocess.run([os.path.join(BIN, "ray"), "get-auth-token", "--generate"], env=env, check=True,
                   capture_output=True, timeout=60)
    token = (home / ".ray" / "auth_token").read_text().strip()
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
    deadline = time.monotonic() + 120
    while (dashboard_status(url + "/api/version", token) != 200 and proc.poll() is None
           and time.monotonic() < deadline):
        time.sleep(1)
    if dashboard_status(url + "/api/version", token) != 200:
        log.flush()
        stop_group(proc)  # never leave a half-started head behind for the next test
        pytest.fail("ray head did not come up:\n" + (tmp_path / "head.log").read_text()[-3000:])
    try:
        yield url, env, token
    finally:
        stop_group(proc)  # `ray start --block` was seen to outlast 30 s of SIGTERM: SIGKILL after 5


def submit(url: str, env: dict, workdir, job_file: str, auth: bool = True):
    """`ray job submit` as docs/deploying.md gives it: with RAY_AUTH_MODE=token where the head has
    token auth on (the token from ~/.ray/auth_token)."""
    runtime_env = json.dumps({"py_modules": [os.path.join(CHECKOUT, "elastic")]})
    env = {**env, "PATH": BIN + os.pathsep + env["PATH"]}
    if auth:
        env["RAY_AUTH_MODE"] = "token"
    return subprocess.run(
        [os.path.join(BIN, "ray"), "job", "submit", "--address", url, "--working-dir", str(workdir),
         "--runtime-env-json", runtime_env, "--",
         "python", "-m", "elastic", "train", "--no-progress", job_file],
        capture_output=True, text=True, env=env, timeout=360)


def test_ray_job_submit_from_a_checkout_keeps_the_run_where_the_job_names_it(ray_head, tmp_path):
    url, env, token = ray_head
    assert dashboard_status(url + "/api/jobs/") == 401  # token auth is on
    assert dashboard_status(url + "/api/jobs/", token) == 200
    workdir = tmp_path / "job"
    workdir.mkdir()
    (workdir / "job.yaml").write_text(JOB.replace("STORAGE", str(tmp_path / "runs")))
    (workdir / "relative.yaml").write_text(JOB.replace("file://STORAGE", "file://./runs"))

    # Without RAY_AUTH_MODE=token the client sends no token, and the head refuses the job.
    out = submit(url, env, workdir, "job.yaml", auth=False)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "AuthenticationError" in text, text[-3000:]

    # A relative file:// would land in Ray's unpacked copy of the working directory: refused.
    out = submit(url, env, workdir, "relative.yaml")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-4000:]
    assert "inside the copy of the working directory that Ray unpacked" in text, text[-4000:]
    assert "s3://bucket/prefix" in text and "Traceback" not in text
    unpacked_runs = re.search(r"resolves to (/\S+), inside", text).group(1)
    assert "/runtime_resources/" in unpacked_runs and not os.path.exists(unpacked_runs)
    assert not (workdir / "runs").exists() and not (tmp_path / "runs").exists()

    # An absolute folder: the run is there when the job ends.
    out = submit(url, env, workdir, "job.yaml")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "succeeded" in text
    assert "steps: 12" in text and "all ranks hold identical final state: True" in text
    run = tmp_path / "runs" / "submitted"
    assert (run / "checkpoints" / "step_000000012" / "COMMITTED").exists()
    assert (run / "config.yaml").exists() and not (workdir / "runs").exists()
