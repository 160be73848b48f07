"""Every mistake a user can make at the `elastic` command ends the same way: exit 2 and one line on
stderr that says what to fix, no traceback (`--debug` adds it). One table of inputs, each run as a
user runs it: a separate process, its real exit code and output. No Ray: each is refused before."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[1]
# sys.modules[name] = None makes `import name` raise ImportError: an environment without that extra.
RUN = ("import sys\n"
       "for name in sys.argv[1].split(','):\n"
       "    if name: sys.modules[name] = None\n"
       "from elastic.cli import main\n"
       "sys.exit(main(sys.argv[2:]))\n")


def _closed_port() -> int:
    """A loopback port nothing listens on: storage there refuses every connection."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(tmp: Path) -> dict[str, str]:
    """The files the table's inputs name: a good job, a run with a log, folders that are no run."""
    job = {"run": {"name": "cli", "num_steps": 4},
           "scaling": {"num_workers": 2},
           "checkpoint": {"storage_uri": f"file://{tmp}/runs", "every_steps": 2},
           "train": {"model": "elastic.workload:build_model",
                     "dataset": "elastic.workload:build_dataset",
                     "loss": "elastic.workload:loss_fn", "global_batch_size": 12}}
    (tmp / "job.yaml").write_text(yaml.safe_dump(job))
    run = tmp / "run"
    run.mkdir()
    events = [{"t": 1000.0, "kind": "run_started"},
              {"t": 1001.0, "kind": "state", "old": "Starting", "new": "Running"},
              {"t": 1002.0, "kind": "run_finished"}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp / "not-a-log").mkdir()
    (tmp / "not-a-log" / "events.jsonl").write_text('{"loss": 1.5}\n[1, 2]\n')
    (tmp / "log-is-a-folder" / "events.jsonl").mkdir(parents=True)
    port = _closed_port()
    unreachable = {"endpoint_url": f"http://127.0.0.1:{port}",
                   "config_kwargs": {"retries": {"max_attempts": 1}}}
    return {"JOB": str(tmp / "job.yaml"), "RUN": str(run), "TMP": str(tmp), "PORT": str(port),
            "UNREACHABLE": json.dumps(unreachable)}


FOO = "--set checkpoint.storage_uri=foo://x"
# (id, modules made unimportable, the arguments, what the one line must say)
CASES = [
    ("unknown scheme, config show", "", f"config show JOB {FOO}",
     "checkpoint.storage_uri: unknown storage scheme 'foo://': use file:///"),
    ("unknown scheme, train --dry-run", "", f"train JOB --dry-run {FOO}",
     "checkpoint.storage_uri: unknown storage scheme 'foo://'"),
    ("unknown scheme, train", "", f"train JOB {FOO}",
     "checkpoint.storage_uri: unknown storage scheme 'foo://'"),
    ("a scheme whose package is missing", "",
     "config show JOB --set checkpoint.storage_uri=gcs://b/x",
     "checkpoint.storage_uri: storage scheme 'gcs://' needs the gcsfs package, which is not "
     "installed: pip install gcsfs"),
    ("missing extra: plot", "matplotlib", "timeline RUN --out TMP/t.png",
     "pip install 'elastic-trainer[plot]'"),
    ("unreachable storage, train --dry-run", "",
     "train JOB --dry-run --set checkpoint.storage_uri=s3://bucket/runs "
     "--set checkpoint.storage_options=UNREACHABLE",
     "checkpoint.storage_uri: storage s3://bucket/runs is not writable"),
    ("unreachable storage, status", "",
     "status s3://bucket/runs/cli --storage-option endpoint_url=http://127.0.0.1:PORT",
     "cannot read the event log of s3://bucket/runs/cli"),
    ("run folder that does not exist, status", "", "status TMP/no-such-run",
     "no events in TMP/no-such-run: give a run folder"),
    ("run folder that does not exist, timeline", "", "timeline TMP/no-such-run --trace TMP/t.json",
     "no events in TMP/no-such-run: give a run folder"),
    ("a log that cannot be read, status", "", "status TMP/log-is-a-folder",
     "cannot read the event log of TMP/log-is-a-folder"),
    ("a log that is no event log, status", "", "status TMP/not-a-log",
     "TMP/not-a-log is not an elastic event log"),
    ("a log that is no event log, timeline", "", "timeline TMP/not-a-log --out TMP/t.png",
     "TMP/not-a-log is not an elastic event log"),
    ("bad --storage-option, no value", "", "status RUN --storage-option endpoint_url",
     "--storage-option 'endpoint_url': expected KEY=VALUE (e.g. --storage-option "
     "endpoint_url=http://127.0.0.1:8333)"),
    ("bad --set, no value", "", "train JOB --set scaling.num_workers",
     "--set 'scaling.num_workers': expected KEY=VALUE"),
    ("bad --set, a value of the wrong type", "", "config show JOB --set scaling.num_workers=many",
     "scaling.num_workers: Input should be a valid integer"),
    ("bad --set, a key the job does not know", "", "train JOB --dry-run --set scaling.gpus=1",
     "scaling.gpus: Extra inputs are not permitted"),
    ("missing extra: safetensors, export", "safetensors", "export RUN --to TMP/m.safetensors",
     "pip install 'elastic-trainer[safetensors]'"),
    ("missing extra: safetensors, init_from", "safetensors",
     "train JOB --dry-run --set train.init_from=TMP/m.safetensors",
     "pip install 'elastic-trainer[safetensors]'"),
    ("export to a file of no known format", "", "export RUN --to TMP/m.txt",
     "--to TMP/m.txt: name a .safetensors or a .pt (.pth, .bin) file"),
    ("export of a folder without a checkpoint", "", "export TMP/run --to TMP/m.pt",
     "TMP/run holds no committed checkpoint"),
    ("unknown subcommand", "", "trian JOB", "invalid choice: 'trian' (choose from 'train', "),
    ("unknown config subcommand", "", "config shwo JOB", "invalid choice: 'shwo'"),
    ("a subcommand without its argument", "", "status",
     "the following arguments are required: run"),
]


def _run(blocked: str, args: str, env: dict, values: dict[str, str], cwd: Path):
    argv = []
    for arg in args.split():
        for name in ("UNREACHABLE", "JOB", "RUN", "TMP", "PORT"):
            arg = arg.replace(name, values[name])
        argv.append(arg)
    return subprocess.run([sys.executable, "-c", RUN, blocked, *argv], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=150)


@pytest.fixture
def user_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    env.update(AWS_ACCESS_KEY_ID="not-a-key", AWS_SECRET_ACCESS_KEY="not-a-secret",
               PYTHONPATH=str(ROOT))
    return env


@pytest.mark.parametrize("blocked, args, says", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_user_error_exits_2_with_one_line_that_says_what_to_fix(tmp_path, user_env, blocked, args,
                                                                  says):
    values = _setup(tmp_path)
    out = _run(blocked, args, user_env, values, tmp_path)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    want = says.replace("TMP", values["TMP"])
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("elastic"), out.stderr[-3000:]
    assert want in lines[0], (want, lines[0])
    assert not (tmp_path / "t.png").exists() and not (tmp_path / "runs").exists()


def test_debug_adds_the_traceback_to_the_same_line(tmp_path, user_env):
    values = _setup(tmp_path)
    for args in (f"--debug config show JOB {FOO}", f"config show JOB --debug {FOO}"):
        out = _run("", args, user_env, values, tmp_path)
        err = out.stderr
        assert out.returncode == 2 and "Traceback (most recent call last)" in err, err[-3000:]
        assert err.strip().splitlines()[-1].startswith("elastic: invalid job config: checkpoint.")
