"""Driver side: validate the job, start the controller, stream progress, return a Result.

The Trainer holds no training state; everything it shows comes from the
controller's progress snapshots and events. Before any worker starts it refuses
a job it can tell is wrong: a bad callable, a dataset that cannot be built or
measured, unwritable storage, or a resume that would change the sample order or the data.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from elastic.checkpoint import pretrained
from elastic.checkpoint.layout import checkpoints_root, committed_checkpoints, latest_committed
from elastic.config import ConfigError, JobConfig, load_job, parse_job
from elastic.config.secrets import named_secrets
from elastic.parallel.strategies import STRATEGIES
from elastic.controller import Controller
from elastic.data.fingerprint import KEY as FINGERPRINT_KEY
from elastic.data.fingerprint import dataset_fingerprint, has_hook
from elastic.data.prefetch import check_data_workers
from elastic.group.room import check_copies_room
from elastic.group.runtime_env import worker_runtime_env
from elastic.observability.loggers import prepare as prepare_loggers
from elastic.ray_job import check_storage_location
from elastic.storage import Storage, StorageError, join

log = logging.getLogger(__name__)


class TrainingFailed(RuntimeError):
    """The run stopped: the message says what failed, where, and the last committed checkpoint."""

    def __init__(self, message: str, result: "Result"):
        super().__init__(message)
        self.result = result


@dataclass
class Result:
    metrics: dict[str, Any]
    checkpoint: str | None  # URI of the last committed checkpoint
    run_dir: str
    events: list[dict] = field(default_factory=list)
    digests: dict[int, str] = field(default_factory=dict)
    error: str | None = None
    losses: dict[int, float] = field(default_factory=dict)  # step -> global mean loss (also metrics.json)
    # step -> {name: value} of each evaluation (train.eval_dataset; also metrics.json)
    evaluations: dict[int, dict[str, float]] = field(default_factory=dict)
    # step -> {name: global mean} of what the loss function returned beside the loss (metrics.json)
    user_metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    def events_of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]

    def summary(self) -> str:
        from elastic.observability.report import summarize
        return summarize(self)


class Trainer:
    """`Trainer(job).fit()`: job is a JobConfig, a dict in the YAML's shape, or a YAML path."""

    def __init__(self, job: JobConfig | dict | str):
        if isinstance(job, str):
            job = load_job(job)
        elif isinstance(job, dict):
            job = parse_job(job)
        _warn_inline_credentials(job)
        check_storage_location(job.checkpoint.storage_uri)  # not in a submitted job's unpacked copy
        job = prepare_loggers(job)  # their extras installed, their folders absolute
        # Import the user's callables now: a bad 'module:function' fails here, before any worker starts.
        try:
            fns = job.train.resolve()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        num_samples, fingerprint = _measure_dataset(fns["dataset"], job.train)
        if num_samples < 1:
            raise ConfigError("train.dataset: the dataset is empty")
        try:  # the strategy's own plan (fsdp: its blocks; a pipeline: its cuts), on the meta device
            STRATEGIES[job.train.strategy].check_job(job, fns["model"])
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if fns["scheduler"] is not None:
            _check_scheduler(fns["scheduler"], job.train.scheduler)
        if job.train.init_from and pretrained.kind_of(job.train.init_from) == "safetensors":
            pretrained.safetensors_module()  # a missing extra, said before storage is touched
        self._builders = (fns["model"], fns["optimizer"])  # the copies' memory estimate, once Ray is up
        # A filesystem whose package is missing fails to open, an unreachable one to write; the URI
        # is made absolute, so every node agrees on file:// paths.
        try:
            uri = Storage(job.checkpoint.storage_uri).uri
            storage = Storage(uri, job.checkpoint.storage_options)
            storage.check_writable(uri)
        except StorageError as e:
            raise ConfigError(f"checkpoint.storage_uri: {e}") from None
        self.job = job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"storage_uri": uri})})
        _check_resume(storage, self.job, num_samples, fingerprint)
        try:  # train.init_from resolved and checked against the model (a fresh start only)
            self.job = pretrained.prepare(self.job, fns["model"], storage)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def fit(self, progress: bool = True, on_event: Callable[[dict], None] | None = None) -> Result:
        """Run the job to its end. `progress` draws a bar on the driver; `on_event`, if given, is
        called on the driver with every event (docs/events.md) as it arrives, about twice a
        second, in order (an exception it raises is logged and the run goes on)."""
        _connect_or_start_ray(self.job)
        check_copies_room(self.job, *self._builders)
        controller = ray.remote(Controller).options(
            num_cpus=0, max_concurrency=8,
            # The controller must outlive any worker node, so it runs on the head node (where
            # `ray job submit` runs drivers too). Soft node affinity to the driver's node is not
            # enough: with num_cpus=0 Ray was seen placing the actor on a worker node anyway.
            resources={"node:__internal_head__": 0.001},
        ).remote(self.job.model_dump_json(), worker_runtime_env(self.job.model_dump_json()))
        done = controller.run.remote()
        bar = _Progress(self.job.run.num_steps) if progress else None
        events: list[dict] = []  # what the driver has seen, in case the controller dies with the rest
        last: dict = {}
        misses = 0  # progress answers missed in a row
        while True:
            ready, _ = ray.wait([done], timeout=0.5)
            p, answered = _ask_progress(controller, len(events), done)
            misses = 0 if answered else misses + 1
            if misses >= self.job.failure.driver_progress_misses and not ready:
                if bar:
                    bar.close()
                ray.kill(controller)  # and the workers it owns: a frozen one must not train on
                raise self._controller_silent(misses, last, events)
            if p and bar:
                bar.update(p)
            if p:
                events.extend(p["events"])
                last = p
                for ev in p["events"] if on_event else ():
                    try:
                        on_event(ev)
                    except Exception:  # noqa: BLE001 - the caller's hook must not end the run
                        log.exception("on_event raised on %s", ev.get("kind"))
            if ready:
                break
        try:
            out = ray.get(done)
        except ray.exceptions.RayActorError as e:
            raise self._controller_died(e, last, events) from e
        finally:
            if bar:
                bar.close()
            ray.kill(controller)
        result = Result(
            metrics={"loss": out["loss"], "step": out["step"], "strategy": self.job.train.strategy},
            checkpoint=out["checkpoint"], run_dir=out["run_dir"], events=out["events"],
            digests={int(k): v for k, v in out["digests"].items()}, error=out["error"],
            losses={int(k): v for k, v in out["losses"].items()},
            user_metrics={int(k): v for k, v in out.get("user_metrics", {}).items()},
            evaluations={int(k): v for k, v in out.get("evaluations", {}).items()})
        if out["status"] != "finished":
            raise TrainingFailed(out["error"], result)
        return result

    def _controller_died(self, e: BaseException, last: dict, events: list[dict]) -> TrainingFailed:
        """The controller actor is gone (its process or node died), and with it the run's state and
        its workers (Ray ends the actors it owned). What is left to go on is in storage."""
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return self._failed_without_controller(
            f"the controller actor died ({type(e).__name__}: {cause})", last, events)

    def _controller_silent(self, misses: int, last: dict, events: list[dict]) -> TrainingFailed:
        """The controller answered none of the last `misses` progress requests (frozen, starved or
        cut off): the driver stopped it. What is left to go on is in storage."""
        allowed = self.job.failure.driver_progress_misses
        return self._failed_without_controller(
            f"the controller actor answered none of the driver's last {misses} progress requests "
            f"({PROGRESS_ANSWER_S:g} s each, failure.driver_progress_misses={allowed}) "
            "and was stopped", last, events)

    def _failed_without_controller(self, what: str, last: dict, events: list[dict]
                                   ) -> TrainingFailed:
        ck = self.job.checkpoint
        storage_uri = ck.storage_uri
        run_dir = join(storage_uri, self.job.run.name)
        try:
            latest = latest_committed(Storage(storage_uri, ck.storage_options),
                                      checkpoints_root(storage_uri, self.job.run.name))
            where = (f"the last committed checkpoint is {latest.uri} (step {latest.step}); run the job again "
                     f"with the same run.name and storage to resume from it" if latest
                     else "no checkpoint was committed; running the job again starts from step 0")
        except StorageError as se:
            latest, where = None, f"the last committed checkpoint is unknown ({se})"
        step = last.get("step")
        message = what + (f" at step {step}" if step is not None else "") + f"; {where}"
        result = Result(metrics={"loss": last.get("loss"), "step": step, "strategy": self.job.train.strategy},
                        checkpoint=latest.uri if latest else None, run_dir=run_dir, events=events, error=message)
        return TrainingFailed(message, result)


PROGRESS_ANSWER_S = 10.0  # how long the driver waits for one progress answer: longer is a miss


def _ask_progress(controller, since_event: int, done) -> tuple[dict | None, bool]:
    """(the controller's progress, whether it answered). An answer that is an error still says
    the controller lives (progress is best effort: the run's outcome is what counts). One that
    does not come within PROGRESS_ANSWER_S is a miss; so is an actor that cannot be reached,
    once the rest of PROGRESS_ANSWER_S has passed (while `done` may still end), so that a miss
    always stands for that long without an answer."""
    asked = time.monotonic()
    try:
        return ray.get(controller.progress.remote(since_event), timeout=PROGRESS_ANSWER_S), True
    except ray.exceptions.GetTimeoutError:
        return None, False
    except ray.exceptions.ActorUnavailableError:
        ray.wait([done], timeout=max(0.0, PROGRESS_ANSWER_S - (time.monotonic() - asked)))
        return None, False
    except Exception:  # noqa: BLE001 - answered, with an error: the controller is alive
        log.debug("progress answered with an error", exc_info=True)
        return None, True


def _measure_dataset(build, tr) -> tuple[int, str | None]:
    """Build the dataset once on the driver and measure it: its length and its fingerprint (None
    where its items cannot be read here), turning the user's exceptions into one line that names
    the field (the workers would hit the same error, later and once each). Data workers that do
    not fork receive it pickled: check that it pickles, too."""
    ref = tr.dataset_ref
    try:
        dataset = build()
    except Exception as e:  # noqa: BLE001 - the user's code: report it, do not crash through it
        raise ConfigError(f"train.dataset: {ref}() raised {type(e).__name__}: {e}") from None
    try:
        n = len(dataset)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"train.dataset: len() of the dataset from {ref}() raised {type(e).__name__}: {e}; "
                          f"it must be a map-style dataset (len, getitem)") from None
    try:
        check_data_workers(tr, dataset)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        fingerprint = dataset_fingerprint(dataset)
    except Exception as e:  # noqa: BLE001
        if has_hook(dataset):  # the user's own hook: theirs to fix
            raise ConfigError(f"train.dataset: fingerprint() of the dataset from {ref}() raised "
                              f"{type(e).__name__}: {e}") from None
        # Reading items on the driver is new to it (the workers read them): a dataset that reads
        # only on worker nodes still trains; its resume check compares the length alone.
        log.warning("train.dataset: reading items of the dataset from %s() for its fingerprint raised %s: %s; "
                    "a resume is checked against its length only", ref, type(e).__name__, e)
        fingerprint = None
    return n, fingerprint


def _check_resume(storage: Storage, job: JobConfig, num_samples: int, fingerprint: str | None = None) -> None:
    """A run resumes from its newest committed checkpoint that loads (same run.name and storage):
    the newest, or an older one where a restore finds the newer ones' bytes changed (only a
    restore reads them all), so every committed checkpoint is checked here. Its data
    cursor counts positions in the sample order, which is a function of the global batch size,
    the seed and the number of samples: with any of them changed the cursor points into another
    order, and samples would be skipped or repeated without a word. Another dataset of the same
    length keeps the order but not the samples: its fingerprint tells it apart
    (elastic/data/fingerprint.py). Refuse both here; a manifest from before a value was recorded
    is not checked on it."""
    root = checkpoints_root(storage.uri, job.run.name)

    def skipped(uri: str, why: str) -> None:  # the restore skips it too, and loads an older one
        log.warning("checkpoint %s is skipped: %s", uri, why)
    try:
        found = committed_checkpoints(storage, root, on_skip=skipped)
    except StorageError as e:
        raise ConfigError(f"checkpoint.storage_uri: cannot read the run's checkpoints: {e}") from None
    tr = job.train
    data = f'train.dataset {tr.dataset}' if tr.dataset else tr.dataset_ref
    checks = {  # manifest key: (the job's value, how to name it, what to keep the same)
        "global_batch_size": (tr.global_batch_size, f"train.global_batch_size={tr.global_batch_size}", "value"),
        "seed": (job.run.seed, f"run.seed={job.run.seed}", "value"),
        "num_samples": (num_samples, f"{data} has {num_samples} samples", "dataset"),
    }
    unchecked = None  # the newest checkpoint with a fingerprint, when this dataset's has none
    for c in found:
        recorded = c.manifest.data_order  # empty in manifests from before it was recorded
        name = c.uri.rsplit("/", 1)[1]
        if c is not found[0]:
            name += " (which a restore loads if the newer ones do not)"
        for key, (value, what, same) in checks.items():
            if key in recorded and recorded[key] != value:
                raise ConfigError(f"{what} but the run's checkpoint {name} was written with {recorded[key]}: the "
                                  f"sample order would change; use a new run.name or the same {same}")
        written = recorded.get(FINGERPRINT_KEY)
        if written is None:
            continue
        if fingerprint is None:
            unchecked = unchecked or (name, written)
        elif fingerprint != written:
            raise ConfigError(f"{data} has fingerprint {fingerprint} but the run's checkpoint {name} was written "
                              f"with {written}: another dataset of the same length, or its items changed, and the "
                              f"data cursor would resume into other samples; use a new run.name or the same dataset "
                              f"(one whose items differ on purpose in each build can define fingerprint(); "
                              f"docs/data.md)")
    if unchecked is not None:
        log.warning("the run's checkpoint %s records dataset fingerprint %s, but this dataset's could not be "
                    "taken: resuming on its length alone", *unchecked)


def _warn_inline_credentials(job: JobConfig) -> None:
    """Credentials in the job work, but travel with it: say so once, naming the fields."""
    inline = named_secrets(job)
    if inline:
        log.warning("%s: credentials in the job are sent, in the clear, with the job to the controller and every "
                    "worker inside the Ray cluster (never into events, errors or logs); give them through the "
                    "environment instead (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, which s3fs reads) or the "
                    "platform's identity (IRSA on EKS): docs/guarantees.md#credentials-and-what-is-redacted",
                    ", ".join(inline))


def cpu_slots_needed(job: JobConfig) -> float:
    """CPU slots the job can use at its largest: every rank and every warm spare."""
    sc = job.scaling
    return sc.cpus_per_worker * (sc.max_size + sc.num_spares)


def stale_ray_address(timeout_s: float = 1.0) -> str | None:
    """The address a plain `ray.init()` would join, if nothing answers there: Ray keeps the last
    local cluster's address in its temp dir (`ray start`, and `ray.cluster_utils.Cluster`, which
    never removes it), and joins it even once that cluster is gone, retrying for minutes before
    it fails. None when there is no such address, or a Ray answers at it."""
    try:
        from ray._private.utils import read_ray_address
        address = read_ray_address()
    except Exception:  # noqa: BLE001 - a Ray without that file: nothing to check
        return None
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except (OSError, ValueError):
        return address


def _connect_or_start_ray(job: JobConfig, out=sys.stderr) -> None:
    """Join the Ray cluster this process belongs to, or start a local one sized for the job.
    A laptop with fewer cores than the job has workers still runs it (the workers share the
    cores, slower); a cluster with fewer CPU slots than the job needs is said so at once, not
    after a placement timeout (an autoscaler may still add nodes, so it is not an error)."""
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address or job.scaling.use_gpu:
            ray.init(log_to_driver=False)
        else:
            cores = os.cpu_count() or 1
            slots = max(cores, int(-(-cpu_slots_needed(job) // 1)))
            stale = stale_ray_address()
            if stale:
                print(f"elastic: no Ray answers at {stale}, the last local cluster Ray recorded (it is gone): "
                      f"starting a new one", file=out)
            try:
                # A fresh local Ray: give it the slots the job needs, even on fewer cores.
                ray.init(address="local" if stale else None, num_cpus=slots, log_to_driver=False)
            except ValueError as e:
                if "existing cluster" not in str(e):
                    raise
                ray.init(log_to_driver=False)  # a local cluster (`ray start`) runs already: join it as it is
            else:
                print(f"elastic: started a local Ray with {slots} CPU slots for {job.scaling.num_workers} workers"
                      + (f" (this machine has {cores} cores: the workers share them)" if slots > cores else ""),
                      file=out)
                return
    have = ray.cluster_resources().get("CPU", 0.0)
    need = job.scaling.cpus_per_worker * job.scaling.min_size
    if have < need:
        print(f"elastic: the Ray cluster has {have:g} CPU slots, the job needs at least {need:g} "
              f"(scaling.min_workers={job.scaling.min_size} x cpus_per_worker={job.scaling.cpus_per_worker:g}); "
              f"it waits up to failure.replacement_timeout_s={job.failure.replacement_timeout_s:g}s for capacity "
              f"(add nodes, or lower scaling.num_workers / cpus_per_worker)", file=out)


class _Progress:
    """Progress on the driver: a tqdm bar on a terminal; elsewhere (`ray job submit` logs,
    `kubectl logs`) one plain line every `every_s`, since a bar's carriage-return redraws fill a
    log file with partial lines. Faults and recoveries are printed as they happen either way."""

    NOTABLE = {"fault_injected", "failure_detected", "decision", "recovered", "checkpoint_skipped",
               "hang_detected", "user_error", "workers_replaced", "checkpoint_failed", "silence_detected", "silence_excused",
               "checkpoint_deferred", "checkpoint_retry", "persist_abandoned", "storage_unanswered",
               "fence_not_written", "logger_failed"}

    def __init__(self, total: int, out=None, every_s: float = 10.0):
        self.out = out or sys.stderr
        self.total, self.every_s = total, every_s
        self.t0 = time.time()
        self._last_line = float("-inf")
        self.bar = None
        if self.out.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="step", file=self.out, dynamic_ncols=True)

    def _write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=self.out, flush=True)

    def update(self, p: dict) -> None:
        from elastic.observability.report import describe_event
        for ev in p["events"]:
            if ev["kind"] in self.NOTABLE:
                self._write(f"[{ev['t'] - self.t0:6.1f}s] {describe_event(ev)}")
        loss = f"{p['loss']:.4f}" if p["loss"] is not None else "-"
        status = f"{p['state']} world={p['world_size']} loss={loss} failures={p['failures']}"
        if self.bar is not None:
            self.bar.n = p["step"]
            self.bar.set_postfix_str(status)
            self.bar.refresh()
        elif time.time() - self._last_line >= self.every_s:
            self._last_line = time.time()
            self._write(f"[{time.time() - self.t0:6.1f}s] step {p['step']}/{self.total} {status}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _check_scheduler(make, ref: str) -> None:
    """The schedule is replayed from the step count on every restore: it must be a torch
    LRScheduler stepped without arguments (not ReduceLROnPlateau, which follows a metric)."""
    import torch
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    try:
        sched = make(opt)
    except Exception as e:  # noqa: BLE001 - the user's factory
        raise ConfigError(f"train.scheduler: {ref}(optimizer) raised {type(e).__name__}: {e}") from None
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) or \
            not isinstance(sched, torch.optim.lr_scheduler.LRScheduler):
        raise ConfigError(f"train.scheduler: {ref} returned {type(sched).__name__}; it must return a torch "
                          f"LRScheduler whose state depends only on the step (ReduceLROnPlateau follows a metric, "
                          f"which elastic cannot replay on a restore)")
