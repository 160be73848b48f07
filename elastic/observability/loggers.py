"""The run's curves in the tools people already read: TensorBoard event files and an MLflow run
(optional extras), written by one process, the controller, every step exactly once.

When a step is written. A step's loss can still change after the ranks report it: a restore
from storage (or a rollback) trains the steps after the checkpoint it loads again, and a
resubmitted run does the same from the newest committed checkpoint. MLflow cannot take a value
back (a second value at a step is a second point), and TensorBoard only by a purge that readers
apply in their own way. So a step is handed to the loggers only once it can no longer be redone:
once a committed checkpoint covers it (a restore loads a committed checkpoint, and a rollback goes
back to the newest one that holds the last good step, so it never goes behind a commit), or, at
the end, once the final checkpoint committed (a failed run: its newest committed checkpoint,
which a resubmission resumes from). The value written is the attempt that counted, the one in
metrics.json. The cost: the curves move once per `checkpoint.every_steps`, not every step.

Exactly once across submissions. Each logger reads where its curve ends before it writes (the
event files already in the run's TensorBoard folder; the MLflow run's history), and writes only
later steps: a resubmitted run continues the same curves, and a step a restore from an older
checkpoint redoes (the newest did not load) is not written twice.

Nothing here blocks the controller's loop: the loggers are opened (their packages imported, their
curves read) and written on a thread of their own; the loop hands over steps and reads back what
to say (`loggers_opened`, `logger_failed`). A logger that fails is said once and left off for the
rest of the run; training goes on. Only a controller whose lease is fresh hands steps over, as
only it writes the run's other files (elastic/checkpoint/lease.py).
"""
from __future__ import annotations

import heapq
import importlib.util
import logging
import os
import queue
import threading
from typing import Callable, NamedTuple

from elastic.config.loggers import LoggersConfig
from elastic.observability.timeline import MissingExtra

log = logging.getLogger(__name__)

LOSS, WORLD_SIZE = "train/loss", "train/world_size"  # the tags (TensorBoard) and keys (MLflow)
EVAL_PREFIX = "eval/"  # eval/<name>: an evaluation's metrics, at the step it evaluated
USER_PREFIX = "train/"  # train/<name>: the loss function's own metrics (train/accuracy)
RUN_NAME_TAG = "elastic.run_name"  # the MLflow run's tag a resubmitted run finds it by
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}  # extra -> the module it installs


class Row(NamedTuple):
    step: int
    wall_t: float  # when the step ended (epoch seconds)
    scalars: dict[str, float]


def missing_extra(extra: str, what: str) -> MissingExtra:
    return MissingExtra(f"{what} needs the {EXTRAS[extra]} package: pip install "
                        f"'elastic-trainer[{extra}]'")


# ---------------------------------------------------------------- the two loggers
class TensorBoardLogger:
    """Event files in `folder` (the run's own: <tensorboard_dir>/<run.name>), one per
    submission, written with the tensorboard package's own writer."""

    name = "tensorboard"

    def __init__(self, folder: str):
        self.where = folder
        self._writer = None

    def open(self) -> int:
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as e:
            raise missing_extra("tensorboard", "loggers.tensorboard_dir") from e
        last = last_tensorboard_step(self.where)
        self._writer = EventFileWriter(self.where, flush_secs=3600)  # flushed after each hand-over
        return last

    def write(self, rows: list[Row]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        for r in rows:  # a step's scalars in one event: a step is in the file whole or not at all
            values = [Summary.Value(tag=tag, simple_value=v) for tag, v in r.scalars.items()]
            event = Event(wall_time=r.wall_t, step=r.step, summary=Summary(value=values))
            self._writer.add_event(event)
        self._writer.flush()  # a head lost right after a hand-over loses none of it

    def close(self, ok: bool) -> None:
        if self._writer is not None:
            self._writer.close()


def last_tensorboard_step(folder: str) -> int:
    """The last step of this run's curve in `folder`'s event files (0: none), read with
    tensorboard's own loader; a file cut short by a lost head reads up to its last whole event."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    if not os.path.isdir(folder):
        return 0
    last = 0
    for name in sorted(os.listdir(folder)):
        if "tfevents" not in name:
            continue
        for ev in EventFileLoader(os.path.join(folder, name)).Load():
            if any(v.tag == LOSS for v in ev.summary.value):
                last = max(last, ev.step)
    return last


class MlflowLogger:
    """One MLflow run per elastic run: named and tagged with run.name, found again by the tag
    when the job is resubmitted, and continued."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, run_name: str):
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.where = f"{tracking_uri} (experiment {experiment})"
        self._client = self._run_id = None

    def open(self) -> int:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise missing_extra("mlflow", "loggers.mlflow_tracking_uri") from e
        if is_local(self.tracking_uri):
            # MLflow 3 keeps its file store in maintenance mode behind this switch; the job asked
            # for a local store by naming a folder, so it is switched on in this process only.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = self._client = MlflowClient(tracking_uri=self.tracking_uri)
        exp = client.get_experiment_by_name(self.experiment)
        if exp is not None and exp.lifecycle_stage == "deleted":
            raise ValueError(f"the MLflow experiment {self.experiment!r} is deleted: restore it, "
                             f"or set loggers.mlflow_experiment to another name")
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
        mine = f"tags.`{RUN_NAME_TAG}` = '{self.run_name}'"  # run.name allows no quote
        found = client.search_runs([exp_id], filter_string=mine, max_results=1,
                                   order_by=["attributes.start_time DESC"])
        if found:
            self._run_id = found[0].info.run_id
            client.update_run(self._run_id, status="RUNNING")
            last = max((m.step for m in client.get_metric_history(self._run_id, LOSS)), default=0)
        else:
            run = client.create_run(exp_id, run_name=self.run_name,
                                    tags={RUN_NAME_TAG: self.run_name})
            self._run_id, last = run.info.run_id, 0
        self.where = f"{self.tracking_uri} (experiment {self.experiment}, run {self._run_id})"
        return last

    def write(self, rows: list[Row]) -> None:
        from mlflow.entities import Metric
        metrics = [Metric(tag, float(v), int(r.wall_t * 1000), r.step)
                   for r in rows for tag, v in r.scalars.items()]
        for i in range(0, len(metrics), 1000):  # a server takes at most 1000 metrics per batch
            self._client.log_batch(self._run_id, metrics=metrics[i:i + 1000])

    def close(self, ok: bool) -> None:
        if self._run_id is not None:
            self._client.set_terminated(self._run_id, "FINISHED" if ok else "FAILED")


def is_local(uri: str) -> bool:
    """An MLflow tracking URI that names a folder (a path or file:), not a server or a database."""
    scheme = uri.split(":", 1)[0] if ":" in uri else ""
    return scheme in ("", "file") and not uri.startswith("databricks")


def loggers_for(cfg: LoggersConfig, run_name: str) -> list:
    out: list = []
    if cfg.tensorboard_dir is not None:  # a folder per run: TensorBoard shows each by its name
        folder = os.path.join(cfg.tensorboard_dir.removeprefix("file://"), run_name)
        out.append(TensorBoardLogger(folder))
    if cfg.mlflow_tracking_uri is not None:
        experiment = cfg.mlflow_experiment or "elastic"
        out.append(MlflowLogger(cfg.mlflow_tracking_uri, experiment, run_name))
    return out


# ---------------------------------------------------------------- the controller's side
class RunLoggers:
    """The controller's loggers (owner: the controller; reports.py advances them as commits are
    reported, the controller closes them at the end of the run)."""

    def __init__(self, cfg: LoggersConfig, run_name: str, may_write: Callable[[], tuple[bool, str]],
                 emit: Callable[..., object], loggers: list | None = None):
        """`may_write()`: whether this controller may write the run's files now (its lease is
        fresh); `emit(kind, **fields)`: the event log's."""
        self.loggers = loggers_for(cfg, run_name) if loggers is None else loggers
        self.enabled = bool(self.loggers)
        self._may_write, self._emit = may_write, emit
        self.handed_through = 0  # the last step handed to the writer
        self._queue: queue.Queue = queue.Queue()
        self._notes: list[tuple[str, dict]] = []  # (event kind, fields), for the loop to emit
        self._notes_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def advance(self, committed_through: int, run_log, wall: Callable[[], float]) -> None:
        """Hand the steps up to `committed_through` (the newest committed checkpoint's) to the
        writer, from the run log's curve; say what the writer reported meanwhile."""
        if not self.enabled:
            return
        self._say()
        if not self._may_write()[0]:
            return  # a stale lease keeps them here until a renewal lands
        self._start()  # opened as soon as this controller holds the run: a failure is said early
        if committed_through <= self.handed_through:
            return
        self._queue.put(rows_between(run_log, self.handed_through, committed_through, wall))
        self.handed_through = committed_through

    def close(self, through: int, run_log, wall: Callable[[], float], ok: bool,
              holds: Callable[[], tuple[bool, str]], timeout_s: float = 30.0) -> None:
        """The run ended: the steps up to `through` (all of them after a final checkpoint
        committed; else the newest committed checkpoint's) are written, once `holds()` says this
        controller still holds the run, and each logger is closed (an MLflow run ends FINISHED,
        or FAILED). Waits at most `timeout_s` for the writer."""
        if not self.enabled:
            return
        held, why = holds()
        if not held:
            log.warning("loggers not written at the end: this controller no longer holds the "
                        "run (%s)", why)
            return
        self._start()
        if through > self.handed_through:
            self._queue.put(rows_between(run_log, self.handed_through, through, wall))
            self.handed_through = through
        self._queue.put(("close", ok))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._note("logger_failed", logger="all", where=None,
                       error=f"the loggers' writer did not finish within {timeout_s:g} s",
                       then="the steps not yet written are missing; a resubmitted run cannot "
                            "add them")
        self._say()

    # ---------------------------------------------------------------- the writer thread
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_loop, name="loggers", daemon=True)
            self._thread.start()

    def _write_loop(self) -> None:
        last = {}  # logger -> the last step in its curve
        for lg in self.loggers:
            try:
                last[lg] = lg.open()
            except Exception as e:  # noqa: BLE001 - a logger must never end the run
                self._failed(lg, e, "open")
        if last:
            self._note("loggers_opened", loggers={lg.name: {"where": lg.where, "continues_after": n}
                                                  for lg, n in last.items()})
        while True:
            item = self._queue.get()
            if isinstance(item, tuple):  # ("close", ok)
                for lg in list(last):
                    try:
                        lg.close(item[1])
                    except Exception as e:  # noqa: BLE001
                        self._failed(lg, e, "close")
                return
            for lg in list(last):
                rows = [r for r in item if r.step > last[lg]]  # its curve already holds the rest
                if not rows:
                    continue
                try:
                    lg.write(rows)
                    last[lg] = rows[-1].step
                except Exception as e:  # noqa: BLE001
                    self._failed(lg, e, "write")
                    del last[lg]

    def _failed(self, lg, e: BaseException, op: str) -> None:
        log.warning("logger %s failed to %s: %s: %s", lg.name, op, type(e).__name__, e)
        self._note("logger_failed", logger=lg.name, where=lg.where,
                   error=f"{type(e).__name__}: {e}"[:500],
                   then="it is left off for the rest of this run; training goes on, and a "
                        "resubmitted run continues its curve after its last step")

    def _note(self, kind: str, **fields) -> None:
        with self._notes_lock:
            self._notes.append((kind, fields))

    def _say(self) -> None:
        with self._notes_lock:
            notes, self._notes = self._notes, []
        for kind, fields in notes:
            self._emit(kind, **fields)


def rows_between(run_log, after: int, through: int, wall: Callable[[], float]) -> list[Row]:
    """The steps in (after, through] of the run log's curve (the attempt that counted), each
    ended at its step record's time where one is kept. A step no rank's report reached (its
    reporters lost with their node) is not in the curve, and not written."""
    if not after and run_log.loss_curve:  # a resumed run's curve starts at its restored step
        after = min(run_log.loss_curve) - 1
    ends: dict[int, float] = {}
    for rank in heapq.nsmallest(4, run_log.step_times):  # a few ranks' records; not 100,000 ranks'
        for row in run_log.step_times[rank]:  # (step, t_end, step_s, compute_s), oldest first
            if after < row[0] <= through:
                ends[row[0]] = row[1]  # a redone step: its last attempt's
    out = []
    for step in range(after + 1, through + 1):
        got = run_log.loss_curve.get(step)
        if got is not None:
            loss, world = got
            scalars = {LOSS: loss, WORLD_SIZE: world}
            user = run_log.user_metrics.get(step, {})  # the loss function's own metrics
            scalars.update({USER_PREFIX + k: v for k, v in user.items()})
            ev = run_log.evaluations.get(step)  # train.eval_dataset: held back until it arrived
            scalars.update({EVAL_PREFIX + k: v for k, v in (ev.metrics if ev else {}).items()})
            out.append(Row(step, ends.get(step) or wall(), scalars))
    return out


# ---------------------------------------------------------------- the driver's side
def prepare(job):
    """Before any work, on the driver: the extras the job's loggers need are installed (else
    MissingExtra naming `elastic-trainer[...]`), and their folders are absolute (the controller
    runs elsewhere), never inside the copy Ray unpacks for a submitted job."""
    from elastic.config.loading import ConfigError
    from elastic.ray_job import SUBMITTED_JOB_ENV, session_folder
    cfg = job.loggers
    update = {}
    for field, extra, value in (("tensorboard_dir", "tensorboard", cfg.tensorboard_dir),
                                ("mlflow_tracking_uri", "mlflow", cfg.mlflow_tracking_uri)):
        if value is None:
            continue
        if importlib.util.find_spec(EXTRAS[extra]) is None:
            raise missing_extra(extra, f"loggers.{field}")
        if field == "mlflow_tracking_uri" and not is_local(value):
            continue
        path = value.removeprefix("file://").removeprefix("file:")
        path = os.path.abspath(os.path.expanduser(path))
        if SUBMITTED_JOB_ENV in os.environ and session_folder(path):
            raise ConfigError(f"loggers.{field}: {value!r} resolves to {path}, inside the copy of "
                              f"the working directory that Ray unpacked for this job, which goes "
                              f"with Ray's session: give an absolute folder that outlives the job "
                              f"(or, for MLflow, a tracking server)")
        update[field] = path if field == "tensorboard_dir" else "file://" + path
    if not update:
        return job
    return job.model_copy(update={"loggers": cfg.model_copy(update=update)})
