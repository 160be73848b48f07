"""`python -m benchmarks churn`: goodput under a seeded schedule of faults.

Faults (kill_node, freeze_node, kill_process) arrive with exponential inter-arrival times (mean
`--mtbf-s`) for `--duration-s` on the local cluster (3 training nodes + 1 spare node, one CPU
each). They are injected from the benchmark driver, from outside the training job: at each
scheduled time a worker node that hosts a training rank is picked (seeded; for elastic, where its
event log places its ranks, so a warm spare is not a target on its own) and

  * kill_node: its raylet and every process under it are SIGKILLed (a lost machine);
  * freeze_node: the same processes are SIGSTOPped and never thawed (a machine that stops:
    no socket closes); the node is lost;
  * kill_process: one training process on it is SIGKILLed (the node stays).

A lost node is replaced `--replace-after-s` later by a fresh worker node, the way a cloud
replaces machines (a frozen one stays frozen until the system's window ends).

Every system trains the common workload (MLP ~1.3 M parameters, global batch 96, 3 workers,
checkpoint every 10 steps) in one continuous run: a warm-up, then a fault-free window whose
steps/s is that system's own baseline (same workload, same run), then the churn window of
`--duration-s` with the schedule. Progress at a moment is the highest step the training state
has reached by then (a step redone after a restore from an older checkpoint is not progress).

  goodput = (steps gained in the churn window / duration) / fault-free steps/s

The schedule (same seed) is the same for every system of a repetition; which node a fault hits
depends on where each system placed its processes, drawn from a seeded generator.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from benchmarks.output import emit, medians, parse_systems, report_against_peer, scratch_dir

NUM_WORKERS, CKPT_EVERY, GLOBAL_BATCH = 3, 10, 96
WARMUP_STEPS = 20  # steps before the fault-free window starts (group formed, caches warm)
SAMPLE_S = 0.25  # how often the driver samples a system's progress
ACTIONS = ("kill_node", "freeze_node", "kill_process")
LOSES_NODE = ("kill_node", "freeze_node")
METRICS = ["goodput", "goodput_rank_bound", "steps_per_s", "fault_free_steps_per_s", "faults"]
# the events kept beside each rank's step times (churn-steps-*.json): faults, recoveries, who is where
TRACE_EVENTS = ("failure_detected", "recovered", "workers_started", "workers_replaced", "decision",
                "group_formed", "checkpoint_committed", "spare_ready", "prestarted_ready")

ELASTIC_SYSTEMS = {
    "elastic": {"num_workers": NUM_WORKERS},
    "elastic-spare": {"num_workers": NUM_WORKERS, "num_spares": 1, "wait_for_spares": True},
    # A pre-started worker on every node (elastic/group/prestart.py)
    "elastic-prestart": {"num_workers": NUM_WORKERS, "prestarted_per_node": 1, "wait_for_spares": True},
    # A rank no warm worker can fill at once is left empty: the others go on at the smaller size
    # and the group grows back once a worker is warm (growth looked for every second).
    "elastic-shrink": {"num_workers": NUM_WORKERS, "min_workers": NUM_WORKERS - 1, "shrink_after_s": 0.0,
                       "grow_check_s": 1.0},
    "elastic-spare-shrink": {"num_workers": NUM_WORKERS, "num_spares": 1, "wait_for_spares": True,
                             "min_workers": NUM_WORKERS - 1, "shrink_after_s": 0.0, "grow_check_s": 1.0},
}
# Ray Train's elastic scaling, as its "Elastic training" guide sets it (benchmarks/ray_train_elastic.py):
# it restarts at the workers it can place, down to 2, and resizes when capacity returns (looked for
# every 10 s instead of Ray's 60 s default, in its favour).
RAY_TRAIN_ELASTIC_MONITOR_S = 10.0
RAY_TRAIN_SYSTEMS = ("ray-train", "ray-train-elastic", "ray-train-torchft")  # torchft: benchmarks/churn_torchft.py
SYSTEMS = [*ELASTIC_SYSTEMS, *RAY_TRAIN_SYSTEMS]
# Process titles of training processes (Ray names an actor's process `ray::<Class>...`).
TRAINING_TITLES = {**{s: ("ray::Worker",) for s in ELASTIC_SYSTEMS},
                   **{s: ("ray::RayTrainWorker",) for s in RAY_TRAIN_SYSTEMS}}


# ------------------------------------------------------------------------------------------ schedule
@dataclass(frozen=True)
class Fault:
    t_s: float  # seconds after the churn window starts
    action: str


def fault_schedule(seed: int, mtbf_s: float, duration_s: float, actions: tuple[str, ...] | list[str] = ACTIONS
                   ) -> list[Fault]:
    """Faults as a Poisson process: exponential gaps of mean `mtbf_s` from t=0, every fault with
    t < `duration_s`, each action drawn uniformly from `actions`. Pure and seeded: the same
    arguments give the same schedule."""
    if not mtbf_s > 0 or not math.isfinite(mtbf_s):
        raise ValueError(f"mtbf_s must be a positive number, got {mtbf_s}")
    if not duration_s >= 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    actions = tuple(actions)
    if not actions:
        raise ValueError("actions must not be empty")
    rng = random.Random(seed)
    out: list[Fault] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= duration_s:
            return out
        out.append(Fault(t, rng.choice(actions)))


# ------------------------------------------------------------------------------------------ injector
class ChurnInjector:
    """Runs a schedule against the local cluster and replaces lost nodes, driven by `tick()` from
    the driver's main thread (Ray starts nodes only from there).

    `t0` (time.time()) is the schedule's zero. A fault fires at its time (to within a sampling
    period, or the few seconds a replacement node takes to start) on a node that hosts a
    training process (its title starts with one of `titles`); if none does at that moment (a
    group being restarted) it fires as soon as one does, at the latest just before the next
    fault, else it is recorded as skipped."""

    def __init__(self, cluster, schedule: list[Fault], titles: tuple[str, ...], replace_after_s: float,
                 seed: int, rank_nodes: Callable[[], set[str]] | None = None,
                 rank_pids: Callable[[], set[int]] | None = None):
        self.cluster, self.schedule, self.titles = cluster, schedule, titles
        # Where the framework says its ranks are (node id prefixes), so a warm spare is not taken
        # for a rank; None: every process with a training title is a rank.
        self.rank_nodes = rank_nodes
        self.rank_pids = rank_pids  # elastic: only ranks' processes are training ones (not spares, pre-started)
        self.replace_after_s = replace_after_s
        self.rng = random.Random(f"churn-targets-{seed}")
        self.records: list[dict] = []
        self.replacements: list[dict] = []
        self._next = 0  # index of the next fault in the schedule
        self._due: list[tuple[float, dict]] = []  # (when, fault record) of lost nodes to replace
        self.t0: float | None = None
        self.stopped = False

    def start(self, t0: float) -> None:
        self.t0 = t0

    def stop(self) -> None:
        """No further faults or replacements."""
        self.stopped = True

    def _training_procs(self, node) -> list:
        import psutil
        out = []
        try:
            children = psutil.Process(self.cluster.raylet_pid(node)).children(recursive=True)
        except (psutil.Error, TypeError, ValueError):
            return []
        for p in children:
            try:
                title = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if title.startswith(self.titles) and (self.rank_pids is None or p.pid in self.rank_pids()):
                out.append((p, title))
        return out

    def _targets(self) -> list[tuple[Any, list]]:
        nodes = [n for n in list(self.cluster.cluster.worker_nodes) if self.cluster.node_usable(n)]
        if self.rank_nodes is not None:
            ranks = self.rank_nodes()
            nodes = [n for n in nodes if any(n.node_id.startswith(r) for r in ranks)]
        nodes.sort(key=lambda n: self.cluster.raylet_pid(n) or 0)
        out = []
        for n in nodes:
            procs = self._training_procs(n)
            if procs:
                out.append((n, procs))
        return out

    def tick(self) -> None:
        if self.t0 is None or self.stopped:
            return
        while self._next < len(self.schedule) and time.time() >= self.t0 + self.schedule[self._next].t_s:
            i = self._next
            next_t = self.t0 + self.schedule[i + 1].t_s if i + 1 < len(self.schedule) else math.inf
            targets = self._targets()
            if not targets and time.time() < next_t - 0.5:
                break  # nobody to hit right now: try again at the next tick
            self._next += 1
            self._fire(self.schedule[i], targets)
        now = time.time()
        for item in [d for d in self._due if d[0] <= now]:
            self._due.remove(item)
            self._replace(item[1])

    def _fire(self, fault: Fault, targets: list) -> None:
        rec: dict[str, Any] = {"t_s": round(fault.t_s, 3), "action": fault.action}
        self.records.append(rec)
        if not targets:
            rec["skipped"] = "no node hosted a training process until the next fault"
            return
        node, procs = targets[self.rng.randrange(len(targets))]
        rec.update(node=node.node_id[:8], titles=sorted({t.split(" ")[0] for _, t in procs}))
        if fault.action == "kill_node":
            self.cluster.kill_node(node)
        elif fault.action == "freeze_node":
            self.cluster.freeze_node(node)
        elif fault.action == "kill_process":
            p, title = procs[self.rng.randrange(len(procs))]
            rec.update(pid=p.pid, title=title.split(" ")[0])
            with contextlib.suppress(Exception):
                p.kill()
        else:
            raise ValueError(f"unknown churn action {fault.action!r}")
        rec["fired_s"] = round(time.time() - self.t0, 3)
        print(f"[churn] t={rec['fired_s']:.1f}s {fault.action} on node {rec['node']}", file=sys.stderr, flush=True)
        if fault.action in LOSES_NODE:
            self._due.append((time.time() + self.replace_after_s, rec))

    def _replace(self, rec: dict) -> None:
        t = time.time()
        try:
            node = self.cluster.add_worker_node()
            self.replacements.append({"for": rec["node"], "node": node.node_id[:8],
                                      "at_s": round(t - self.t0, 3), "start_s": round(time.time() - t, 3)})
        except Exception as e:  # noqa: BLE001 - report it with the run, the run goes on
            self.replacements.append({"for": rec["node"], "error": f"{type(e).__name__}: {e}"})


# ------------------------------------------------------------------------------------------ phases
class Phases:
    """The driver's clock for one system: warm-up (until WARMUP_STEPS), a fault-free window, then
    the churn window with the injector running. `get_step()` returns the highest step the
    training state has reached so far (or None if it cannot tell right now); `failed()` says
    whether the run has ended on its own."""

    def __init__(self, get_step: Callable[[], int | None], failed: Callable[[], bool], fault_free_s: float,
                 duration_s: float, injector: ChurnInjector, startup_timeout_s: float = 300.0):
        self.get_step, self.failed = get_step, failed
        self.fault_free_s, self.duration_s, self.injector = fault_free_s, duration_s, injector
        self.startup_timeout_s = startup_timeout_s
        self.marks: dict[str, tuple[float, int]] = {}
        self.error: str | None = None
        self.step = 0

    def _sample(self) -> int:
        s = self.get_step()
        if s is not None:
            self.step = max(self.step, s)
        return self.step

    def _until(self, deadline: float) -> bool:
        while time.time() < deadline:
            if self.failed():
                return False
            self._sample()
            self.injector.tick()
            time.sleep(SAMPLE_S)
        self._sample()
        return True

    def run(self) -> None:
        deadline = time.time() + self.startup_timeout_s
        while self._sample() < WARMUP_STEPS:
            if self.failed() or time.time() > deadline:
                self.error = f"did not reach step {WARMUP_STEPS} (warm-up) in {self.startup_timeout_s:.0f} s"
                return
            time.sleep(SAMPLE_S)
        t = time.time()
        self.marks["fault_free_start"] = (t, self.step)
        if not self._until(t + self.fault_free_s):
            self.error = "the run ended during the fault-free window"
            return
        t = time.time()
        self.marks["churn_start"] = (t, self.step)
        self.injector.start(t)
        ok = self._until(t + self.duration_s)
        self.marks["churn_end"] = (time.time(), self.step)
        self.injector.stop()
        if not ok:
            self.error = "the run ended (failed) inside the churn window"

    def figures(self) -> dict:
        out: dict[str, Any] = {}
        if "churn_start" in self.marks:
            (t0, s0), (t1, s1) = self.marks["fault_free_start"], self.marks["churn_start"]
            out["fault_free_steps_per_s"] = (s1 - s0) / (t1 - t0)
            out["fault_free_s"] = t1 - t0
        if "churn_end" in self.marks:
            (t0, s0) = self.marks["churn_start"]
            (t1, s1) = self.marks["churn_end"]
            # Divided by the configured duration: a run that died early does not shorten its window.
            window = max(t1 - t0, self.duration_s)
            out.update(steps=s1 - s0, window_s=window, steps_per_s=(s1 - s0) / window)
            if out.get("fault_free_steps_per_s"):
                out["goodput"] = out["steps_per_s"] / out["fault_free_steps_per_s"]
        return out


def below_full_figures(rank0_rows: list[list], formed: list[tuple[float, int]], first: int, last: int,
                       size: int) -> dict:
    """For a system that goes on at a smaller size: how many of the steps first < s <= last ran
    below full size, and their rate (steps after the first of each such stretch, over the time
    between them, so a recovery's gap is not counted): a reader can set it against the fault-free
    rate. And the steps counted as a cluster would make them: there each rank computes on its own
    device, so a step at w of `size` ranks (the same global batch) takes size/w as long; each
    counts w/size (`rank_bound_steps`). On this machine all ranks share two cores, and a smaller
    group's step is not slower. `rank0_rows`: rank 0's [step, end, ...]; `formed`: (time, world
    size) of each group formation."""
    formed = sorted(formed)
    below, timed, below_s, counted, prev = 0, 0, 0.0, 0.0, None  # prev: (end, below full) of the step before
    for row in sorted(rank0_rows):
        step, end = row[0], row[1]
        if not first < step <= last:
            continue
        w = min(next((ws for t, ws in reversed(formed) if t <= end), size), size)
        counted += w / size
        if w < size:
            below += 1
            if prev is not None and prev[1]:
                timed, below_s = timed + 1, below_s + end - prev[0]
        prev = (end, w < size)
    return {"steps_below_full": below, "seconds_below_full": round(below_s, 2),
            "steps_per_s_below_full": timed / below_s if below_s > 0 else None, "rank_bound_steps": counted}


def per_fault(records: list[dict], t0: float, detections: list[float], resumptions: list[float]) -> list[dict]:
    """Each fired fault with, where the system shows them, the time from the fault to its next
    detection and to the next moment training resumed (a recovered group's first step). Faults
    that land together share one recovery."""
    out = []
    for r in records:
        if "fired_s" not in r:
            continue
        t = t0 + r["fired_s"]
        d = min((x for x in detections if x >= t), default=None)
        b = min((x for x in resumptions if x >= t), default=None)
        out.append({"action": r["action"], "at_s": r["fired_s"],
                    "detect_s": None if d is None else round(d - t, 2),
                    "back_s": None if b is None else round(b - t, 2)})
    return out


# ------------------------------------------------------------------------------------------ elastic
def elastic_job(system: str, storage_uri: str) -> dict:
    return {
        "run": {"name": f"bench-churn-{system}-{uuid.uuid4().hex[:8]}", "num_steps": 10_000_000, "seed": 0},
        "scaling": ELASTIC_SYSTEMS[system],
        "failure": {"max_failures": 100_000},
        "checkpoint": {"storage_uri": storage_uri, "every_steps": CKPT_EVERY},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "optimizer": "elastic.workload:build_optimizer",
                  "global_batch_size": GLOBAL_BATCH},
    }


def run_elastic(system: str, cluster, storage_uri: str, schedule: list[Fault], args) -> tuple[dict, ChurnInjector]:
    """Drive elastic's controller as `Trainer.fit` does, sampling its progress; killed at the window's
    end (its workers are its actors and go with it)."""
    import ray

    from elastic import Trainer
    from elastic.controller import Controller
    from elastic.group.runtime_env import worker_runtime_env

    trainer = Trainer(elastic_job(system, storage_uri))  # the job's checks, as for any run
    controller = ray.remote(Controller).options(
        num_cpus=0, max_concurrency=8, resources={"node:__internal_head__": 0.001},
    ).remote(trainer.job.model_dump_json(), worker_runtime_env(trainer.job.model_dump_json()))
    done = controller.run.remote()
    events: list[dict] = []
    ended: dict = {}
    rank_node: dict[str, str] = {}  # rank -> node id prefix, from the controller's events
    rank_pids: set[int] = set()  # every process that held a rank, from the same events

    step_log: dict[int, dict[int, list]] = {}  # rank -> step -> [step, end, seconds, compute seconds]

    def get_step() -> int | None:
        after = min((max(rows) for rows in step_log.values() if rows), default=0)
        try:
            p = ray.get(controller.progress.remote(len(events), after), timeout=5)
        except Exception:  # noqa: BLE001 - a slow answer: sample again
            return None
        for r, rows in p.get("steps", {}).items():
            step_log.setdefault(int(r), {}).update((row[0], list(row)) for row in rows)
        events.extend(p["events"])
        for e in p["events"]:
            if e["kind"] in ("workers_started", "workers_replaced"):
                rank_node.update(e.get("nodes") or {})
                rank_pids.update(e.get("pids", {}).values())
            elif e["kind"] == "resized" and "nodes" in e:  # renumbered: every rank's node anew
                rank_node.clear()
                rank_node.update(e["nodes"])
                rank_pids.update(e.get("pids", {}).values())
        return p["step"]

    def failed() -> bool:
        if ended:
            return True
        ready, _ = ray.wait([done], timeout=0)
        if ready:
            try:
                ended.update(ray.get(done))
            except Exception as e:  # noqa: BLE001
                ended.update(status="error", error=f"controller died: {type(e).__name__}: {e}")
        return bool(ended)

    injector = ChurnInjector(cluster, schedule, TRAINING_TITLES[system], args.replace_after_s, args.seed_used,
                             rank_nodes=lambda: set(rank_node.values()), rank_pids=lambda: rank_pids)
    phases = Phases(get_step, failed, args.fault_free_s, args.duration_s, injector)
    try:
        phases.run()
        get_step()  # the events up to the end
    finally:
        injector.stop()
        ray.kill(controller)  # its workers are its actors and go with it
    t_churn = phases.marks.get("churn_start", (math.inf, 0))[0]
    t_end = phases.marks.get("churn_end", (math.inf, 0))[0]
    in_window = [e for e in events if t_churn <= e["t"] <= t_end + 1]
    rec = [e for e in in_window if e["kind"] == "recovered"]
    counts: dict[str, int] = {}
    for e in in_window:
        counts[e["kind"]] = counts.get(e["kind"], 0) + 1
    out = {**phases.figures(), "recoveries": len(rec),
           "recover_s": [round(e["recover_s"], 2) for e in rec],
           "lost_steps": [e.get("lost_steps") for e in rec],
           "event_counts": {k: v for k, v in counts.items() if k in (
               "failure_detected", "decision", "recovered", "silence_detected", "hang_detected", "group_error",
               "workers_replaced", "run_failed", "collective_failed", "spare_lost", "checkpoint_failed")},
           "run_dir": events[0].get("run_dir") if events else None,
           "trace": {"t_churn": t_churn, "t_end": t_end,
                     "steps": {r: [rows[k] for k in sorted(rows)] for r, rows in sorted(step_log.items())},
                     "events": [e for e in events if e["kind"] in TRACE_EVENTS]}}
    if "churn_end" in phases.marks and step_log.get(0):
        out.update(below_full_figures(list(step_log[0].values()),
                                      [(e["t"], e["world_size"]) for e in events if e["kind"] == "group_formed"],
                                      phases.marks["churn_start"][1], phases.marks["churn_end"][1], NUM_WORKERS))
        if out.get("fault_free_steps_per_s"):
            out["goodput_rank_bound"] = out["rank_bound_steps"] / out["window_s"] / out["fault_free_steps_per_s"]
    if injector.t0 is not None:
        # elastic's own recover_s/detect_s start at its detection here: it cannot know when an outside fault hit.
        out["per_fault"] = per_fault(injector.records, injector.t0,
                                     [e["t"] for e in events if e["kind"] == "failure_detected"],
                                     [e["t"] for e in events if e["kind"] == "recovered"])
    if phases.error or ended:
        out["error"] = phases.error or ended.get("error")
        out["run_status"] = ended.get("status")
    return out, injector


# ------------------------------------------------------------------------------------------ main
def _wait_for_free_cpus(cpus: float, timeout_s: float = 60.0) -> None:
    """Until the worker nodes' CPUs are free (the last system's actors gone); says what still holds
    them if they are not within `timeout_s`, and goes on."""
    import ray
    deadline = time.time() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < cpus:
        if time.time() > deadline:
            held = [(pg_id[:8], info.get("state")) for pg_id, info in ray.util.placement_group_table().items()
                    if info.get("state") != "REMOVED"]
            print(f"[churn] only {ray.available_resources().get('CPU', 0.0)} of {cpus} CPUs free after "
                  f"{timeout_s:.0f} s; placement groups not removed: {held}", file=sys.stderr, flush=True)
            return
        time.sleep(1.0)


def run_system(system: str, cluster, work: str, storage_uri: str, seed: int, args, params: int) -> dict:
    """One system through one schedule (seed): its record, and its step trace under `args.out`."""
    schedule = fault_schedule(seed, args.mtbf_s, args.duration_s)
    args.seed_used = seed
    cluster.ensure_worker_nodes(NUM_WORKERS + 1)
    _wait_for_free_cpus(NUM_WORKERS + 1)
    if system in RAY_TRAIN_SYSTEMS:
        from benchmarks.churn_ray_train import run_ray_train
        figs, injector = run_ray_train(cluster, work, schedule, args, system)
    else:
        figs, injector = run_elastic(system, cluster, storage_uri, schedule, args)
    trace = figs.pop("trace", None)
    if trace and args.out:  # each rank's step times, for `python -m benchmarks.probes.churn_steps`
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"churn-steps-{system}-seed{seed}.json"), "w") as f:
            json.dump({**trace, "fields": ["step", "end", "step_s", "compute_s"], "faults": injector.records}, f)
    fired = [r for r in injector.records if "fired_s" in r]
    return {"bench": "churn", "system": system, "rep": seed - args.seed, "goodput": figs.get("goodput"),
            "faults": len(fired), "mtbf_s": args.mtbf_s, "duration_s": args.duration_s,
            "replace_after_s": args.replace_after_s, "seed": seed,
            "steps": figs.get("steps"), "steps_per_s": figs.get("steps_per_s"),
            "fault_free_steps_per_s": figs.get("fault_free_steps_per_s"),
            **{k: v for k, v in figs.items() if k not in ("goodput", "steps", "steps_per_s", "fault_free_steps_per_s")},
            "faults_by_action": {a: sum(1 for r in fired if r["action"] == a) for a in ACTIONS},
            "fault_log": injector.records, "replacements": injector.replacements,
            "num_workers": NUM_WORKERS, "ckpt_every": CKPT_EVERY, "global_batch": GLOBAL_BATCH, "params": params}


def main(args) -> int:
    from elastic.local_cluster import local_cluster

    systems = parse_systems("churn", args.systems, list(SYSTEMS))
    if systems is None:
        return 2
    if args.mtbf_s <= 0 or args.duration_s <= 0 or args.replace_after_s < 0 or args.fault_free_s <= 0:
        print("python -m benchmarks churn: --mtbf-s, --duration-s and --fault-free-s must be > 0, --replace-after-s >= 0",
              file=sys.stderr)
        return 2
    from elastic.workload import build_model
    params = sum(p.numel() for p in build_model().parameters())
    records: list[dict] = []
    work = scratch_dir("elastic-bench-churn-")
    storage_uri = "file://" + os.path.join(work, "runs")
    # torchft's lighthouse needs a CPU on the driver's node: that system gets a cluster of its own
    # whose head has one (its workers kept to the worker nodes), after the others.
    for head_cpus, group in ((0, [s for s in systems if s != "ray-train-torchft"]),
                             (1, [s for s in systems if s == "ray-train-torchft"])):
        if not group:
            continue
        with local_cluster(num_worker_nodes=NUM_WORKERS + 1, cpus_per_node=1, head_cpus=head_cpus) as cluster:
            for rep in range(args.reps):
                for system in group:  # interleaved, same schedule: drift on a shared machine hits all alike
                    records.append(run_system(system, cluster, work, storage_uri, args.seed + rep, args, params))
                    emit(records[-1])
            cluster.ensure_worker_nodes(NUM_WORKERS + 1)  # drop frozen nodes before shutdown
    med = medians(records, METRICS)
    notes = [f"goodput = steps/s over a {args.duration_s:g} s churn window / fault-free steps/s of the same run "
             f"({args.fault_free_s:g} s window right before it); progress = highest step reached",
             f"faults: seeded Poisson schedule (MTBF {args.mtbf_s:g} s, seed {args.seed}+rep) of "
             f"{', '.join(ACTIONS)}, injected from the driver on a node hosting a training process; lost nodes "
             f"replaced after {args.replace_after_s:g} s",
             f"{NUM_WORKERS} workers + 1 spare node (local ray.cluster_utils.Cluster, 1 CPU each), MLP 1.3M params, "
             f"global batch {GLOBAL_BATCH}, checkpoint every {CKPT_EVERY} steps",
             "a fault's node is drawn among nodes hosting a rank (elastic: a `ray::Worker` on a node its event log "
             "names for a rank, so never a warm spare alone; Ray Train: a `ray::RayTrainWorker`)"]
    report_against_peer("churn", f"churn (MTBF {args.mtbf_s:g} s, {args.duration_s:g} s)", records, med, METRICS,
                        [s for s in systems if s not in RAY_TRAIN_SYSTEMS], "ray-train", notes, args.out)
    return 0
