"""The driver and a controller that stops answering (its process frozen, starved, cut off): the
driver used to ask for progress forever. It fails after failure.driver_progress_misses missed
answers in a row, naming the newest committed checkpoint. On a one-node Ray of the module's own,
with a stand-in controller."""
from __future__ import annotations

import re
import threading

import pytest
import ray

import elastic.trainer
from elastic.checkpoint.layout import checkpoints_root
from elastic.storage import Storage
from elastic.trainer import Trainer, TrainingFailed
from tests.ray_fixtures import one_node_ray
from tests.test_checkpoint import fake_checkpoint

pytestmark = pytest.mark.timeout(240)

ANSWERS = 3  # progress answers the stand-in gives before it stops answering
ANSWER_S = 2.0  # PROGRESS_ANSWER_S here: a miss in 2 s, not 10 (an answer comes in far less)


@pytest.fixture(scope="module")
def local_ray():
    with one_node_ray(__name__):
        yield


class ControllerThatFreezes:
    """Answers the first ANSWERS progress requests (step 7, one event each), then never again;
    its run never ends: a controller whose process stopped, as the driver sees it."""

    def __init__(self, job_json: str, runtime_env: dict):
        self.asked = 0

    def run(self) -> dict:
        threading.Event().wait()
        return {}

    def progress(self, since_event: int = 0, steps_after: int | None = None) -> dict:
        self.asked += 1
        if self.asked > ANSWERS:
            threading.Event().wait()
        return {"state": "Running", "step": 7, "num_steps": 100, "loss": 0.5, "world_size": 1,
                "failures": 0, "events": [{"kind": "state", "t": 0.0, "n": self.asked}]}


def _job(tmp_path, misses: int) -> dict:
    return {"run": {"name": "silent", "num_steps": 100},
            "scaling": {"num_workers": 1},
            "failure": {"driver_progress_misses": misses},
            "checkpoint": {"storage_uri": f"file://{tmp_path}/runs"},
            "train": {"model": "elastic.workload:build_model",
                      "dataset": "elastic.workload:build_dataset",
                      "loss": "elastic.workload:loss_fn", "global_batch_size": 16}}


def test_a_controller_that_stops_answering_fails_the_run_after_the_misses_naming_the_checkpoint(
        local_ray, tmp_path, monkeypatch):
    monkeypatch.setattr(elastic.trainer, "Controller", ControllerThatFreezes)
    monkeypatch.setattr(elastic.trainer, "PROGRESS_ANSWER_S", ANSWER_S)
    trainer = Trainer(_job(tmp_path, misses=3))
    storage = Storage(f"file://{tmp_path}/runs")
    committed = fake_checkpoint(storage, checkpoints_root(storage.uri, "silent"), 20)
    out: dict = {}

    def fit() -> None:
        try:
            trainer.fit(progress=False)
        except BaseException as e:  # noqa: BLE001 - checked below
            out["error"] = e

    t = threading.Thread(target=fit, daemon=True)
    t.start()
    t.join(120)  # a backstop far past 3 misses
    assert not t.is_alive(), "the driver still waits for a controller that never answers"
    e = out["error"]
    assert isinstance(e, TrainingFailed), repr(e)
    message, result = str(e), e.result
    assert message.startswith(
        "the controller actor answered none of the driver's last 3 progress requests"), message
    assert "failure.driver_progress_misses=3" in message and " at step 7;" in message, message
    named = re.search(r"the last committed checkpoint is (\S+) \(step (\d+)\)", message)
    assert named and named.groups() == (committed, "20"), message
    assert result.checkpoint == committed and result.error == message
    assert result.metrics["step"] == 7
    seen = [ev["n"] for ev in result.events]  # what it did say is kept
    assert seen and set(seen) <= set(range(1, ANSWERS + 1)), seen


def test_a_controller_that_answers_late_but_within_the_misses_is_waited_for(
        local_ray, tmp_path, monkeypatch):
    """Misses count in a row: a controller that answers again before the limit (a long pause of
    its process, a loaded head) is followed to its end, whatever it missed in all."""

    class PausesTwice(ControllerThatFreezes):
        def run(self) -> dict:
            import time
            while self.asked < 8:
                time.sleep(0.05)
            return {"status": "finished", "loss": 0.1, "step": 100, "checkpoint": None,
                    "run_dir": "r", "events": [], "digests": {}, "error": None, "losses": {}}

        def progress(self, since_event: int = 0, steps_after: int | None = None) -> dict:
            self.asked += 1
            if self.asked in (2, 3, 5, 6):  # two misses, an answer, two: never three in a row
                threading.Event().wait()
            return {"state": "Running", "step": 7, "events": []}

    monkeypatch.setattr(elastic.trainer, "Controller", PausesTwice)
    monkeypatch.setattr(elastic.trainer, "PROGRESS_ANSWER_S", ANSWER_S)
    result = Trainer(_job(tmp_path, misses=3)).fit(progress=False)
    assert result.metrics["step"] == 100
