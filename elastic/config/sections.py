"""The job's sections about how the run is kept alive: run, scaling, failure, checkpoint, stragglers."""
from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from elastic.config.base import Strict
from elastic.config.uris import check_storage_uri


class ScalingConfig(Strict):
    """How many ranks, how far the world may shrink and grow, spares and resources."""

    num_workers: int = Field(2, ge=1, description="Training ranks (one Ray actor each); the target size.")
    min_workers: int | None = Field(
        None, ge=1, description="Shrink down to this many ranks when lost ones cannot be replaced; default num_workers.")
    max_workers: int | None = Field(
        None, ge=1, description="Grow up to this many ranks when capacity appears; default num_workers.")
    shrink_after_s: float = Field(
        10.0, ge=0, description="How long a recovery waits for a replacement before shrinking (min_workers < size); "
                  "0: a warm spare or none, and the group grows back once a worker is warm.")
    grow_check_s: float = Field(10.0, gt=0, description="How often a run below max_workers looks for capacity.")
    num_spares: int = Field(
        0, ge=0, description="Warm spare workers (model built, compute calibrated, ready to receive state) that replace lost "
                 "or slow ranks; placed on other nodes where the cluster allows.")
    wait_for_spares: bool = Field(
        False, description="Start training only once the spares are warm and the pre-started workers up (drills and "
                           "benchmarks of those paths).")
    low_priority_refills: bool = Field(
        True, description="Spares that refill the pool while the group trains start under SCHED_IDLE (the lowest CPU "
                          "priority) until built, where the OS lets them return to normal (elastic/runtime/priority.py).")
    prestarted_per_node: int = Field(
        0, ge=0, description="Worker processes kept started on every node (Python, torch, the job's modules and dataset "
                 "loaded; no CPU held, started at the lowest priority). A lost rank is then replaced without a "
                 "process start, on its own node when its slot is free (elastic/group/prestart.py). CPU workers only.")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs reserved per worker actor.")
    use_gpu: bool = Field(False, description="One GPU per worker and NCCL; gloo on CPU otherwise.")


    @model_validator(mode="after")
    def _check_range(self) -> "ScalingConfig":
        if self.prestarted_per_node and self.use_gpu:
            raise ValueError("scaling.prestarted_per_node is for CPU workers only (a GPU is given to a process when "
                             "Ray starts it): set it to 0 with scaling.use_gpu: true")
        lo, hi = self.min_size, self.max_size
        if not lo <= self.num_workers <= hi:
            raise ValueError(f"need min_workers <= num_workers <= max_workers, got {lo} <= "
                             f"{self.num_workers} <= {hi}")
        return self

    @property
    def min_size(self) -> int:
        return self.min_workers if self.min_workers is not None else self.num_workers

    @property
    def max_size(self) -> int:
        return self.max_workers if self.max_workers is not None else self.num_workers


class FailureConfig(Strict):
    """How faults are detected (silence, heartbeat, hangs) and how many recoveries a run may make."""

    max_failures: int = Field(3, ge=0, description="Recoveries allowed before the run stops with an error.")
    peer_restore: bool = Field(
        True, description="Take state from memory when it holds everything (a surviving DDP replica; every FSDP rank's "
                      "shards at a planned resize); false: always through storage (a planned resize then "
                      "checkpoints the stop step first).")
    hang_factor: float = Field(
        10.0, gt=1, description="A hang is no completed step for max(hang_floor_s, hang_factor x the median step "
                                "time); the ranks that then answer no ping are the culprits."
    )
    hang_floor_s: float = Field(20.0, gt=0, description="The least time without a completed step that counts as a hang (see hang_factor).")
    ping_timeout_s: float = Field(
        1.0, gt=0, description="A rank that answers no poll for this long while the group makes no progress is "
                               "lost (a stopped machine, a partition, a stopped process); its peers' blocked "
                               "collectives are then aborted and they keep their state.")
    silence_factor: float = Field(
        2.0, gt=0, description="For a rank without a heartbeat, the silence bound is the longer of ping_timeout_s "
                               "and silence_factor x the median step time, for the rank's silence and the group's "
                               "lack of progress alike: a rank busy in a long step (a large model, a checkpoint's "
                               "first snapshot) may answer a poll late without being lost.")
    heartbeat: bool = Field(
        True, description="Run a small heartbeat process on each node (its agent's) that answers the controller over "
                          "UDP with each worker process's state, from outside its Python: a rank whose Python is held "
                          "(a C extension keeping the GIL) is then kept, and a stopped machine or process is found "
                          "after ping_timeout_s whatever the step time. Needs Linux and UDP from the driver to "
                          "the workers' nodes; without an answer a rank is judged by its polls alone.")
    rendezvous_timeout_s: float = Field(
        60.0, gt=0, description="Process-group formation timeout (the rendezvous store and connecting the ranks).")
    collective_timeout_s: float = Field(
        120.0, gt=0, description="Backstop timeout of one collective of the training and checkpoint groups; a "
                                 "collective blocked on a silent peer is aborted by the controller long before."
    )
    replacement_timeout_s: float = Field(
        60.0, gt=0, description="How long to wait for resources to start a replacement worker."
    )
    driver_progress_misses: int = Field(
        6, ge=1,
        description="The driver asks the controller for progress about twice a second and waits up "
                    "to 10 s for each answer. After this many answers missed in a row (the "
                    "controller's process frozen, starved or cut off from the driver: 6 is about a "
                    "minute), the driver stops the controller and fails the run, naming the newest "
                    "committed checkpoint.")


class CheckpointConfig(Strict):
    """Where checkpoints go, how often, how many are kept, and how long storage is waited for."""

    storage_uri: str = Field(
        "file://./runs", description="fsspec URI of the run root: file://, s3:// (s3fs) or memory://. Shards bound for "
                                     "anything but file:// are staged in the local temp dir (TMPDIR) first, so each "
                                     "worker needs its share of one checkpoint free there, and uploaded from a child "
                                     "process of each worker (memory:// uploads in the worker).")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="Passed to fsspec (e.g. endpoint_url, client_kwargs for s3). Give "
                                          "credentials through the environment (AWS_ACCESS_KEY_ID, "
                                          "AWS_SECRET_ACCESS_KEY) or the platform's identity: a key, secret or token "
                                          "here works but travels with the job to every worker (it is redacted from "
                                          "events, errors and elastic status).")
    every_steps: int = Field(10, ge=1, description="Checkpoint after every this many steps.")
    num_to_keep: int = Field(3, ge=1, description="Committed checkpoints kept; the newest is never removed.")
    memory_every_steps: int = Field(
        1, ge=0, description="State held once (fsdp; a pipeline with one replica; HSDP at one replica group): at most every this many steps "
                             "each rank copies its part into the host memory of a rank on another node (its buddy), "
                             "in the background; a fault restores from those copies and the survivors' own, with no "
                             "storage read. Copies are spaced further while one is on its way or to keep their "
                             "measured cost within memory_max_overhead (every rank skips the same ones), so the "
                             "steps redone are the steps since the last copy that reached its buddy. Each rank "
                             "holds its own last two parts and its buddies' last two. 0: off (a fault restores "
                             "the latest committed checkpoint). Replicated state restores from a surviving "
                             "replica without copies.")
    memory_sync: bool = Field(
        False, description="In-memory copies on the critical path: a copied step counts as done (reported, "
                           "its samples in the ledger) only once every rank's copy of it is at its buddy (every "
                           "rank sends its part to its buddy and receives the parts it keeps, rank to rank over "
                           "gloo, then one small all-reduce). A fault then redoes "
                           "no step with memory_every_steps 1 (the step under way when it strikes is lost, "
                           "never counted done), at the cost of every copy's send in each step's time "
                           "(memory_max_overhead does not apply). Off: copies go in the background, and up to "
                           "the steps since the last copy that reached its buddy are redone.")
    memory_max_overhead: float = Field(
        0.03, gt=0, le=1, description="The share of training time in-memory copies may cost: a copy is taken "
                                      "once the steps since the last one have run for its cost / this. A copy's "
                                      "cost: taking it, plus what the steps run during its send took beyond the "
                                      "steps without one. 1: as often as memory_every_steps allows.")
    memory_max_host_share: float = Field(
        0.25, gt=0, le=1, description="The share of each node's memory (Ray's view of it) in-memory copies may "
                                      "take. Checked before any worker starts, from the model and optimizer "
                                      "state built on the meta device: a job whose copies would take more on "
                                      "some node is refused, naming the estimate.")
    persist_retries: int = Field(5, ge=0, description="Retries of a background persist on storage errors.")
    persist_retry_backoff_s: float = Field(1.0, ge=0, description="First backoff between persist retries (doubles).")
    final_wait_s: float = Field(
        300.0, ge=0, description="If the run's last checkpoint did not commit (storage out longer than the persist's "
                                 "retries, a fence not landed yet), the ranks save the final state again until it "
                                 "commits, for at most this long; past it the run fails, naming the newest "
                                 "committed checkpoint. 0: no second try.")
    restore_wait_s: float = Field(
        300.0, ge=0, description="A restore that can only come from storage (no survivor holds the state) waits for "
                                 "storage this long: to list the committed checkpoints, and while none of them loads "
                                 "(asked again with backoff; the same failures twice while storage answers end it at "
                                 "once). Past it the run fails, naming the newest committed "
                                 "checkpoint. It never starts over from step 0 while committed checkpoints exist.")
    upload_timeout_s: float = Field(
        60.0, gt=0, le=86_400,
        description="The least time one rank's upload of a checkpoint is given before it counts as hung (a store "
                    "that took the connection and never answers); its bytes at upload_min_mb_per_s are added. "
                    "Past that bound the upload is cut short (its upload process killed) and fails like any storage "
                    "error: retried persist_retries times, then reported (checkpoint_failed).")
    upload_min_mb_per_s: float = Field(
        2.0, gt=0, description="The slowest upload (MB/s) not taken for a hang: an upload of B bytes is given "
                               "upload_timeout_s + B / upload_min_mb_per_s (a 1.2 GB shard: 660 s at the defaults).")
    persist_timeout_s: float = Field(
        1800.0, gt=0, le=7 * 86_400,
        description="The most one checkpoint persist may run (snapshot to commit, its retries included). One still "
                    "running past it is given up: its upload cut short, never committed, reported failed "
                    "(checkpoint_failed, 'timed out:'), and the checkpoint is owed, saved again like after a "
                    "storage failure. Training goes on. Where every rank waits for a persist (the last step, a "
                    "planned stop, a rollback) for longer than this plus 3 x failure.ping_timeout_s, the "
                    "controller fails the run (storage_timeout). Raise it for very large shards on slow storage.")

    @field_validator("storage_uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        return check_storage_uri(uri)

    @model_validator(mode="after")
    def _check_storage_timeouts(self) -> "CheckpointConfig":
        if self.memory_sync and not self.memory_every_steps:
            raise ValueError("checkpoint.memory_sync=true waits for in-memory copies, but "
                             "checkpoint.memory_every_steps=0 takes none: set memory_every_steps to 1 (a copy "
                             "every step, nothing redone after a fault) or leave memory_sync off")
        # s3fs bounds each request (connect_timeout 5 s, read_timeout 15 s, then its retries); None or
        # 0 given here would let one request that is never answered hold a persist or the controller.
        given = self.storage_options.get("config_kwargs") or {}
        for key in ("connect_timeout", "read_timeout"):
            if key in given:
                value = given[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                    raise ValueError(f"checkpoint.storage_options.config_kwargs.{key}={value!r}: a storage "
                                     f"request needs a finite timeout in seconds, greater than 0 (leave it out "
                                     f"for s3fs's default)")
        return self


class StragglerConfig(Strict):
    """Straggler detection and mitigation (see elastic/policies/straggler.py)."""

    enabled: bool = Field(False, description="Watch each rank's own compute time; swap a persistent straggler for a "
                                             "spare, else drop it if the world may shrink, else report it.")
    threshold: float = Field(1.5, gt=1, description="A rank's step is slow when its compute time is above "
                                                     "threshold x the other ranks' median at that step.")
    window_steps: int = Field(5, ge=1, description="Act on a rank slow in more than half of its last window_steps "
                                                   "steps (it is still slow now) and of its last window_steps x "
                                                   "consecutive_windows steps; checked at every step.")
    consecutive_windows: int = Field(2, ge=1, description="The longer span of window_steps: window_steps x "
                                                          "consecutive_windows steps (the window slides by one step).")
    cooldown_s: float = Field(30.0, ge=0, description="No new action this soon after the last one.")


class RunConfig(Strict):
    """The run's name, seed and length."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                      description="Run folder name: <storage_uri>/<name>/. A job submitted again with the same name and "
                                  "storage resumes from that run's latest committed checkpoint.")
    seed: int = Field(0, ge=0, description="Model init, data order and per-step RNG all derive from it.")
    num_steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    sample_ledger: bool = Field(
        False, description="Record which sample ids every step trained on (ledger.json in the run dir): "
                           "proof of exact-once data across failures and resizes. Costs memory; for drills.")
    lease_ttl_s: float = Field(
        30.0, ge=2.0, le=3600.0,
        description="One live run per run folder: the controller holds a lease in <run dir>/lease/, renewed every "
                    "lease_ttl_s / 4. A second driver on the same run is refused while the lease was renewed within "
                    "lease_ttl_s; one found older (its driver is gone, e.g. a KubeRay retry after the head was lost) "
                    "is taken over. Must exceed the clock skew between drivers' hosts.")
