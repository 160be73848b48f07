"""`python -m benchmarks controller`: the controller's own cost at 1,000 and 10,000 ranks (`--ranks`
for others, e.g. 1000,10000,100000), `--ranks-per-node` on each node (default 8), without Ray.

The controller is driven one iteration at a time against a fake worker group
(`tests.support.fake_group`) whose ranks train on a fake clock; only the
controller's own work is timed (the fake's time is subtracted). Figures:
  * tick_ms: real milliseconds of one run-loop iteration (collect results, fold in
    every rank's poll answer, decide), median over the measured iterations;
  * fold_ms: real milliseconds the group spends on one round of the node agents' aggregated
    answers (`NodePoll`, one per node), less Ray's: folding them into per-rank answers, checking
    silence, reading the waits the loop asks for (`NodeAgents.settle`, `unanswered_s`,
    elastic/group/node_agent.py), median;
  * beats_ms: real milliseconds the run loop spends reading the heartbeat: a snapshot of the
    nodes' answers and the beats of the silent 1 % of its ranks (`Heartbeats.beats`);
  * pinger_cpu_share, answered_share: the pinger runs in a process of its own
    (elastic/runtime/pinger.py), as in a real run, throughout the measured iterations, pinging a
    stand-in sidecar per node in another process (benchmarks/probes/sidecars.py): the share of a
    core it used, and the smallest share of nodes that had answered one of the last two rounds
    in its snapshot. The run loop's figures are measured while both run (on this 2-core machine
    they compete with it for the cores);
  * cpu_share: (tick + fold + beats) / iteration period: the share of one core the
    controller's loop takes;
  * polls_per_s: aggregated polls the group sent per second of (fake) run time, counted by the
    fake group (one per node per iteration); pings_per_s: heartbeat pings the pinger sent per
    second of real time;
  * silence_to_decision_s: a rank freezes -> the Recovering decision, as
    iterations x max(poll interval, tick + fold + beats) (the fake clock gives the count).
Not included: Ray's cost of sending the polls and deserialising the answers.
"""
from __future__ import annotations

import os
import statistics
import time
import uuid
from contextlib import contextmanager

from benchmarks.output import emit, int_list, markdown_table, medians, write_outputs

RANKS = (1_000, 10_000)


def parse_ranks(arg: str | None) -> list[int]:
    """`--ranks 1000,10000,100000`: the simulated group sizes (default RANKS)."""
    return int_list("--ranks", arg, minimum=2) if arg else list(RANKS)


class _Handle:
    """Stands in for a worker's actor handle where only its id is read."""

    def __init__(self, i: int):
        self._actor_id = bytes.fromhex(f"{i:032x}")


def fold_s(num_ranks: int, ranks_per_node: int, reps: int = 5) -> float:
    """Median seconds of the controller's side of one round of aggregated polls for `num_ranks`
    ranks, less Ray's: every node's answer folded in, silence checked, and the waits of the
    silent 1 % read (`NodeAgents.settle`, `unanswered_s`); the members unchanged since the agents
    were last told of them (the usual case)."""
    from elastic.group.member import Member, Members
    from elastic.group.node_agent import NodeAgents
    from elastic.protocol import NodePoll, PollReport, RankStatus

    agents = NodeAgents(heartbeat_on=False)
    members = Members({r: Member(r, _Handle(r), f"n{r // ranks_per_node}", "10.0.0.1", 1000 + r)
                       for r in range(num_ranks)})
    replies = []
    for start in range(0, num_ranks, ranks_per_node):
        ranks = range(start, min(num_ranks, start + ranks_per_node))
        node = f"n{start // ranks_per_node}"
        agents._told[node] = {r: members[r].actor_hex for r in ranks}  # as `sync` leaves them
        replies.append((node, NodePoll(epoch=0, actors={r: members[r].actor_hex for r in ranks},
                                       answers={r: PollReport(rank=r, generation=1, status=RankStatus.RUNNING, step=5)
                                                for r in ranks})))
        agents._by_node[node] = list(ranks)
    agents._sync_key = (members.version, agents.epoch, 0)
    times = []
    for _ in range(reps):
        answers, silent = {}, {}
        t0 = time.perf_counter()
        agents.settle([(node, t0 - 0.01, reply) for node, reply in replies], members, t0, 1.0, answers, silent)
        unanswered = agents.unanswered_s()
        [unanswered.get(r) for r in range(0, num_ranks, 100)]  # the run loop reads the silent ranks'
        times.append(time.perf_counter() - t0)
        assert len(answers) == num_ranks and not silent
    return statistics.median(times)


@contextmanager
def live_pinger(num_ranks: int, ranks_per_node: int):
    """The controller's pinger in its own process, as the worker group runs it
    (elastic/runtime/pinger.py), pinging one stand-in sidecar per node: sockets in another process
    (benchmarks/probes/sidecars.py) that answer for their node's ranks as a sidecar does. What the
    run loop is measured against while it runs."""
    import subprocess
    import sys

    from elastic.runtime.ping_auth import PingAuth
    from elastic.runtime.pinger import PingerProcess

    nodes = -(-num_ranks // ranks_per_node)
    side = subprocess.Popen([sys.executable, "-m", "benchmarks.probes.sidecars", str(nodes), str(ranks_per_node)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    hb = PingerProcess(PingAuth.new("127.0.0.1"))  # the stand-ins answer any token
    try:
        ports = [int(p) for p in side.stdout.readline().split()]
        if len(ports) != nodes:
            raise RuntimeError(f"the stand-in sidecars did not start (exit code {side.poll()})")
        hb.watch({r: ("127.0.0.1", ports[r // ranks_per_node], 1000 + r) for r in range(num_ranks)})
        deadline = time.monotonic() + 60
        while answered_share(hb, nodes) < 0.99:  # a first round answered: the pinger is up to speed
            if time.monotonic() > deadline:
                raise RuntimeError("the stand-in sidecars did not answer within 60 s")
            time.sleep(0.05)
        yield hb
    finally:
        hb.close()
        side.stdin.close()
        side.wait(timeout=30)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def answered_share(hb, nodes: int) -> float:
    """The share of nodes whose sidecar answered one of the last two rounds of pings, in the
    pinger's newest snapshot."""
    beats = hb.beats()
    return sum(1 for seq, _ in beats._last.values() if seq >= hb.rounds - 1) / nodes


def measure(num_ranks: int, ranks_per_node: int = 8, iters: int = 20) -> dict:
    """One repetition at `num_ranks`: at least `iters` run-loop iterations, and at least 2 s of
    them, with the pinger running."""
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
    group = FakeGroup(clock, heartbeats=True, ranks_per_node=ranks_per_node)
    c = Controller(job.model_dump_json(), group=group, clock=clock, wall=clock)
    while c.step < 3:  # started, formed, restored, a few steps done
        c.step_once()
    nodes = -(-num_ranks // ranks_per_node)
    with live_pinger(num_ranks, ranks_per_node) as hb:
        cpu0, wall0, pings0 = _cpu_s(hb.proc.pid), time.perf_counter(), hb.pings_sent
        ticks, answered, reads = [], [], []
        sent0, t0_fake = group.control_traffic(), clock()
        while len(ticks) < iters or time.perf_counter() - wall0 < 2.0:  # ten rounds of pings at least
            group.self_s = 0.0
            t0 = time.perf_counter()
            c.step_once()
            ticks.append(time.perf_counter() - t0 - group.self_s)
            t0 = time.perf_counter()  # the beats the loop reads: a snapshot, and the silent 1 %'s
            beats = hb.beats()
            [beats.get(r) for r in range(0, num_ranks, 100)]
            reads.append(time.perf_counter() - t0)
            answered.append(answered_share(hb, nodes))
        sent, elapsed = group.control_traffic(), clock() - t0_fake
        fold = fold_s(num_ranks, ranks_per_node)
        wall = time.perf_counter() - wall0
        pinger_cpu = (_cpu_s(hb.proc.pid) - cpu0) / wall
        pings_per_s = (hb.pings_sent - pings0) / wall
    tick_s, beats = statistics.median(ticks), statistics.median(reads)
    period_s = max(POLL_INTERVAL_S, tick_s + fold + beats)
    group.freeze(num_ranks // 2)
    n = 0
    while not isinstance(c.state, Recovering):
        c.step_once()
        n += 1
    c.events.flush(timeout_s=5)
    return {"bench": "controller", "system": f"{num_ranks} ranks", "ranks": num_ranks, "nodes": nodes,
            "ranks_per_node": ranks_per_node, "tick_ms": tick_s * 1e3, "fold_ms": fold * 1e3,
            "beats_ms": beats * 1e3, "pinger_cpu_share": pinger_cpu,
            "answered_share": min(answered), "cpu_share": (tick_s + fold + beats) / period_s,
            # counted over fake time, where an iteration is POLL_INTERVAL_S; at a longer period, fewer
            "polls_per_s": (sent["agent_polls"] - sent0["agent_polls"]) / elapsed * POLL_INTERVAL_S / period_s,
            "pings_per_s": pings_per_s, "iterations_to_decision": n,
            "silence_to_decision_s": n * period_s, "poll_interval_s": POLL_INTERVAL_S,
            "ping_timeout_s": job.failure.ping_timeout_s}


def main(args) -> int:
    ranks = parse_ranks(getattr(args, "ranks", None))
    per_node = getattr(args, "ranks_per_node", 8) or 8
    if per_node < 1:
        raise SystemExit(f"--ranks-per-node must be at least 1, got {per_node}")
    records = []
    for rep in range(args.reps):
        for n in ranks:
            rec = {**measure(n, per_node), "rep": rep}
            records.append(rec)
            emit(rec)
    metrics = ["tick_ms", "fold_ms", "beats_ms", "cpu_share", "pinger_cpu_share", "answered_share",
               "polls_per_s", "pings_per_s", "silence_to_decision_s"]
    med = medians(records, metrics)
    table = markdown_table(med, metrics, "controller scale (fake worker group, no Ray)",
                           ["tick_ms: one run-loop iteration of the controller's own code (the fake group's time "
                            "subtracted; Ray's RPC cost of sending and receiving the polls is not included)",
                            f"{per_node} ranks per node, each node polled through its agent: polls and heartbeat "
                            "pings counted per second of run time; fold_ms: the nodes' aggregated answers turned into "
                            "per-rank answers; beats_ms: the beats the loop reads; cpu_share: (tick + fold + beats) / "
                            "iteration period",
                            "the pinger in its own process throughout, one stand-in sidecar per node answering in "
                            "another: pinger_cpu_share, the pinger's share of a core; answered_share, the least share "
                            "of nodes that answered one of the last two rounds",
                            "silence -> decision: iterations x max(poll interval, tick + fold + beats)"])
    print(table)
    if args.out:
        write_outputs(args.out, "controller", records, table, "tick_ms")
    return 0
