"""What the driver refuses before any worker starts, and how it ends when the controller dies.

The job's training code is a module written into tmp_path (on sys.path), driven through
`elastic.cli.main` as a user would run it. Only the last test starts Ray.
"""
from __future__ import annotations

import json
import re
import sys
import textwrap
import uuid

import pytest
import yaml

from elastic.checkpoint.layout import COMMIT_MARKER, MANIFEST, checkpoints_root, step_dir, validate
from elastic.cli import main
from elastic.config import ConfigError
from elastic.storage import Storage, join
from elastic.trainer import Trainer, TrainingFailed

USER_CODE = '''
import torch

def model():
    return torch.nn.Linear(2, 1)

def loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).squeeze(-1), y)

def samples(n):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 2, generator=g), torch.randn(n, generator=g))

def data_100():
    return samples(100)

def data_120():
    return samples(120)

def data_100_other():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(100, 2, generator=g), torch.randn(100, generator=g))

class Augmented(torch.utils.data.Dataset):
    """Random augmentation on every read: the same dataset all the same."""
    def __len__(self):
        return 100

    def __getitem__(self, i):
        return torch.tensor([float(i), 0.0]) + torch.rand(2), torch.tensor(float(i))

def augmented():
    return Augmented()

class Versioned(torch.utils.data.TensorDataset):
    version = "v1"

    def fingerprint(self):
        return f"corpus-{self.version}"

def versioned_v1():
    return Versioned(*samples(100).tensors)

def versioned_v2():
    ds = Versioned(*samples(100).tensors)
    ds.version = "v2"
    return ds

class BadHook(torch.utils.data.TensorDataset):
    def fingerprint(self):
        return None

def bad_hook():
    return BadHook(*samples(100).tensors)

def missing_file():
    with open("/nonexistent/train.parquet", "rb") as f:
        return f.read()

class Unindexed(torch.utils.data.Dataset):
    def __len__(self):
        raise RuntimeError("index not built yet")

def unindexed():
    return Unindexed()
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"userjob_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_CODE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def job(tmp_path, mod, dataset="data_100", name="run-a", seed=7, global_batch_size=48, **over):
    j = {"run": {"name": name, "seed": seed, "num_steps": 40},
         "scaling": {"num_workers": 1},
         "checkpoint": {"storage_uri": f"file://{tmp_path}/runs", "every_steps": 5},
         "train": {"model": f"{mod}:model", "dataset": f"{mod}:{dataset}", "loss": f"{mod}:loss",
                   "global_batch_size": global_batch_size}}
    for k, v in over.items():
        j[k] = {**j.get(k, {}), **v}
    return j


def train(tmp_path, j, capsys) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(j))
    rc = main(["train", str(path), "--no-progress"])
    return rc, capsys.readouterr().err


# ---------------------------------------------------------------- a dataset that cannot be built

def test_a_dataset_function_that_raises_is_a_one_line_error(tmp_path, user_module, capsys):
    rc, err = train(tmp_path, job(tmp_path, user_module, dataset="missing_file"), capsys)
    assert rc == 2
    assert err == (f"elastic: train.dataset: {user_module}:missing_file() raised FileNotFoundError: [Errno 2] "
                   f"No such file or directory: '/nonexistent/train.parquet'\n")


def test_a_dataset_without_a_length_is_a_one_line_error(tmp_path, user_module, capsys):
    rc, err = train(tmp_path, job(tmp_path, user_module, dataset="unindexed"), capsys)
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"elastic: train.dataset: len() of the dataset from {user_module}:unindexed() raised "
                          f"RuntimeError: index not built yet")


# ---------------------------------------------------------------- a resume must keep the sample order

def committed_checkpoint(tmp_path, run_name, step, data_order):
    """A committed checkpoint of the run, as an earlier invocation left it."""
    uri = Storage(f"file://{tmp_path}/runs").uri
    storage = Storage(uri)
    folder = step_dir(checkpoints_root(uri, run_name), step)
    storage.write_bytes(join(folder, "__0_0.distcp"), b"x" * 100)
    manifest = {"step": step, "cursor": step * 48, "world_size": 1, "strategy": "ddp", "created_at": 0.0,
                "metrics": {}, "files": {"__0_0.distcp": 100}}
    if data_order:  # older versions wrote no data_order
        manifest["data_order"] = data_order
    storage.write_bytes(join(folder, MANIFEST), json.dumps(manifest).encode())
    storage.write_bytes(join(folder, COMMIT_MARKER), str(step).encode())
    return folder


RECORDED = {"global_batch_size": 48, "seed": 7, "num_samples": 100}


@pytest.mark.parametrize("change,message", [
    ({"global_batch_size": 64},
     "train.global_batch_size=64 but the run's checkpoint step_000000020 was written with 48: the sample "
     "order would change; use a new run.name or the same value"),
    ({"seed": 8},
     "run.seed=8 but the run's checkpoint step_000000020 was written with 7: the sample order would change; "
     "use a new run.name or the same value"),
    ({"dataset": "data_120"},
     "train.dataset {mod}:data_120 has 120 samples but the run's checkpoint step_000000020 was written with 100: "
     "the sample order would change; use a new run.name or the same dataset"),
])
def test_a_resume_that_would_change_the_sample_order_is_refused(tmp_path, user_module, capsys, change, message):
    committed_checkpoint(tmp_path, "run-a", 10, RECORDED)
    committed_checkpoint(tmp_path, "run-a", 20, RECORDED)
    message = message.format(mod=user_module)
    with pytest.raises(ConfigError) as e:
        Trainer(job(tmp_path, user_module, **change))
    assert str(e.value) == message
    rc, err = train(tmp_path, job(tmp_path, user_module, **change), capsys)
    assert rc == 2 and err == f"elastic: {message}\n"


def test_a_resume_with_the_same_order_or_a_new_run_name_is_accepted(tmp_path, user_module):
    committed_checkpoint(tmp_path, "run-a", 20, RECORDED)
    Trainer(job(tmp_path, user_module))  # same values: resumes
    Trainer(job(tmp_path, user_module, global_batch_size=64, name="run-b"))  # a new run


def test_checkpoints_from_before_the_order_was_recorded_do_not_block_a_resume(tmp_path, user_module):
    committed_checkpoint(tmp_path, "run-a", 20, {})
    Trainer(job(tmp_path, user_module, global_batch_size=64))


def recorded_with(user_module, dataset) -> dict:
    """RECORDED and the fingerprint of `dataset` as a worker records it."""
    import importlib

    from elastic.data.fingerprint import dataset_fingerprint
    return {**RECORDED, "dataset_fingerprint": dataset_fingerprint(getattr(importlib.import_module(user_module),
                                                                           dataset)())}


def test_a_resume_on_another_dataset_of_the_same_length_is_refused(tmp_path, user_module, capsys):
    """Batch size, seed and length alone let another dataset of 100 samples resume the run from
    its cursor: the fingerprint (a sample of items, hashed) tells them apart."""
    recorded = recorded_with(user_module, "data_100")
    committed_checkpoint(tmp_path, "run-a", 20, recorded)
    mine = recorded_with(user_module, "data_100_other")["dataset_fingerprint"]
    message = (f"train.dataset {user_module}:data_100_other has fingerprint {mine} but the run's checkpoint "
               f"step_000000020 was written with {recorded['dataset_fingerprint']}: another dataset of the same "
               f"length, or its items changed, and the data cursor would resume into other samples; use a new "
               f"run.name or the same dataset (one whose items differ on purpose in each build can define "
               f"fingerprint(); docs/data.md)")
    with pytest.raises(ConfigError) as e:
        Trainer(job(tmp_path, user_module, dataset="data_100_other"))
    assert str(e.value) == message
    rc, err = train(tmp_path, job(tmp_path, user_module, dataset="data_100_other"), capsys)
    assert rc == 2 and err == f"elastic: {message}\n"
    Trainer(job(tmp_path, user_module))  # the same dataset, built again: resumes


def test_random_augmentation_keeps_a_dataset_its_fingerprint(tmp_path, user_module):
    """Items are read for the fingerprint with the generators seeded for each: augmentation that
    draws from them does not make the same dataset look like another."""
    committed_checkpoint(tmp_path, "run-a", 20, recorded_with(user_module, "augmented"))
    Trainer(job(tmp_path, user_module, dataset="augmented"))


def test_a_datasets_own_fingerprint_is_what_the_resume_compares(tmp_path, user_module, capsys):
    recorded = recorded_with(user_module, "versioned_v1")
    assert recorded["dataset_fingerprint"] == "user:corpus-v1"
    committed_checkpoint(tmp_path, "run-a", 20, recorded)
    Trainer(job(tmp_path, user_module, dataset="versioned_v1"))
    with pytest.raises(ConfigError, match="versioned_v2 has fingerprint user:corpus-v2 but the run's checkpoint "
                                          "step_000000020 was written with user:corpus-v1"):
        Trainer(job(tmp_path, user_module, dataset="versioned_v2"))
    rc, err = train(tmp_path, job(tmp_path, user_module, dataset="bad_hook", name="run-b"), capsys)
    assert rc == 2 and err == (f"elastic: train.dataset: fingerprint() of the dataset from {user_module}:bad_hook() "
                               f"raised ValueError: fingerprint() returned None: it must return a non-empty string\n")


def test_checkpoints_from_before_the_fingerprint_was_recorded_resume_on_any_dataset_of_that_length(
        tmp_path, user_module):
    committed_checkpoint(tmp_path, "run-a", 20, RECORDED)
    Trainer(job(tmp_path, user_module, dataset="data_100_other"))


# ---------------------------------------------------------------- the controller dies (real Ray, one node)

class _ControllerThatDies:
    """Mixed into the real controller: its process is SIGKILLed once the run has committed a
    checkpoint, as if its node had died under it."""

    def run(self):
        import os
        import signal
        import threading
        import time

        from elastic.checkpoint.layout import latest_committed as newest

        def die_after_a_commit():
            while newest(self.storage, self.root) is None:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=die_after_a_commit, daemon=True).start()
        return super().run()


@pytest.mark.chaos
@pytest.mark.timeout(180)
def test_a_dead_controller_ends_the_run_with_training_failed_naming_the_last_checkpoint(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    import elastic.trainer
    from elastic.controller import Controller

    # The subclass lives in this test module, which Ray's workers cannot import: ship it by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    dying = type("ControllerThatDies", (_ControllerThatDies, Controller), {"__module__": __name__})
    monkeypatch.setattr(elastic.trainer, "Controller", dying)
    j = {"run": {"name": "dies", "num_steps": 100_000},
         "scaling": {"num_workers": 1},
         "checkpoint": {"storage_uri": f"file://{tmp_path}/runs", "every_steps": 3},
         "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                   "loss": "elastic.workload:loss_fn", "global_batch_size": 16}}
    # address="local": a Ray of this test's own, even where another (a user's `ray start`) runs.
    ray.init(address="local", num_cpus=2, log_to_driver=False, include_dashboard=False)
    try:
        with pytest.raises(TrainingFailed) as e:
            Trainer(j).fit(progress=False)
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    message, result = str(e.value), e.value.result
    assert message.startswith("the controller actor died (")
    named = re.search(r"the last committed checkpoint is (\S+) \(step (\d+)\)", message)
    assert named, message
    storage = Storage(f"file://{tmp_path}/runs")
    root = checkpoints_root(storage.uri, "dies")
    assert named.group(1).startswith(root + "/step_")
    manifest = validate(storage, named.group(1))  # named: a committed checkpoint
    assert manifest.step == int(named.group(2))
    # The workers recorded what the sample order depends on, and the dataset's fingerprint.
    from elastic.data.fingerprint import dataset_fingerprint
    from elastic.workload import build_dataset
    assert manifest.data_order == {"global_batch_size": 16, "seed": 0, "num_samples": 8192,
                                   "dataset_fingerprint": dataset_fingerprint(build_dataset())}
    assert result.checkpoint == named.group(1) and result.error == message
    assert result.run_dir == join(storage.uri, "dies")
    assert any(ev["kind"] == "run_started" for ev in result.events)


def test_a_job_needs_a_slot_per_rank_at_its_largest_and_per_spare():
    from elastic.config import parse_job
    from elastic.trainer import cpu_slots_needed
    base = {"train": {"model": "m:f", "dataset": "m:f", "loss": "m:f", "global_batch_size": 12}}
    assert cpu_slots_needed(parse_job({**base, "scaling": {"num_workers": 3}})) == 3
    assert cpu_slots_needed(parse_job({**base, "scaling": {"num_workers": 2, "max_workers": 4, "num_spares": 1,
                                                           "cpus_per_worker": 2}})) == 10


def test_progress_outside_a_terminal_is_plain_lines():
    """`ray job submit` and `kubectl logs` capture the driver's output: no carriage-return redraws."""
    import io

    from elastic.trainer import _Progress
    out = io.StringIO()  # not a terminal
    bar = _Progress(100, out=out, every_s=0.0)
    for step in (10, 20):
        bar.update({"step": step, "state": "Running", "world_size": 3, "loss": 1.5, "failures": 0,
                    "events": [{"t": 0.0, "kind": "silence_detected", "ranks": [1], "reason": "r"}] if step == 20
                    else []})
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert any("step 10/100 Running world=3 loss=1.5000" in x for x in lines)
    assert any("step 20/100" in x for x in lines) and any("SILENT ranks [1]" in x for x in lines)


def test_a_stale_ray_address_is_told_from_a_live_one(monkeypatch):
    """Ray records the last local cluster's address and a plain ray.init() joins it even when that
    cluster is gone (every ray.cluster_utils.Cluster leaves one): it retried for 14 minutes here
    before failing. The trainer starts a new local Ray instead when nothing answers there."""
    import socket

    import ray._private.utils as ray_utils

    from elastic.trainer import stale_ray_address
    live = socket.socket()
    live.bind(("127.0.0.1", 0))
    live.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        for address, want in ((f"127.0.0.1:{closed.getsockname()[1]}", "stale"),
                              (f"127.0.0.1:{live.getsockname()[1]}", None), (None, None)):
            monkeypatch.setattr(ray_utils, "read_ray_address", lambda temp_dir=None, a=address: a)
            assert stale_ray_address() == (address if want else None)
    finally:
        live.close()
        closed.close()
