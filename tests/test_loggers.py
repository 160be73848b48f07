"""The loggers (TensorBoard event files, an MLflow run), written by the controller: every step
exactly once, with the attempt that counted, through a restore from storage, a rollback and a
resubmitted run that resumes from an older checkpoint. The controller is stepped against the
fake group (tests/test_controller.py); the curves are read back with tensorboard's own reader
and MLflow's client. The driver's checks (a missing extra, folders) are here too."""
from __future__ import annotations

import dataclasses
import time
import uuid

import pytest
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from elastic.checkpoint.layout import COMMIT_MARKER, Manifest, commit, step_dir
from elastic.config import ConfigError, JobConfig
from elastic.observability import loggers as loggers_module
from elastic.observability.loggers import LOSS, WORLD_SIZE, RunLoggers, prepare
from elastic.observability.timeline import MissingExtra
from elastic.protocol import PersistResult, RunResult, RunStatus
from elastic.storage import join
from tests.test_controller import _release_leases, drive, kinds, make  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(120)

EVERY = 10  # the fake ranks' checkpoint interval


def attempt_loss(step: int, attempt: int) -> float:
    """Each attempt at a step (the group's `attempt`-th run) reports a loss of its own, so a test
    can tell which one was written."""
    return step + attempt / 1000


def runs(g) -> int:
    return sum(name == "run" for name, _ in g.calls)


def checkpointed(c, g, every: int = EVERY) -> None:
    """The fake ranks report each step's loss as `attempt_loss(step, runs so far)`, and checkpoint
    every `every` steps: committed in the run's storage (a restore from storage finds it) and
    reported by rank 0 at its next answer, as a real rank's persist is."""
    answer = g._answer

    def checkpointing_answer(m):
        before = m.logged
        a = answer(m)
        attempt = runs(g)
        log = tuple(dataclasses.replace(r, loss=attempt_loss(r.step, attempt))
                    for r in a.compute_log)
        persists = list(a.persists)
        for s in range(before + 1, m.step + 1) if m.rank == 0 else ():
            if s % every == 0:
                folder = step_dir(c.root, s)
                commit(c.storage, folder, Manifest(s, s * 48, 3, "ddp", {}, time.time()))
                persists.append(PersistResult(s, folder, committed=True, persist_s=0.1, attempts=1))
        return dataclasses.replace(a, compute_log=log, persists=tuple(persists))

    g._answer = checkpointing_answer


def tensorboard_curve(folder, tag: str = LOSS) -> list[tuple[int, float]]:
    """(step, value) of every point of `tag` in the folder's event files, duplicates included."""
    acc = EventAccumulator(str(folder), size_guidance={SCALARS: 0})  # keep every point
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def assert_curve(points: list[tuple[int, float]], expected: dict[int, float]) -> None:
    """Every expected step exactly once, in order, each with its value (TensorBoard keeps
    float32)."""
    assert [s for s, _ in points] == sorted(expected), [s for s, _ in points]
    assert all(v == pytest.approx(expected[s], rel=1e-6) for s, v in points)


def test_steps_redone_after_a_restore_from_storage_are_written_once_with_the_redone_value(tmp_path):
    c, g, _ = make(failure={"peer_restore": False}, loggers={"tensorboard_dir": str(tmp_path)},
                   report_compute=True)
    checkpointed(c, g)
    drive(c, lambda c: c.step >= 13)
    reached = max(m.step for m in g.members.values())
    assert EVERY < reached < 2 * EVERY
    g.kill_node(1)
    assert c.run()["status"] == "finished"
    restored = kinds(c, "restored")[-1]
    assert restored["step"] == EVERY and restored["source"] == "storage"
    curve = {s: loss for s, (loss, _) in c.run_log.loss_curve.items()}
    # The steps after the checkpoint were trained twice: the second attempt counted, and only it
    # is written.
    assert all(curve[s] == attempt_loss(s, runs(g)) for s in range(EVERY + 1, reached + 1))
    assert_curve(tensorboard_curve(tmp_path / "ctl"), curve)
    assert_curve(tensorboard_curve(tmp_path / "ctl", WORLD_SIZE), dict.fromkeys(curve, 3))
    (opened,) = kinds(c, "loggers_opened")
    assert opened["loggers"]["tensorboard"]["continues_after"] == 0
    assert not kinds(c, "logger_failed")


def test_a_rollback_writes_each_step_once_with_the_replayed_value(tmp_path):
    c, g, _ = make(loggers={"tensorboard_dir": str(tmp_path)}, report_compute=True)
    checkpointed(c, g)
    drive(c, lambda c: c.step >= 12)
    bad = max(m.step for m in g.members.values())
    assert EVERY + 1 < bad < 2 * EVERY
    first_attempt = runs(g)
    for m in g.members.values():  # two bad steps in a row: every rank asks for a rollback
        m.running = False
        m.run_out = RunResult(RunStatus.ROLLBACK, bad, m.generation, bad_steps=(bad - 1, bad))
    assert c.run()["status"] == "finished"
    (rolled,) = kinds(c, "rolled_back")
    assert rolled["to_step"] == EVERY
    curve = {s: loss for s, (loss, _) in c.run_log.loss_curve.items()}
    replayed = range(EVERY + 1, bad + 1)
    assert all(curve[s] != attempt_loss(s, first_attempt) for s in replayed)
    assert_curve(tensorboard_curve(tmp_path / "ctl"), curve)


def test_a_resize_shows_in_the_world_size_curve_each_step_once(tmp_path):
    c, g, _ = make(num_steps=200, scaling={"num_workers": 2, "max_workers": 3, "grow_check_s": 1},
                   loggers={"tensorboard_dir": str(tmp_path)}, report_compute=True)
    checkpointed(c, g)
    assert c.run()["status"] == "finished"
    (grown,) = kinds(c, "resize_completed")
    assert (grown["old_world_size"], grown["new_world_size"]) == (2, 3)
    curve = c.run_log.loss_curve
    assert_curve(tensorboard_curve(tmp_path / "ctl"), {s: loss for s, (loss, _) in curve.items()})
    worlds = tensorboard_curve(tmp_path / "ctl", WORLD_SIZE)
    assert_curve(worlds, {s: world for s, (_, world) in curve.items()})
    assert {w for _, w in worlds} == {2, 3}


def test_a_resubmitted_run_continues_the_same_curves_each_step_once(tmp_path, monkeypatch):
    """The first submission trains 20 steps; its newest checkpoint then stops counting (as if
    damaged after its commit), so the second submission resumes from step 10 and trains 11..20
    again before going on to 30. Both curves, TensorBoard's and MLflow's, hold 1..30 once:
    11..20 as the first submission wrote them."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file://{tmp_path}/mlruns"
    loggers = {"tensorboard_dir": str(tmp_path / "tb"), "mlflow_tracking_uri": uri}
    storage = f"memory://resubmit-{uuid.uuid4().hex[:8]}"
    first, g1, _ = make(num_steps=20, loggers=loggers, storage_uri=storage, report_compute=True)
    checkpointed(first, g1)
    assert first.run()["status"] == "finished"
    first.storage.remove(join(step_dir(first.root, 2 * EVERY), COMMIT_MARKER))

    second, g2, _ = make(num_steps=30, loggers=loggers, storage_uri=storage, report_compute=True)
    checkpointed(second, g2)
    assert second.run()["status"] == "finished"
    assert kinds(second, "restored")[0]["step"] == EVERY
    (opened,) = kinds(second, "loggers_opened")
    continues = {k: v["continues_after"] for k, v in opened["loggers"].items()}
    assert continues == {"tensorboard": 20, "mlflow": 20}
    expected = {s: loss for s, (loss, _) in first.run_log.loss_curve.items()}
    expected.update({s: x for s, (x, _) in second.run_log.loss_curve.items() if s > 2 * EVERY})
    assert sorted(expected) == list(range(1, 31))
    assert_curve(tensorboard_curve(tmp_path / "tb" / "ctl"), expected)

    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("elastic")
    (run,) = client.search_runs([exp.experiment_id])  # one MLflow run for both submissions
    assert run.info.run_name == "ctl" and run.info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, LOSS))
    assert_curve(history, expected)


class _Broken:
    name, where = "broken", "nowhere"

    def __init__(self):
        self.writes = 0

    def open(self) -> int:
        return 0

    def write(self, rows) -> None:
        self.writes += 1
        raise OSError("disk full")

    def close(self, ok: bool) -> None:
        pass


def test_a_logger_that_fails_is_said_once_and_left_off_while_training_goes_on():
    c, g, _ = make(report_compute=True)
    checkpointed(c, g)
    broken = _Broken()
    c.loggers = RunLoggers(c.job.loggers, "ctl", c.lease.fresh, c.events.emit, loggers=[broken])
    assert c.run()["status"] == "finished" and c.step == 40
    (failed,) = kinds(c, "logger_failed")
    assert failed["logger"] == "broken" and "disk full" in failed["error"]
    assert "left off" in failed["then"]
    assert broken.writes == 1  # not asked again after its first failure
    from elastic.observability.report import describe_event
    assert describe_event(failed).startswith("LOGGER broken (nowhere) failed: OSError: disk full;")


def _job(**loggers) -> JobConfig:
    return JobConfig.model_validate({"train": {"model": "m:f", "dataset": "m:f", "loss": "m:f",
                                               "global_batch_size": 48},
                                     "loggers": loggers})


@pytest.mark.parametrize("extra, field, value", [
    ("tensorboard", "tensorboard_dir", "tb"),
    ("mlflow", "mlflow_tracking_uri", "http://mlflow:5000")])
def test_a_missing_extra_is_one_error_naming_it_before_any_work(monkeypatch, extra, field, value):
    from elastic import Trainer
    real = loggers_module.importlib.util.find_spec
    monkeypatch.setattr(loggers_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == extra else real(name, *a))
    # The job's callables do not exist: the extra is checked before they are imported.
    with pytest.raises(MissingExtra) as e:
        Trainer({"train": {"model": "nowhere:f", "dataset": "nowhere:f", "loss": "nowhere:f",
                           "global_batch_size": 48},
                 "loggers": {field: value}})
    assert f"pip install 'elastic-trainer[{extra}]'" in str(e.value)
    assert f"loggers.{field}" in str(e.value)


def test_local_folders_are_made_absolute_on_the_driver_and_servers_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = prepare(_job(tensorboard_dir="tb", mlflow_tracking_uri="file:mlruns"))
    assert job.loggers.tensorboard_dir == str(tmp_path / "tb")
    assert job.loggers.mlflow_tracking_uri == f"file://{tmp_path}/mlruns"
    server = prepare(_job(mlflow_tracking_uri="databricks"))
    assert server.loggers.mlflow_tracking_uri == "databricks"
    assert prepare(_job()) == _job()


def test_a_submitted_job_s_relative_folder_is_refused(tmp_path, monkeypatch):
    copy = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    with pytest.raises(ConfigError, match="loggers.tensorboard_dir: 'tb' resolves to .*unpacked"):
        prepare(_job(tensorboard_dir="tb"))


@pytest.mark.parametrize("loggers, message", [
    ({"tensorboard_dir": "s3://bucket/tb"},
     "loggers.tensorboard_dir='s3://bucket/tb': TensorBoard files"),
    ({"tensorboard_dir": " "}, "loggers.tensorboard_dir is empty"),
    ({"mlflow_experiment": "x"},
     "loggers.mlflow_experiment is set but loggers.mlflow_tracking_uri is not"),
])
def test_settings_that_cannot_work_are_refused_naming_the_field(loggers, message):
    with pytest.raises(ValueError, match=message):
        _job(**loggers)
