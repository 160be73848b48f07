"""Objects as well as strings (elastic/config/objects.py): the Trainer takes the model factory,
dataset, loss, optimizer and scheduler as Python objects, ships them to the workers pickled by
cloudpickle (by value what cannot be imported there), records their names in config.yaml, and
still refuses a bad one with a line naming the field. The notebook-style example runs end to end
on a local Ray (run this file under `flock /tmp/elastic-ray.lock`)."""
from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch
import yaml
from torch import nn

from elastic.config import ConfigError, JobConfig, parse_job
from elastic.config.loading import dump_job
from elastic.group.runtime_env import job_packages

ROOT = pathlib.Path(__file__).resolve().parents[1]


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)), i % 2


def _model() -> nn.Module:
    return nn.Linear(4, 2)


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _job(**train) -> dict:
    t = {"model": _model, "dataset": Points(), "loss": _loss, "global_batch_size": 4,
         "optimizer": functools.partial(torch.optim.SGD, lr=0.1), **train}
    return {"run": {"name": "objects"}, "train": t}


def test_objects_travel_in_the_jobs_json_by_value_and_the_records_name_them():
    job = parse_job(_job())
    shipped = job.model_dump_json()
    # A worker's copy: what it validates from the JSON holds pickles, unpickled only when resolved.
    there = JobConfig.model_validate_json(shipped)
    assert not there.train.model.local and there == job
    fns = there.train.resolve()
    assert isinstance(fns["model"](), nn.Linear)
    assert len(fns["dataset"]()) == 8  # the dataset given as itself comes back from a function
    assert fns["optimizer"].func is torch.optim.SGD and fns["optimizer"].keywords == {"lr": 0.1}
    # This module's objects are importable: pickled by reference, so their package is on the list
    # of what the workers must import; a script's (__main__) get the driver's paths.
    assert "tests" in job_packages(shipped)
    recorded = yaml.safe_load(dump_job(job))["train"]
    assert recorded["model"] == f"<object {__name__}._model>"
    assert recorded["dataset"] == f"<object {__name__}.Points instance>"
    assert recorded["optimizer"] == "<object partial(torch.optim.sgd.SGD)>"
    assert "cloudpickle" not in dump_job(job)


def test_strings_stay_strings():
    job = parse_job(_job(model="elastic.workload:build_model", loss="elastic.workload:loss_fn",
                         dataset="elastic.workload:build_dataset", optimizer=None))
    assert json.loads(job.model_dump_json())["train"]["model"] == "elastic.workload:build_model"
    assert yaml.safe_load(dump_job(job))["train"]["loss"] == "elastic.workload:loss_fn"
    with pytest.raises(ValueError, match=r"train.model: expected 'module:function'"):
        job.train.model_copy(update={"model": "nocolon"}).resolve()


@pytest.mark.parametrize("train, message", [
    ({"model": nn.Linear(4, 2)},
     r"train.model: got a model .*Linear instance.*pass the function or class"),
    ({"model": 3}, r"train.model: expected 'module:function' or a Python object .*got int 3"),
    ({"optimizer": torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)},
     r"train.optimizer: expected a function\(params\) -> optimizer, got "
     r"<object torch.optim.sgd.SGD instance>"),
    ({"dataset": object()},
     r"train.dataset: expected a map-style dataset .*got <object builtins.object instance>"),
    ({"loss": (lambda lock: (lambda m, b: lock))(threading.Lock())},
     r"train.loss: <object .*lambda>> cannot be sent to the workers: cloudpickle raised TypeError"),
    ({"loss": None}, r"train.loss is required"),
])
def test_a_bad_object_is_refused_naming_its_field(train, message):
    with pytest.raises(ConfigError, match=message):
        parse_job(_job(**train))


@pytest.mark.timeout(600)
def test_the_notebook_style_example_runs_on_a_local_ray(tmp_path):
    """examples/notebook_style.py: everything defined in __main__, given as objects; the workers
    (other processes, which cannot import __main__) train it to the end."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "examples" / "notebook_style.py")
    out = subprocess.run([sys.executable, script, f"file://{tmp_path}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at step 30" in out.stdout, out.stdout
    run = tmp_path / "notebook-style"
    recorded = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert recorded["model"] == "<object __main__.build_model>"
    assert recorded["dataset"] == "<object __main__.Blobs instance>"
    assert recorded["scheduler"].startswith("<object __main__.main.<locals>.<lambda>")
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events][-1] == "run_finished"
    losses = {int(k): v["loss"] for k, v in json.loads((run / "metrics.json").read_text()).items()}
    assert sorted(losses) == list(range(1, 31)) and losses[30] < losses[1] / 10, losses  # learned
