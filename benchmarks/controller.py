"""`python -m benchmarks controller`: the controller's own cost at 1,000 and 10,000 ranks (`--ranks`
for others, e.g. 1000,10000,100000), `--ranks-per-node` on each node (default 8), without Ray.

The controller is driven one iteration at a time against a fake worker group
(`tests.support.fake_group`) whose ranks train on a fake clock; only the
controller's own work is timed (the fake's time is subtracted). Figures:
  * tick_ms: real milliseconds of one run-loop iteration (collect results, fold in
    every rank's poll answer, decide), median over the measured iterations;
  * fold_ms: real milliseconds the group spends turning one round of the node agents'
    aggregated answers (`NodePoll`, one per node) back into per-rank answers
    (`NodeAgents._fold`, elastic/group/node_agent.py), median;
  * beats_ms: real milliseconds the controller's pinger takes for one round: a ping to every
    node's sidecar (`Heartbeats.tick`, UDP to a listening loopback socket per node; pings_ms
    alone) and the beats of its ranks (`Heartbeats.beats`, the silent 1 % of them read);
  * cpu_share: (tick + fold + beats) / iteration period: the share of one core the
    controller's loop takes;
  * polls_per_s, pings_per_s: aggregated polls and heartbeat pings the group sent per
    second of (fake) run time, counted by the fake group: one per node per iteration each;
  * silence_to_decision_s: a rank freezes -> the Recovering decision, as
    iterations x max(poll interval, tick_s) (the fake clock gives the count).
Not included: Ray's cost of sending the polls and deserialising the answers.
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


class _Handle:
    """Stands in for a worker's actor handle where only its id is read."""

    def __init__(self, i: int):
        self._actor_id = bytes.fromhex(f"{i:032x}")


def fold_s(num_ranks: int, ranks_per_node: int, reps: int = 5) -> float:
    """Median seconds to fold one round of aggregated answers for `num_ranks` ranks."""
    from elastic.group.member import Member
    from elastic.group.node_agent import NodeAgents
    from elastic.protocol import NodePoll, PollReport, RankStatus

    agents = NodeAgents(heartbeat_on=False)
    members = {r: Member(r, _Handle(r), f"n{r // ranks_per_node}", "10.0.0.1", 1000 + r) for r in range(num_ranks)}
    replies = []
    for start in range(0, num_ranks, ranks_per_node):
        ranks = range(start, min(num_ranks, start + ranks_per_node))
        replies.append(NodePoll(epoch=0, actors={r: members[r].handle._actor_id.hex() for r in ranks},
                                answers={r: PollReport(rank=r, generation=1, status=RankStatus.RUNNING, step=5)
                                         for r in ranks}))
    times = []
    for _ in range(reps):
        answers, silent = {}, {}
        t0 = time.perf_counter()
        for reply in replies:
            agents._fold(reply, members, t0, answers, silent)
        times.append(time.perf_counter() - t0)
        assert len(answers) == num_ranks
    return statistics.median(times)


def _heartbeats(num_ranks: int, ranks_per_node: int):
    """A pinger watching `num_ranks` ranks, `ranks_per_node` per node, one loopback address per
    node (nothing listens there: a ping is sent and never answered)."""
    from elastic.runtime.heartbeat import Heartbeats

    hb = Heartbeats(interval_s=0.0)
    targets = {r: (f"127.{r // ranks_per_node // 65536 + 1}.{r // ranks_per_node // 256 % 256}."
                   f"{r // ranks_per_node % 256}", 40000, 1000 + r) for r in range(num_ranks)}
    hb.watch(targets)
    return hb, targets


def pings_s(num_ranks: int, ranks_per_node: int, reps: int = 5) -> tuple[float, bool]:
    """Median seconds of one round of heartbeat pings (`Heartbeats.tick`): one datagram per node,
    each to a socket of its own that listens on loopback, as a node's sidecar would (without one
    a send meets the kernel's "port unreachable" from the last round, an error path a real round
    does not take). Falls back to unlistened addresses where this process may not open a socket per
    node. Returns (seconds, whether each node had a listener)."""
    import socket

    from elastic.runtime.heartbeat import Heartbeats

    nodes = -(-num_ranks // ranks_per_node)
    socks: list[socket.socket] = []
    try:
        for _ in range(nodes):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        hb = Heartbeats(interval_s=0.0)
        ports = [s.getsockname()[1] for s in socks]
        hb.watch({r: ("127.0.0.1", ports[r // ranks_per_node], 1000 + r) for r in range(num_ranks)})
        listened = True
    except OSError:  # too many open files: ping addresses nobody listens on
        for s in socks:
            s.close()
        socks = []
        hb, _ = _heartbeats(num_ranks, ranks_per_node)
        listened = False
    times = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            hb.tick()
            times.append(time.perf_counter() - t0)
            for s in socks:  # the sidecars read their pings (not timed)
                s.setblocking(False)
                try:
                    s.recv(256)
                except BlockingIOError:
                    pass
    finally:
        hb.close()
        for s in socks:
            s.close()
    return statistics.median(times), listened


def beats_s(num_ranks: int, ranks_per_node: int, reps: int = 5) -> float:
    """Median seconds of `Heartbeats.beats()` with every node's sidecar answered for all its ranks,
    and the run loop reading the beats of 1 % of the ranks (the silent ones)."""
    hb, targets = _heartbeats(num_ranks, ranks_per_node)
    for (ip, port), token in hb._token.items():
        hb._last[token] = (1, {})
    for r, (ip, port, pid) in targets.items():
        hb._last[hb._token[(ip, port)]][1][pid] = ("S", 5)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = hb.beats()
        read = [out.get(r) for r in range(0, num_ranks, 100)]
        times.append(time.perf_counter() - t0)
        assert len(out) == num_ranks and all(b is not None for b in read)
    hb.close()
    return statistics.median(times)


def measure(num_ranks: int, ranks_per_node: int = 8, iters: int = 20) -> dict:
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
    ticks = []
    sent0, t0_fake = group.control_traffic(), clock()
    for _ in range(iters):
        group.self_s = 0.0
        t0 = time.perf_counter()
        c.step_once()
        ticks.append(time.perf_counter() - t0 - group.self_s)
    tick_s = statistics.median(ticks)
    sent, elapsed = group.control_traffic(), clock() - t0_fake
    fold, beats = fold_s(num_ranks, ranks_per_node), beats_s(num_ranks, ranks_per_node)
    pings, listened = pings_s(num_ranks, ranks_per_node)
    beats += pings
    period_s = max(POLL_INTERVAL_S, tick_s + fold + beats)
    group.freeze(num_ranks // 2)
    n = 0
    while not isinstance(c.state, Recovering):
        c.step_once()
        n += 1
    c.events.flush(timeout_s=5)
    nodes = -(-num_ranks // ranks_per_node)
    return {"bench": "controller", "system": f"{num_ranks} ranks", "ranks": num_ranks, "nodes": nodes,
            "ranks_per_node": ranks_per_node, "tick_ms": tick_s * 1e3, "fold_ms": fold * 1e3,
            "beats_ms": beats * 1e3, "pings_ms": pings * 1e3, "pings_listened": listened, "cpu_share": (tick_s + fold + beats) / period_s,
            # counted over fake time, where an iteration is POLL_INTERVAL_S; at a longer period, fewer
            "polls_per_s": (sent["agent_polls"] - sent0["agent_polls"]) / elapsed * POLL_INTERVAL_S / period_s,
            "pings_per_s": (sent["heartbeat_pings"] - sent0["heartbeat_pings"]) / elapsed * POLL_INTERVAL_S / period_s,
            "iterations_to_decision": n,
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
    metrics = ["tick_ms", "fold_ms", "beats_ms", "cpu_share", "polls_per_s", "pings_per_s", "silence_to_decision_s"]
    med = medians(records, metrics)
    table = markdown_table(med, metrics, "controller scale (fake worker group, no Ray)",
                           ["tick_ms: one run-loop iteration of the controller's own code (the fake group's time "
                            "subtracted; Ray's RPC cost of sending and receiving the polls is not included)",
                            f"{per_node} ranks per node, each node polled through its agent: polls and heartbeat "
                            "pings counted per second of run time; fold_ms: the nodes' aggregated answers turned into "
                            "per-rank answers; beats_ms: a round of heartbeat pings, one per node, and the beats read; "
                            "cpu_share: (tick + fold + beats) / iteration period",
                            "silence -> decision: iterations x max(poll interval, tick + fold + beats)"])
    print(table)
    if args.out:
        write_outputs(args.out, "controller", records, table, "tick_ms")
    return 0
