"""`python -m benchmarks controller`: the controller's own cost at 1,000 and 10,000 ranks (`--ranks`
for others, e.g. 1000,10000,100000), without Ray.

The controller is driven one iteration at a time against a fake worker group
(`tests.support.fake_group`) whose ranks train on a fake clock; only the
controller's own work is timed (the fake's time is subtracted). Figures:
  * tick_ms: real milliseconds of one run-loop iteration (collect results, fold in
    every rank's poll answer, decide), median over the measured iterations;
  * poll_fanout_per_s: poll RPCs the controller would send per second, one
    per rank per iteration, at max(poll interval, tick_s) per iteration;
  * silence_to_decision_s: a rank freezes -> the Recovering decision, as
    iterations x max(poll interval, tick_s) (the fake clock gives the count).
"""
from __future__ import annotations

import statistics
import time
import uuid

from benchmarks.output import emit, int_list, markdown_table, medians, write_outputs

RANKS = (1_000, 10_000)


def parse_ranks(arg: str | None) -> list[int]:
    """`--ranks 1000,10000,100000`: the simulated group sizes (default RANKS)."""
    return int_list("--ranks", arg, minimum=2) if arg else list(RANKS)


def measure(num_ranks: int, iters: int = 20) -> dict:
    from elastic.config import JobConfig
    from elastic.controller.controller import Controller
    from elastic.controller.running import POLL_INTERVAL_S
    from elastic.controller.states import Recovering
    from tests.support.fake_group import FakeClock, FakeGroup

    clock = FakeClock()
    job = JobConfig.model_validate({
        "run": {"name": "scale", "num_steps": 1_000_000},
        "scaling": {"num_workers": num_ranks},
        "checkpoint": {"storage_uri": f"memory://bench-controller-{uuid.uuid4().hex[:8]}"},
        "train": {"model": "m:f", "dataset": "m:f", "loss": "m:f", "global_batch_size": num_ranks},
    })
    group = FakeGroup(clock)
    c = Controller(job.model_dump_json(), group=group, clock=clock, wall=clock)
    while c.step < 3:  # started, formed, restored, a few steps done
        c.step_once()
    ticks = []
    for _ in range(iters):
        group.self_s = 0.0
        t0 = time.perf_counter()
        c.step_once()
        ticks.append(time.perf_counter() - t0 - group.self_s)
    tick_s = statistics.median(ticks)
    period_s = max(POLL_INTERVAL_S, tick_s)
    group.freeze(num_ranks // 2)
    n = 0
    while not isinstance(c.state, Recovering):
        c.step_once()
        n += 1
    c.events.flush(timeout_s=5)
    return {"bench": "controller", "system": f"{num_ranks} ranks", "ranks": num_ranks, "tick_ms": tick_s * 1e3,
            "poll_fanout_per_s": num_ranks / period_s, "iterations_to_decision": n,
            "silence_to_decision_s": n * period_s, "poll_interval_s": POLL_INTERVAL_S,
            "ping_timeout_s": job.failure.ping_timeout_s}


def main(args) -> int:
    ranks = parse_ranks(getattr(args, "ranks", None))
    records = []
    for rep in range(args.reps):
        for n in ranks:
            rec = {**measure(n), "rep": rep}
            records.append(rec)
            emit(rec)
    metrics = ["tick_ms", "poll_fanout_per_s", "silence_to_decision_s"]
    med = medians(records, metrics)
    table = markdown_table(med, metrics, "controller scale (fake worker group, no Ray)",
                           ["tick_ms: one run-loop iteration of the controller's own code (the fake group's time "
                            "subtracted; Ray's RPC cost of sending and receiving the polls is not included)",
                            "poll fan-out: one poll per rank per iteration; silence -> decision: iterations x "
                            "max(poll interval, tick)"])
    print(table)
    if args.out:
        write_outputs(args.out, "controller", records, table, "tick_ms")
    return 0
