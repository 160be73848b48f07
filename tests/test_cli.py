"""The `elastic` command as a user types it: overrides on top of a job file, a dry run, the settings
printed three ways, the version, `python -m elastic`, and what the read-only commands import.
No Ray: a dry run starts nothing, and the checks here never get as far as a run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic.cli import main
from elastic.config.overrides import apply_overrides
from elastic.config import ConfigError

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]


def _job(tmp_path: Path, **sections) -> Path:
    job = {
        "run": {"name": "cli", "num_steps": 20},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_uri": f"file://{tmp_path}/runs", "every_steps": 10},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "global_batch_size": 12},
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_overrides_set_values_read_as_yaml_and_the_file_stays_as_it_was(tmp_path, capsys):
    path = _job(tmp_path)
    before = path.read_text()
    assert main(["config", "show", str(path), "--set", "scaling.num_workers=3", "--set", "train.precision=bf16",
                 "--set", "failure.hang_floor_s=7.5", "--set", "run.sample_ledger=true",
                 "--set", "scaling.num_workers=4"]) == 0  # applied in order: the last wins
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["scaling"]["num_workers"] == 4 and shown["train"]["precision"] == "bf16"
    assert shown["failure"]["hang_floor_s"] == 7.5 and shown["run"]["sample_ledger"] is True
    assert shown["failure"]["ping_timeout_s"] == 1.0  # a default filled in
    assert path.read_text() == before


def test_an_override_can_create_a_section_and_index_a_list():
    raw = {"run": {"name": "x"}, "chaos": [{"rank": 0, "at_step": 5}]}
    out, given = apply_overrides(raw, ["train.fsdp.replicate=2", "chaos.0.at_step=30",
                                       "checkpoint.storage_options={endpoint_url: 'http://h:1'}"])
    assert out["train"] == {"fsdp": {"replicate": 2}} and out["chaos"][0] == {"rank": 0, "at_step": 30}
    assert out["checkpoint"]["storage_options"] == {"endpoint_url": "http://h:1"}
    assert raw["chaos"][0]["at_step"] == 5  # the input is not changed
    assert given["chaos.0.at_step"] == "--set chaos.0.at_step=30"


@pytest.mark.parametrize("override, says", [
    ("scaling.num_workers", "expected KEY=VALUE"),
    ("=3", "expected KEY=VALUE"),
    ("scaling..num_workers=3", "has an empty part"),
    ("run.name.first=3", "run.name is 'x', not a section"),
    ("chaos.3.rank=1", "chaos is a list of 1; '3' is not an index into it (0..0)"),
    ("run.num_steps=[1, 2", "the value is not valid YAML"),
])
def test_an_override_that_cannot_apply_names_itself(override, says):
    raw = {"run": {"name": "x"}, "chaos": [{"rank": 0}]}
    with pytest.raises(ConfigError) as e:
        apply_overrides(raw, [override])
    assert f"--set {override!r}" in str(e.value) and says in str(e.value), str(e.value)


def test_a_bad_override_fails_validation_naming_the_field_and_the_override_before_anything_starts(tmp_path, capsys):
    path = _job(tmp_path)
    assert main(["train", str(path), "--set", "scaling.num_wrkers=3", "--set", "train.precision=fp8"]) == 2
    err = capsys.readouterr().err
    assert "scaling.num_wrkers: Extra inputs are not permitted (got 3) (from --set scaling.num_wrkers=3)" in err, err
    assert "train.precision: " in err and "(got 'fp8') (from --set train.precision=fp8)" in err, err
    # a check across fields (the section's own) names the override that broke it
    assert main(["train", str(path), "--set", "scaling.min_workers=5"]) == 2
    err = capsys.readouterr().err
    assert "scaling: need min_workers <= num_workers <= max_workers" in err and "scaling: scaling:" not in err
    assert "(from --set scaling.min_workers=5)" in err
    assert not (tmp_path / "runs").exists()


def test_an_override_that_sets_a_credential_is_named_without_its_value(tmp_path, capsys):
    path = _job(tmp_path)
    assert main(["config", "show", str(path), "--set", "checkpoint.storage_options.secret=hunter22",
                 "--set", "checkpoint.every_steps=0"]) == 2
    err = capsys.readouterr().err
    assert "hunter22" not in err and "checkpoint.every_steps" in err
    assert main(["config", "show", str(path), "--set", "checkpoint.storage_options.secret=hunter22"]) == 0
    out = capsys.readouterr().out
    assert "hunter22" not in out and yaml.safe_load(out)["checkpoint"]["storage_options"] == {"secret": "***"}


def test_a_dry_run_checks_the_job_as_a_run_would_prints_it_resolved_and_starts_nothing(tmp_path, capsys):
    ray = pytest.importorskip("ray")
    path = _job(tmp_path, checkpoint={"storage_uri": "file://./runs-dry"})
    assert main(["train", str(path), "--set", "run.num_steps=50", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    job = yaml.safe_load(out)
    assert job["run"]["num_steps"] == 50 and job["checkpoint"]["storage_uri"].startswith("file:///")
    assert "nothing started" in err and not ray.is_initialized()
    # what a run would refuse, a dry run refuses: here, a model function that does not exist
    assert main(["train", str(path), "--set", "train.model=elastic.workload:no_such", "--dry-run"]) == 2
    assert "train.model" in capsys.readouterr().err


def test_defaults_and_schema_describe_every_setting(capsys):
    assert main(["config", "defaults"]) == 0
    defaults = yaml.safe_load(capsys.readouterr().out)
    assert defaults["train"]["model"] == "<required>" and defaults["failure"]["ping_timeout_s"] == 1.0
    assert defaults["train"]["fsdp"]["replicate"] == 1 and defaults["chaos"] == []
    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert set(defaults) == set(schema["properties"]) and "train" in schema["required"]


def test_version_and_python_dash_m_elastic():
    from elastic import __version__
    out = subprocess.run([sys.executable, "-m", "elastic", "--version"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"elastic {__version__}"
    from importlib.metadata import version
    assert version("elastic-trainer") == __version__  # the installed distribution says the same


def test_reading_settings_and_logs_imports_neither_torch_nor_ray():
    code = ("import sys; from elastic.cli import main; "
            "import elastic.observability.status, elastic.observability.timeline, elastic.config.reference; "
            "import elastic.config.overrides, elastic.config.loading; "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_every_start_writes_its_resolved_job_redacted_and_keeps_a_changed_one_before_it():
    import uuid
    from elastic.config import JobConfig
    from elastic.controller.controller import Controller
    from elastic.storage import Storage, join
    from tests.support.fake_group import FakeClock, FakeGroup
    uri = f"memory://cfg-{uuid.uuid4().hex[:8]}"

    def run(num_steps: int) -> None:
        clock = FakeClock()
        job = JobConfig.model_validate({
            "run": {"name": "cfg", "num_steps": num_steps},
            "scaling": {"num_workers": 2},
            "checkpoint": {"storage_uri": uri, "storage_options": {"secret": "hunter22"}},
            "train": {"model": "m:f", "dataset": "m:f", "loss": "m:f", "global_batch_size": 4},
        })
        c = Controller(job.model_dump_json(), group=FakeGroup(clock), clock=clock, wall=clock)
        assert c.run()["status"] == "finished"

    storage = Storage(uri)
    run(10)
    run(10)  # the same job again: one file, its start number moved on
    first = storage.read_bytes(join(uri, "cfg", "config.yaml")).decode()
    assert first.startswith("# elastic ") and "the job of start 2 of run 'cfg'" in first.splitlines()[0]
    assert storage.list_dir(join(uri, "cfg")).count("config.yaml") == 1
    assert not [f for f in storage.list_dir(join(uri, "cfg")) if f.startswith("config.") and f != "config.yaml"]
    job = yaml.safe_load(first)
    assert job["run"]["num_steps"] == 10 and job["checkpoint"]["storage_options"] == {"secret": "***"}
    assert "hunter22" not in first
    run(20)  # resumed with a longer schedule: the job it ran before is kept
    assert yaml.safe_load(storage.read_bytes(join(uri, "cfg", "config.yaml")))["run"]["num_steps"] == 20
    assert storage.read_bytes(join(uri, "cfg", "config.2.yaml")).decode() == first
